"""grain input pipelines: source → shuffle → repeat → batch, with checkpointable iterators."""

import math

import grain
import jax
import ml_collections
import numpy as np

from moe_jax import fields
from moe_jax.data import (corpus, image_tasks, mqar, packing, passkey, prepared, records,
                          task_rows, tokenizers)


def text_documents(c: ml_collections.ConfigDict) -> dict[str, list[bytes]]:
  """Train / validation documents of a document source (stdlib, stdlib_packages, files,
  jsonl, parquet, array_record)."""
  if c.data.source in records.FORMATS:
    return records.split_records(c.data.source, corpus.glob_paths(c.data.paths),
                                 c.data.text_field, c.data.val_percent)
  if c.data.source == "stdlib_packages":
    splits = corpus.split_packages(corpus.stdlib_package_documents(), c.data.val_percent)
    return {name: [b"".join(corpus.read_documents(ps)) for ps in packages]
            for name, packages in splits.items()}
  paths = corpus.stdlib_paths() if c.data.source == "stdlib" else corpus.glob_paths(c.data.paths)
  return {name: corpus.read_documents(ps)
          for name, ps in corpus.split_paths(paths, c.data.val_percent).items()}


def text_rows(c: ml_collections.ConfigDict, docs: dict[str, list[bytes]] | None = None,
              with_bytes: bool | None = None) -> dict[str, packing.PackedRows]:
  """Each split's documents through data.tokenizer, packed into data.seq_len rows; every
  split keeps its byte histogram. Rows carry target_bytes `with_bytes` (default: for a
  learned tokenizer; byte rows can go without, as the eval counts their labels below 256,
  and so mix with the byte-level synthetic and image rows, which have none)."""
  tok = tokenizers.load(c.data.tokenizer)
  with_bytes = c.data.tokenizer != "bytes" if with_bytes is None else with_bytes
  out = {}
  for name, split_docs in (text_documents(c) if docs is None else docs).items():
    if with_bytes:
      encoded = [tok.encode_with_bytes(d) for d in split_docs]
      rows = packing.PackedRows([ids for ids, _ in encoded], c.data.seq_len, tok.pad,
                                [nbytes for _, nbytes in encoded])
    else:
      rows = packing.PackedRows([tok.encode(d) for d in split_docs], c.data.seq_len, tok.pad)
    rows.byte_hist = np.bincount(np.frombuffer(b"".join(split_docs), np.uint8), minlength=256)
    out[name] = rows
  return out


