"""Byte-level tokenizer: ids 0..255 are bytes, then BOS, EOS, PAD; a multimodal model
(model.vision.patch_size > 0) adds the image markers after them (data/images.py)."""

import numpy as np

BOS = 256
EOS = 257
PAD = 258
VOCAB_SIZE = 259
IMAGE_START = 259   # <image>
IMAGE_END = 260     # </image>
ROW_BREAK = 261     # after each row of patches
PATCH = 262         # a patch position: its embedding comes from the pixels, not the table
MULTIMODAL_VOCAB_SIZE = 263


def encode(text: str | bytes, *, bos: bool = True, eos: bool = True) -> np.ndarray:
  """UTF-8 bytes of `text` as int32 ids, framed by BOS/EOS."""
  data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
  ids_N = np.frombuffer(data, dtype=np.uint8).astype(np.int32)
  parts = ([np.array([BOS], np.int32)] if bos else []) + [ids_N] + (
      [np.array([EOS], np.int32)] if eos else [])
  return np.concatenate(parts)


def decode(ids) -> str:
  """Bytes of the ids below 256, decoded as UTF-8 (invalid sequences replaced); specials dropped."""
  ids = np.asarray(ids)
  return bytes(ids[ids < 256].astype(np.uint8).tolist()).decode("utf-8", errors="replace")
