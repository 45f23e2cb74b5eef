"""Synthetic passkey retrieval rows: find a number hidden far back in filler text.

Row layout (one segment): BOS, filler …, "The pass key is 48213. Remember it. 48213 is the
pass key.", filler …, "What is the pass key? The pass key is 48213". The loss is only on
the answer's digits. The key sentence starts at `depth` × the filler length (a fixed
fraction, or a random one per row when depth < 0), so at depth 0 the key is a whole row
away from the question.
"""

import numpy as np

from moe_jax.data import packing, tokenizer

FILLER = (b"The grass is green. The sky is blue. The sun is yellow. Here we go. "
          b"There and back again. ")
QUESTION = b"What is the pass key? The pass key is "


def _key_sentence(key: bytes) -> bytes:
  return b"The pass key is " + key + b". Remember it. " + key + b" is the pass key. "


class PasskeyRows:
  """Deterministic random-access passkey rows: row i depends only on (seed, i)."""

  def __init__(self, seq_len: int, digits: int = 5, depth: float = -1.0, seed: int = 0,
               length: int = 2**31 - 1):
    need = 1 + len(_key_sentence(b"0" * digits)) + len(QUESTION) + digits
    if seq_len < need:
      raise ValueError(f"passkey seq_len={seq_len} must be at least {need} for "
                       f"digits={digits}")
    if not (depth < 0 or 0.0 <= depth <= 1.0):
      raise ValueError(f"passkey depth={depth} must be in [0, 1], or negative for random")
    self.seq_len, self.digits, self.depth, self.seed, self.length = (
        seq_len, digits, depth, seed, length)

  def __len__(self):
    return self.length

  def layout(self, i):
    """(token ids [seq_len], the key sentence's first index, the answer's first index)."""
    rng = np.random.default_rng((self.seed, int(i)))
    key = bytes(rng.integers(ord("0"), ord("9") + 1, size=self.digits).astype(np.uint8))
    sentence, tail = _key_sentence(key), QUESTION + key
    n_filler = self.seq_len - 1 - len(sentence) - len(tail)
    depth = rng.random() if self.depth < 0 else self.depth
    at = int(round(depth * n_filler))
    filler = (FILLER * (n_filler // len(FILLER) + 1))[:n_filler]
    data = filler[:at] + sentence + filler[at:] + tail
    tokens_L = np.concatenate([[tokenizer.BOS], np.frombuffer(data, np.uint8)]).astype(np.int32)
    return tokens_L, 1 + at, self.seq_len - self.digits

  def __getitem__(self, i):
    tokens_L, _, answer = self.layout(i)
    loss_mask_L = np.zeros(self.seq_len, np.float32)
    loss_mask_L[answer - 1:self.seq_len - 1] = 1.0   # predict each answer digit
    return packing.single_segment_example(tokens_L, loss_mask_L)
