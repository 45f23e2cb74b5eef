"""Synthetic multi-query associative recall (MQAR) rows, for long-context evals.

Row layout (one segment): BOS, k1 v1 … kN vN, filler (token 0) …, q1 a1 … qN aN.
Keys come from [1, vocab/2), values from [vocab/2, vocab); the queries are the
keys in a random order and the loss is only on predicting each answer a_i from
its query q_i. A longer seq_len puts the queries further from the pairs.
"""

import numpy as np

from moe_jax.data import packing, tokenizer


class MQARRows:
  """Deterministic random-access MQAR rows: row i depends only on (seed, i)."""

  def __init__(self, seq_len: int, num_pairs: int, vocab: int = 256, seed: int = 0,
               length: int = 2**31 - 1):
    if 4 * num_pairs + 1 > seq_len:
      raise ValueError(f"mqar num_pairs={num_pairs} needs seq_len >= {4 * num_pairs + 1}, "
                       f"got {seq_len}")
    if not 4 <= vocab <= 256 or vocab // 2 - 1 < num_pairs:
      raise ValueError(f"mqar vocab={vocab} must be in [4, 256] with vocab/2 - 1 >= num_pairs="
                       f"{num_pairs} distinct keys")
    self.seq_len, self.num_pairs, self.vocab, self.seed, self.length = (
        seq_len, num_pairs, vocab, seed, length)

  def __len__(self):
    return self.length

  def __getitem__(self, i):
    rng = np.random.default_rng((self.seed, int(i)))
    n, half = self.num_pairs, self.vocab // 2
    keys_N = rng.choice(np.arange(1, half), size=n, replace=False)
    values_N = rng.integers(half, self.vocab, size=n)
    order_N = rng.permutation(n)
    tokens_L = np.zeros(self.seq_len, np.int32)
    tokens_L[0] = tokenizer.BOS
    tokens_L[1:1 + 2 * n:2], tokens_L[2:2 + 2 * n:2] = keys_N, values_N
    q0 = self.seq_len - 2 * n
    tokens_L[q0::2], tokens_L[q0 + 1::2] = keys_N[order_N], values_N[order_N]
    loss_mask_L = np.zeros(self.seq_len, np.float32)
    loss_mask_L[q0::2] = 1.0  # predict the answer that follows each query key
    return packing.single_segment_example(tokens_L, loss_mask_L)
