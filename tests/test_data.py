"""Tokenizer, packing (segments, positions, masked labels), splits, package documents, MQAR,
passkey and mixed rows, and grain iterators."""

import os
import time

import numpy as np
import pytest

from configs import tiny
from moe_jax import config as config_lib
from moe_jax.data import corpus, mqar, packing, passkey, pipeline, tokenizer


def test_tokenizer_round_trip():
  ids = tokenizer.encode("héllo\n")
  assert ids[0] == tokenizer.BOS and ids[-1] == tokenizer.EOS
  assert len(ids) == len("héllo\n".encode()) + 2
  assert tokenizer.decode(ids) == "héllo\n"


def _docs(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [tokenizer.encode(bytes(rng.integers(32, 127, n).astype(np.uint8))) for n in lengths]


def test_packing_segments_positions_and_labels():
  docs = _docs([3, 10, 1, 25, 4])  # token lengths 5, 12, 3, 27, 6 = 53 -> 4 rows of 16
  rows = packing.PackedRows(docs, seq_len=16)
  assert len(rows) == 4
  stream = np.concatenate(docs)
  doc_of = np.repeat(np.arange(len(docs)), [len(d) for d in docs])
  seen = 0
  for r in range(len(rows)):
    ex = rows[r]
    tok, tgt, seg, pos, mask = (ex[k] for k in ("tokens", "targets", "segment_ids", "positions",
                                                "loss_mask"))
    live = seg > 0
    n = int(live.sum())
    np.testing.assert_array_equal(tok[:n], stream[seen:seen + n])
    # Segment ids: 1, 2, ... in order, changing exactly where the document changes (or row starts).
    docs_here = doc_of[seen:seen + n]
    expected_seg = 1 + np.concatenate([[0], np.cumsum(docs_here[1:] != docs_here[:-1])])
    np.testing.assert_array_equal(seg[:n], expected_seg)
    for s in np.unique(seg[:n]):
      np.testing.assert_array_equal(pos[seg == s], np.arange((seg == s).sum()))
    # Every label is the next token of the same document; the others are masked.
    for t in range(16):
      if mask[t]:
        assert seg[t + 1] == seg[t] > 0 and tgt[t] == tok[t + 1]
        assert doc_of[seen + t] == doc_of[seen + t + 1]
      else:
        assert tgt[t] == tokenizer.PAD
    # Padding (only at the end of the last row) has segment 0 and no loss.
    assert np.all(tok[~live] == tokenizer.PAD) and not mask[~live].any()
    seen += n
  assert seen == len(stream) and (rows[3]["segment_ids"] == 0).sum() == 64 - 53
  # The masked positions are exactly the last token of each segment piece (plus padding).
  assert sum(int((rows[r]["loss_mask"] == 0).sum()) for r in range(4)) == (
      sum(len(np.unique(rows[r]["segment_ids"][rows[r]["segment_ids"] > 0])) for r in range(4))
      + 64 - 53)


def test_split_is_deterministic_and_disjoint():
  paths = corpus.stdlib_paths()
  a, b = corpus.split_paths(paths, 5), corpus.split_paths(list(reversed(paths)), 5)
  assert sorted(a["validation"]) == sorted(b["validation"])
  assert not set(a["train"]) & set(a["validation"])
  assert len(a["train"]) + len(a["validation"]) == len(paths)
  assert 0.02 < len(a["validation"]) / len(paths) < 0.08


def test_user_corpus_from_glob(tmp_path):
  for i in range(40):
    (tmp_path / f"doc{i}.txt").write_text(f"document number {i}\n" * (i + 1))
  c = tiny.get_config()
  c.data.source, c.data.paths, c.data.seq_len, c.data.val_percent = "files", str(
      tmp_path / "*.txt"), 64, 20
  srcs = pipeline.sources(c)
  text = b"".join(bytes(srcs[s].tokens_NxL[srcs[s].tokens_NxL < 256].astype(np.uint8))
                  for s in ("train", "validation"))
  assert text.count(b"document number") == sum(range(1, 41))
  with pytest.raises(ValueError, match="data.paths='/nonexistent/\\*.txt' matched no files"):
    corpus.glob_paths("/nonexistent/*.txt")


def test_train_passes_count_reads_of_a_finite_split(tmp_path):
  for i in range(20):
    (tmp_path / f"doc{i}.txt").write_bytes(bytes([65 + i]) * 200)   # 200 bytes each
  c = tiny.get_config()
  c.data.source, c.data.paths, c.data.seq_len, c.data.val_percent = "files", str(
      tmp_path / "*.txt"), 64, 20
  c.data.batch_size, c.schedule.total_steps = 4, 30
  train = pipeline.sources(c)["train"]
  n_train = len(corpus.split_paths(corpus.glob_paths(c.data.paths), 20)["train"])
  assert len(train) * 64 >= n_train * 200 > (len(train) - 1) * 64   # packed, no padding row
  assert pipeline.train_passes(train, c) == pytest.approx(30 * 4 / len(train))
  c.data.source = "mqar"   # generated: no passes
  assert pipeline.train_passes(train, c) is None


def test_mqar_rows_answer_each_query():
  rows = mqar.MQARRows(seq_len=64, num_pairs=8, vocab=64, seed=3)
  ex = rows[5]
  tok, tgt, mask = ex["tokens"], ex["targets"], ex["loss_mask"]
  pairs = dict(zip(tok[1:17:2].tolist(), tok[2:18:2].tolist()))
  assert len(pairs) == 8 and all(1 <= k < 32 <= v < 64 for k, v in pairs.items())
  queries = np.flatnonzero(mask)
  assert len(queries) == 8
  for t in queries:
    assert tgt[t] == pairs[int(tok[t])]
  np.testing.assert_array_equal(rows[5]["tokens"], tok)  # deterministic per index
  assert not np.array_equal(rows[6]["tokens"], tok)
  with pytest.raises(ValueError, match="num_pairs=20 needs seq_len >= 81"):
    mqar.MQARRows(seq_len=64, num_pairs=20)


def test_grain_iterator_state_restores_exact_order():
  c = tiny.get_config()
  c.data.seq_len, c.data.batch_size = 64, 4
  src = packing.PackedRows(_docs(range(1, 200)), c.data.seq_len)
  it = iter(pipeline.train_dataset(src, c))
  for _ in range(3):
    next(it)
  saved = it.get_state()
  expected = [next(it)["tokens"] for _ in range(4)]
  fresh = iter(pipeline.train_dataset(src, c))
  fresh.set_state(saved)
  for e in expected:
    np.testing.assert_array_equal(next(fresh)["tokens"], e)


class _CountingRows:
  """A row source that counts the rows read from it."""

  def __init__(self, rows):
    self.rows, self.reads = rows, 0

  def __len__(self):
    return len(self.rows)

  def __getitem__(self, i):
    self.reads += 1
    return self.rows[i]


@pytest.mark.parametrize("threads,prefetch", [(0, 0), (1, 2), (3, 4)])
def test_train_batches_are_read_only_prefetch_batches_ahead(threads, prefetch):
  """data.read_threads / data.prefetch_batches bound the read-ahead (grain's default read 500
  batches ahead while the first step compiled), and the batches do not depend on them."""
  c = tiny.get_config()
  c.data.seq_len, c.data.batch_size = 64, 4
  c.data.read_threads, c.data.prefetch_batches = threads, prefetch
  src = _CountingRows(packing.PackedRows(_docs(range(1, 400)), c.data.seq_len))
  it = iter(pipeline.train_dataset(src, c))
  got = [next(it)["tokens"] for _ in range(3)]
  time.sleep(0.5)   # time for reader threads to run ahead as far as they may
  ahead = prefetch if threads else 0
  assert src.reads <= (3 + ahead + threads) * c.data.batch_size, src.reads
  c.data.read_threads = c.data.prefetch_batches = 0
  ref = iter(pipeline.train_dataset(src.rows, c))
  for g in got:
    np.testing.assert_array_equal(g, next(ref)["tokens"])


def test_each_process_loads_its_rows_of_every_global_batch():
  """Two processes' batches, side by side, are the one-process batches (train and eval), and
  a batch that does not split over the processes is refused."""
  c = tiny.get_config()
  c.data.seq_len, c.data.batch_size, c.eval.num_batches = 64, 4, 2
  src = packing.PackedRows(_docs(range(1, 200)), c.data.seq_len)
  for make in (pipeline.train_dataset, pipeline.eval_dataset):
    one = iter(make(src, c, 0, 1))
    parts = [iter(make(src, c, p, 2)) for p in range(2)]
    for _ in range(2):
      halves = [next(it)["tokens"] for it in parts]
      assert halves[0].shape == (2, 64)
      np.testing.assert_array_equal(np.concatenate(halves), next(one)["tokens"])
  with pytest.raises(ValueError, match="data.batch_size=4 must be a multiple of the number "
                     "of processes \\(3\\)"):
    pipeline.train_dataset(src, c, 0, 3)


def test_unigram_entropy_of_uniform_bytes_is_8_bits():
  rows = packing.PackedRows([np.arange(256, dtype=np.int32).repeat(4)], 128)
  assert abs(pipeline.unigram_entropy_bits(rows) - 8.0) < 1e-9


def test_package_documents_are_stable_and_split_by_package():
  pkgs = corpus.stdlib_package_documents()
  assert pkgs == corpus.stdlib_package_documents()            # deterministic
  email = pkgs["email"]
  assert os.path.basename(email[0]) == "__init__.py"          # defining file first ...
  assert [os.path.basename(p) for p in email[1:]] == sorted(os.path.basename(p)
                                                             for p in email[1:])  # ... then by name
  split = corpus.split_packages(pkgs, 5)
  train = {p for ps in split["train"] for p in ps}
  val = {p for ps in split["validation"] for p in ps}
  assert not train & val and len(train) + len(val) == sum(len(ps) for ps in pkgs.values())
  val_dirs = {os.path.dirname(ps[0]) for ps in split["validation"] if len(ps) > 1}
  assert not any(os.path.dirname(p) in val_dirs for p in train)   # no package on both sides
  c = tiny.get_config()
  c.data.source, c.data.seq_len = "stdlib_packages", 256
  docs = pipeline.text_documents(c)
  assert len(docs["train"]) == len(split["train"]) and max(map(len, docs["validation"])) > 32768


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_passkey_rows_put_the_key_where_they_say(depth):
  rows = passkey.PasskeyRows(seq_len=2048, digits=5, depth=depth, seed=4)
  tokens, key_at, answer_at = rows.layout(7)
  n_filler = 2048 - 1 - len(passkey._key_sentence(b"00000")) - len(passkey.QUESTION) - 5
  assert key_at == 1 + round(depth * n_filler)
  text = bytes(tokens[1:].astype(np.uint8).tolist())
  key = text[key_at - 1 + len(b"The pass key is "):][:5]
  assert text[key_at - 1:].startswith(b"The pass key is " + key + b". Remember it.")
  assert key.isdigit() and text.endswith(passkey.QUESTION + key) and answer_at == 2048 - 5
  ex = rows[7]
  assert bytes(ex["targets"][ex["loss_mask"] > 0].astype(np.uint8).tolist()) == key
  assert ex["tokens"].shape == (2048,) and ex["tokens"][0] == tokenizer.BOS
  with pytest.raises(ValueError, match="passkey seq_len=64 must be at least"):
    passkey.PasskeyRows(seq_len=64)


def test_mixed_rows_hold_the_synthetic_share():
  c = tiny.get_config()
  c.data.synthetic_fraction, c.data.synthetic_tasks, c.data.seq_len = 0.25, "passkey,mqar", 256
  train = pipeline.sources(c)["train"]
  n_synth = len(train) - train.n_text
  assert abs(n_synth / len(train) - 0.25) < 0.01
  assert train[train.n_text]["loss_mask"].sum() == 5              # a passkey row: 5 digits
  assert train[train.n_text + 1]["loss_mask"].sum() == c.data.mqar_num_pairs   # then MQAR
  c.data.synthetic_tasks = "copy"
  with pytest.raises(ValueError, match="data.synthetic_tasks must be a comma-separated list"):
    config_lib.validate(c)