class MixedRows:
  """Text rows followed by other rows (synthetic passkey / MQAR, or image documents; the
  sources taken in turn) so that `fraction` of all rows is the others; the train shuffle
  interleaves them."""

  def __init__(self, text, synthetic: list, fraction: float):
    self.text, self.synthetic = text, synthetic
    self.n_text = len(text)
    self.n_synth = int(round(self.n_text * fraction / (1.0 - fraction)))

  def __len__(self):
    return self.n_text + self.n_synth

  def __getitem__(self, i):
    if i < self.n_text:
      return self.text[i]
    j = i - self.n_text
    return self.synthetic[j % len(self.synthetic)][j // len(self.synthetic)]


def synthetic_sources(c: ml_collections.ConfigDict, seed: int) -> list:
  d = c.data
  make = {"passkey": lambda: passkey.PasskeyRows(d.seq_len, seed=seed),
          "mqar": lambda: mqar.MQARRows(d.seq_len, d.mqar_num_pairs, d.mqar_vocab, seed=seed)}
  return [make[t]() for t in fields.synthetic_tasks(d)]


def sources(c: ml_collections.ConfigDict) -> dict:
  """Random-access row sources for config.data: "train", "validation", and with
  data.image_fraction one held-out split per image task ("validation_digits", ...; their
  loss is on the answers only). A multimodal model (model.vision.patch_size > 0) gets the
  image fields in every row."""
  rows = _sources(c)
  v = c.model.vision
  if c.data.image_fraction:
    tasks = fields.image_tasks(c.data)
    rows["train"] = MixedRows(rows["train"], [image_tasks.TrainRows(
        tasks, v.patch_size, v.channels, c.data.seq_len, c.data.shuffle_seed)],
                              c.data.image_fraction)
    for t in tasks:
      rows[f"validation_{t}"] = image_tasks.HeldOutRows(t, v.patch_size, v.channels,
                                                        c.data.seq_len, c.data.batch_size)
  if v.patch_size:
    rows = {k: image_tasks.WithPatches(r, v.patch_size ** 2 * v.channels)
            for k, r in rows.items()}
  return rows


def _sources(c: ml_collections.ConfigDict) -> dict:
  d = c.data
  val_rows = c.eval.num_batches * d.batch_size
  if d.source == "tasks":
    return {"train": task_rows.TaskRows(d, d.seq_len, d.shuffle_seed, "train"),
            "validation": task_rows.TaskRows(d, d.seq_len, d.shuffle_seed, "eval",
                                             length=val_rows)}
  if d.source == "mqar":
    return {"train": mqar.MQARRows(d.seq_len, d.mqar_num_pairs, d.mqar_vocab, seed=d.shuffle_seed),
            "validation": mqar.MQARRows(d.seq_len, d.mqar_num_pairs, d.mqar_vocab,
                                        seed=d.shuffle_seed + 1, length=val_rows)}
  if d.source == "prepared":
    return {name: prepared.PreparedRows(d.paths, name) for name in ("train", "validation")}
  rows = text_rows(c)
  if d.synthetic_fraction:
    rows["train"] = MixedRows(rows["train"], synthetic_sources(c, d.shuffle_seed),
                              d.synthetic_fraction)
  return rows


def _stack(examples):
  return {k: np.stack([e[k] for e in examples]) for k in examples[0]}


def _process_shard(ds: grain.MapDataset, global_batch: int, index: int, count: int,
                   drop_remainder: bool) -> grain.MapDataset:
  """This process's rows of every global batch: the stream is cut into per-process batches
  of global_batch / count rows, and process p takes batches p, p + count, ... So global batch
  s is rows [s·B, (s+1)·B) of the stream, process 0's rows first, as with one process, and
  each process reads only its own rows."""
  if global_batch % count:
    raise ValueError(f"data.batch_size={global_batch} must be a multiple of the number of "
                     f"processes ({count})")
  ds = ds.batch(global_batch // count, drop_remainder=drop_remainder or count > 1,
                batch_fn=_stack)
  return ds if count == 1 else ds.slice(slice(index, None, count))


def train_dataset(source, c: ml_collections.ConfigDict, process_index: int | None = None,
                  process_count: int | None = None) -> grain.IterDataset:
  """Infinite, reshuffled each epoch; iterate with iter(), checkpoint with get_state().
  Yields this process's rows of each global batch (jax.process_index / process_count).

  data.read_threads make data.prefetch_batches batches ahead. grain's default (16 threads,
  500 elements ahead) made 500 batches while the first step traced and compiled, holding
  the GIL the trace needs (benchmarks/train.md)."""
  ds = grain.MapDataset.source(source).shuffle(seed=c.data.shuffle_seed).repeat()
  ds = _process_shard(ds, c.data.batch_size, *_process(process_index, process_count), True)
  return ds.to_iter_dataset(grain.ReadOptions(num_threads=c.data.read_threads,
                                              prefetch_buffer_size=c.data.prefetch_batches))


def eval_dataset(source, c: ml_collections.ConfigDict, process_index: int | None = None,
                 process_count: int | None = None) -> grain.MapDataset:
  """A fixed, seeded sample of eval.num_batches batches (same every evaluation); this
  process's rows of each."""
  ds = grain.MapDataset.source(source).shuffle(seed=1234)
  n = min(len(ds), c.eval.num_batches * c.data.batch_size)
  return _process_shard(ds.slice(slice(0, n)), c.data.batch_size,
                        *_process(process_index, process_count), False)


def _process(index, count) -> tuple[int, int]:
  return (jax.process_index() if index is None else index,
          jax.process_count() if count is None else count)


def train_passes(source, c: ml_collections.ConfigDict) -> float | None:
  """How many times schedule.total_steps of data.batch_size rows read a finite train split
  (a document or prepared source); None for generated sources. Above 1 a large model can
  memorise the split, and its validation loss turns up (benchmarks/gpu_tests.md, the
  1B's 2000 steps on the stdlib corpus)."""
  if c.data.source not in (*fields.DOCUMENT_SOURCES, "prepared"):
    return None
  return c.schedule.total_steps * c.data.batch_size / max(len(source), 1)


def unigram_entropy_bits(rows) -> float:
  """Byte-unigram entropy of a split's text, in bits per byte (from the byte histogram a
  text or prepared split keeps; else from the byte tokens of its packed rows)."""
  hist = getattr(rows, "byte_hist", None)   # (a WithPatches passes attributes on)
  if hist is None:
    hist = np.bincount(rows.tokens_NxL[rows.tokens_NxL < 256], minlength=256)
  p = hist / max(hist.sum(), 1)
  p = p[p > 0]
  return float(-(p * np.log2(p)).sum()) if p.size else math.nan
