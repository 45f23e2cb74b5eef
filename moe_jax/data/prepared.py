"""A corpus tokenized and packed once (scripts/prepare_data.py), read back row by row.

A prepared directory holds `<split>-NNNNN-of-MMMMM.array_record` shards, one record per
packed row, and `meta.json` (tokenizer, seq_len, vocab size, rows per split, the split's
byte histogram for the unigram baseline). A record is the row's tokens (int32), its
segment starts (uint8) and each token's UTF-8 byte count (uint16), back to back. Rows are
read through grain's ArrayRecordDataSource, so a run opens in seconds whatever the corpus
size and its grain iterator checkpoints a position, not the data.
"""

import glob
import json
import os

import grain
import numpy as np

from moe_jax.data import packing, records

META = "meta.json"


def write(out_dir: str, split_rows: dict[str, packing.PackedRows], meta: dict,
          rows_per_shard: int = 4096):
  """Writes every split's rows as shards and meta.json (plus the rows' count)."""
  os.makedirs(out_dir, exist_ok=True)
  meta = dict(meta, rows={})
  for split, rows in split_rows.items():
    n_shards = max(1, -(-len(rows) // rows_per_shard))
    for s in range(n_shards):
      lo, hi = s * rows_per_shard, min(len(rows), (s + 1) * rows_per_shard)
      records.write_array_record(
          os.path.join(out_dir, f"{split}-{s:05d}-of-{n_shards:05d}.array_record"),
          [_encode_row(rows, i) for i in range(lo, hi)])
    meta["rows"][split] = len(rows)
  with open(os.path.join(out_dir, META), "w") as f:
    json.dump(meta, f, indent=2)


def _encode_row(rows: packing.PackedRows, i: int) -> bytes:
  return (rows.tokens_NxL[i].astype("<i4").tobytes() + rows.starts_NxL[i].astype(np.uint8).tobytes()
          + rows.bytes_NxL[i].astype("<u2").tobytes())


def read_meta(path: str) -> dict:
  meta_path = os.path.join(path, META)
  if not os.path.isfile(meta_path):
    raise ValueError(f"data.paths={path!r} is not a prepared corpus (no {META}); make one with "
                     "scripts/prepare_data.py")
  with open(meta_path) as f:
    return json.load(f)


class PreparedRows:
  """The rows of one split of a prepared directory (a grain random-access source)."""

  def __init__(self, path: str, split: str):
    meta = read_meta(path)
    self.seq_len, self.pad = meta["seq_len"], meta["pad"]
    self.byte_hist = np.asarray(meta["byte_hist"][split], np.int64)
    shards = sorted(glob.glob(os.path.join(path, f"{split}-*-of-*.array_record")))
    if not shards:
      raise ValueError(f"data.paths={path!r} has no {split} shards")
    self.source = grain.sources.ArrayRecordDataSource(shards)
    if len(self.source) != meta["rows"][split]:
      raise ValueError(f"data.paths={path!r}: {split} shards hold {len(self.source)} rows, "
                       f"{META} says {meta['rows'][split]}; prepare the corpus again")

  def __len__(self):
    return len(self.source)

  def __getitem__(self, i):
    L, raw = self.seq_len, bytes(self.source[i])
    tokens_L = np.frombuffer(raw, "<i4", L).astype(np.int32)
    starts_L = np.frombuffer(raw, np.uint8, L, 4 * L).astype(bool)
    bytes_L = np.frombuffer(raw, "<u2", L, 5 * L).astype(np.int32)
    return packing.row_example(tokens_L, starts_L, self.pad, bytes_L)
