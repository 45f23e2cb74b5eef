"""Corpus formats: JSONL, Parquet and ArrayRecord documents give the same batches as text
files holding the same documents; prepared (tokenized, packed) ArrayRecord shards give the
same rows as packing at start-up and resume mid-epoch exactly."""

import os

import numpy as np
import pytest

from configs import tiny
from moe_jax import config as config_lib
from moe_jax.data import corpus, pipeline, prepare, records, tokenizers

FIELDS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")


def _documents(n=48, seed=0):
  rng = np.random.default_rng(seed)
  words = ["def", "return", "x", "café", "☃", "𝄞", "\n", "    ", "import", "1", "\t", "—"]
  return [" ".join(rng.choice(words, int(rng.integers(1, 120)))) for _ in range(n)]


def _config(source, paths, seq_len=64):
  c = tiny.get_config()
  c.data.source, c.data.paths, c.data.seq_len, c.data.batch_size = source, paths, seq_len, 4
  c.data.val_percent, c.eval.num_batches = 20, 2
  return c


def _batches(ds, n):
  it = iter(ds)
  return [next(it) for _ in range(n)]


def _assert_same_batches(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert set(x) == set(y)
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


@pytest.mark.parametrize("fmt", records.FORMATS)
def test_record_formats_give_the_text_sources_batches(tmp_path, fmt):
  """The documents in two files of `fmt`, and the same documents as one text file each:
  the same train and validation batches, once the text files are split by the record
  keys (records split per record, text files per path)."""
  docs = _documents()
  halves = {"a": docs[:30], "b": docs[30:]}
  for name, part in halves.items():
    records.write(fmt, str(tmp_path / f"{name}.{fmt}"), part)
  c = _config(fmt, str(tmp_path / f"*.{fmt}"))
  got = pipeline.sources(c)
  # The same documents as text files, in the splits the record keys give.
  text_dir = tmp_path / "text"
  text_dir.mkdir()
  split = {"train": [], "validation": []}
  for name, part in halves.items():
    for i, doc in enumerate(part):
      path = text_dir / f"{name}_{i:03d}.txt"
      path.write_text(doc, encoding="utf-8")
      held_out = corpus.bucket(f"{name}.{fmt}#{i}") < c.data.val_percent * 100
      split["validation" if held_out else "train"].append(str(path))
  assert split["train"] and split["validation"]
  want = pipeline.text_rows(c, {k: corpus.read_documents(v) for k, v in split.items()})
  for name in ("train", "validation"):
    assert len(got[name]) == len(want[name])
  _assert_same_batches(_batches(pipeline.train_dataset(got["train"], c), 6),
                       _batches(pipeline.train_dataset(want["train"], c), 6))
  _assert_same_batches(list(pipeline.eval_dataset(got["validation"], c)),
                       list(pipeline.eval_dataset(want["validation"], c)))
  text = b"".join(bytes(r.tokens_NxL[r.tokens_NxL < 256].astype(np.uint8)) for r in got.values())
  assert text.decode("utf-8").count("café") == sum(d.count("café") for d in docs)


def test_bad_record_fields_and_paths_are_named(tmp_path):
  records.write("jsonl", str(tmp_path / "c.jsonl"), ["a", "b"], text_field="body")
  c = _config("jsonl", str(tmp_path / "*.jsonl"))
  with pytest.raises(ValueError, match=r"data.text_field='text': .*c.jsonl:1 has no string "
                     "field 'text'"):
    pipeline.sources(c)
  records.write("parquet", str(tmp_path / "c.parquet"), ["a", "b"], text_field="body")
  with pytest.raises(ValueError, match="data.text_field='text' is not a column"):
    pipeline.sources(_config("parquet", str(tmp_path / "*.parquet")))
  with pytest.raises(ValueError, match="data.paths must be a glob of parquet files when data.source='parquet', got ''"):
    config_lib.validate(_config("parquet", ""))
  with pytest.raises(ValueError, match="is not a prepared corpus"):
    config_lib.validate(_config("prepared", str(tmp_path)))


@pytest.fixture(scope="module")
def prepared_corpus(tmp_path_factory):
  """Text files prepared with a small SentencePiece tokenizer, shards of 16 rows."""
  from moe_jax.data import tokenizer_training
  root = tmp_path_factory.mktemp("prep")
  docs = _documents(80, seed=1)
  for i, d in enumerate(docs):
    (root / f"{i:03d}.txt").write_text(d, encoding="utf-8")
  spec = tokenizer_training.train([d.encode() for d in docs], library="sentencepiece",
                                  model="bpe", vocab_size=300, output=str(root / "tok.model"))
  c = _config("files", str(root / "*.txt"), seq_len=32)
  c.data.tokenizer = spec
  meta = prepare.prepare(c, str(root / "prepared"), rows_per_shard=16)
  return c, str(root / "prepared"), meta


def test_prepared_shards_hold_the_packed_rows(prepared_corpus):
  c, path, meta = prepared_corpus
  want = pipeline.text_rows(c)
  assert meta["rows"]["train"] > 32 and len(os.listdir(path)) > 3   # several shards
  pc = _config("prepared", path, seq_len=32)
  pc.data.tokenizer = c.data.tokenizer
  config_lib.validate(pc)
  assert tokenizers.configure(pc).vocab_size == pc.model.vocab_size == meta["vocab_size"]
  got = pipeline.sources(pc)
  for name in ("train", "validation"):
    assert len(got[name]) == len(want[name])
    for i in range(len(want[name])):
      a, b = got[name][i], want[name][i]
      for k in FIELDS + ("target_bytes",):
        np.testing.assert_array_equal(a[k], b[k], err_msg=f"{name}[{i}].{k}")
    np.testing.assert_array_equal(got[name].byte_hist, want[name].byte_hist)
  pc.data.seq_len = 64
  with pytest.raises(ValueError, match="data.seq_len must be 32, as .* was prepared with"):
    config_lib.validate(pc)
  pc.data.seq_len, pc.data.tokenizer = 32, "bytes"
  with pytest.raises(ValueError, match="data.tokenizer must be .*tok.model', as"):
    config_lib.validate(pc)


def test_resume_mid_epoch_is_exact_with_prepared_shards(prepared_corpus):
  """A grain iterator over the ArrayRecord rows, checkpointed mid-epoch and restored in a
  fresh pipeline, continues with the same batches across the epoch boundary."""
  c, path, meta = prepared_corpus
  pc = _config("prepared", path, seq_len=32)
  pc.data.tokenizer = c.data.tokenizer
  src = pipeline.sources(pc)["train"]
  steps_per_epoch = len(src) // pc.data.batch_size
  it = iter(pipeline.train_dataset(src, pc))
  for _ in range(steps_per_epoch - 2):
    next(it)
  saved = it.get_state()
  expected = [next(it) for _ in range(5)]           # crosses into the second epoch
  fresh = iter(pipeline.train_dataset(pipeline.sources(pc)["train"], pc))
  fresh.set_state(saved)
  _assert_same_batches([next(fresh) for _ in range(5)], expected)
  # The second epoch holds the same rows in a new order.
  first = np.concatenate([b["tokens"] for b in expected[:2]])
  second = np.concatenate([b["tokens"] for b in expected[2:]])
  assert not np.array_equal(first[:len(second)], second)
