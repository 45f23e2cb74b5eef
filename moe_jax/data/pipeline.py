"""grain input pipelines: source → shuffle → repeat → batch, with checkpointable iterators."""

import math

import grain
import ml_collections
import numpy as np

from moe_jax.data import corpus, mqar, packing, tokenizer


def _text_rows(c: ml_collections.ConfigDict) -> dict[str, packing.PackedRows]:
  paths = corpus.stdlib_paths() if c.data.source == "stdlib" else corpus.glob_paths(c.data.paths)
  splits = corpus.split_paths(paths, c.data.val_percent)
  return {name: packing.PackedRows([tokenizer.encode(d) for d in corpus.read_documents(ps)],
                                   c.data.seq_len)
          for name, ps in splits.items()}


def sources(c: ml_collections.ConfigDict) -> dict:
  """Random-access train / validation row sources for config.data."""
  d = c.data
  if d.source == "mqar":
    val_rows = c.eval.num_batches * d.batch_size
    return {"train": mqar.MQARRows(d.seq_len, d.mqar_num_pairs, d.mqar_vocab, seed=d.shuffle_seed),
            "validation": mqar.MQARRows(d.seq_len, d.mqar_num_pairs, d.mqar_vocab,
                                        seed=d.shuffle_seed + 1, length=val_rows)}
  return _text_rows(c)


def _stack(examples):
  return {k: np.stack([e[k] for e in examples]) for k in examples[0]}


def train_dataset(source, c: ml_collections.ConfigDict) -> grain.MapDataset:
  """Infinite, reshuffled each epoch; iterate with iter(), checkpoint with get_state()."""
  ds = grain.MapDataset.source(source).shuffle(seed=c.data.shuffle_seed).repeat()
  return ds.batch(c.data.batch_size, drop_remainder=True, batch_fn=_stack)


def eval_dataset(source, c: ml_collections.ConfigDict) -> grain.MapDataset:
  """A fixed, seeded sample of eval.num_batches batches (same every evaluation)."""
  ds = grain.MapDataset.source(source).shuffle(seed=1234)
  n = min(len(ds), c.eval.num_batches * c.data.batch_size)
  return ds.slice(slice(0, n)).batch(c.data.batch_size, batch_fn=_stack)


def unigram_entropy_bits(rows: packing.PackedRows) -> float:
  """Byte-unigram entropy of a packed split's text, in bits per byte."""
  tokens = rows.tokens_NxL[rows.tokens_NxL < 256]
  p = np.bincount(tokens, minlength=256) / max(tokens.size, 1)
  p = p[p > 0]
  return float(-(p * np.log2(p)).sum()) if p.size else math.nan
