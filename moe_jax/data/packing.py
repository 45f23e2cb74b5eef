"""Pack token streams into fixed-length rows with segment ids, positions and masked labels.

A row holds consecutive pieces of documents; a document that does not fit is
continued as a new segment in the next row. Segment ids number the pieces in a
row from 1; 0 marks padding (only at the end of the last row). A label is the
next token of the *same* segment, so no label crosses a document (or row) edge.
"""

import numpy as np

from moe_jax.data import tokenizer


class PackedRows:
  """Random-access rows of a packed corpus (a grain data source).

  `pad` is the tokenizer's PAD id. With `doc_bytes` (each token's UTF-8 byte count, from
  Tokenizer.encode_with_bytes) every row also carries "target_bytes", the bytes each label
  covers, which the eval sums for bits per byte."""

  def __init__(self, docs: list[np.ndarray], seq_len: int, pad: int = tokenizer.PAD,
               doc_bytes: list[np.ndarray] | None = None):
    self.pad = pad
    stream_N = np.concatenate(docs) if docs else np.zeros((0,), np.int32)
    starts_N = np.zeros(len(stream_N), bool)
    starts_N[np.cumsum([0] + [len(d) for d in docs[:-1]])] = len(stream_N) > 0
    n_rows = max(1, -(-len(stream_N) // seq_len))
    fill = n_rows * seq_len - len(stream_N)
    dtype = np.uint16 if max(int(stream_N.max(initial=0)), pad) < 1 << 16 else np.int32
    self.tokens_NxL = np.pad(stream_N, (0, fill), constant_values=pad).astype(
        dtype).reshape(n_rows, seq_len)
    self.starts_NxL = np.pad(starts_N, (0, fill)).reshape(n_rows, seq_len)
    self.starts_NxL[:, 0] = True  # a row always opens a segment (continued documents too)
    self.bytes_NxL = None
    if doc_bytes is not None:
      bytes_N = np.concatenate(doc_bytes) if doc_bytes else np.zeros((0,), np.int32)
      self.bytes_NxL = np.pad(bytes_N, (0, fill)).astype(np.uint16).reshape(n_rows, seq_len)

  def __len__(self):
    return len(self.tokens_NxL)

  def __getitem__(self, i):
    return row_example(self.tokens_NxL[i].astype(np.int32), self.starts_NxL[i], self.pad,
                       None if self.bytes_NxL is None else self.bytes_NxL[i])


def single_segment_example(tokens_L: np.ndarray, loss_mask_L: np.ndarray) -> dict:
  """Model inputs for a row that is one segment (the synthetic tasks): the label at t is
  token t + 1, trained where loss_mask_L is 1."""
  targets_L = np.full(len(tokens_L), tokenizer.PAD, np.int32)
  targets_L[:-1] = tokens_L[1:]
  return {
      "tokens": tokens_L,
      "targets": targets_L,
      "segment_ids": np.ones(len(tokens_L), np.int32),
      "positions": np.arange(len(tokens_L), dtype=np.int32),
      "loss_mask": loss_mask_L,
  }


def row_example(tokens_L: np.ndarray, starts_L: np.ndarray, pad: int = tokenizer.PAD,
                bytes_L: np.ndarray | None = None) -> dict[str, np.ndarray]:
  """Model inputs for one row: tokens, targets, segment_ids, positions, loss_mask (and,
  given each token's byte count, target_bytes: the bytes of each trained label)."""
  is_pad_L = tokens_L == pad
  segment_ids_L = np.where(is_pad_L, 0, np.cumsum(starts_L)).astype(np.int32)
  idx_L = np.arange(len(tokens_L))
  seg_start_L = np.maximum.accumulate(np.where(starts_L, idx_L, 0))
  positions_L = np.where(is_pad_L, 0, idx_L - seg_start_L).astype(np.int32)
  same_next_L = np.zeros(len(tokens_L), bool)
  same_next_L[:-1] = (segment_ids_L[1:] == segment_ids_L[:-1]) & (segment_ids_L[:-1] > 0)
  targets_L = np.where(same_next_L, np.roll(tokens_L, -1), pad).astype(np.int32)
  out = {
      "tokens": tokens_L,
      "targets": targets_L,
      "segment_ids": segment_ids_L,
      "positions": positions_L,
      "loss_mask": same_next_L.astype(np.float32),
  }
  if bytes_L is not None:
    out["target_bytes"] = np.where(same_next_L, np.roll(bytes_L, -1), 0).astype(np.int32)
  return out
