"""Causal, segment-masked attention on TPU: jax's Pallas Mosaic flash attention
(jax.experimental.pallas.ops.tpu.flash_attention), forward and backward kernels, in the
[B, T, H, D] layout the model uses.

That kernel takes segment ids natively, so packed documents need no [T, T] mask. It wants
Dqk = Dv and key tiles of 128, so T a multiple of 128; other shapes take the XLA path
(`fits`). There is no interpret switch on it: on CPU the tests run it under
`pltpu.force_tpu_interpret_mode()`.
"""

import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import flash_attention as fa

BLOCK = 128   # the kernel's default tile: query and key positions per block


def fits(T, Dqk, Dv) -> bool:
  """Shapes the kernel takes: equal q/k and v head dims (its contract), a head dim of at
  most 128 or a multiple of 128, and T a whole number of 128-position tiles."""
  return Dqk == Dv and (Dqk <= 128 or Dqk % 128 == 0) and T % BLOCK == 0


def causal_attention(q_BxTxHxD, k_BxTxHxD, v_BxTxHxD, segment_ids_BxT):
  """softmax(q kᵀ / √D, causal, same segment only) v: [B, T, H, D] in q's dtype. Padding
  (id 0) attends to padding, as in the model's XLA path."""
  B, T, H, D = q_BxTxHxD.shape
  if not fits(T, D, v_BxTxHxD.shape[-1]):
    raise ValueError(f"tpu_flash.causal_attention takes Dqk = Dv (<= 128 or a multiple of "
                     f"128) and T a multiple of {BLOCK}; got T={T}, Dqk={D}, "
                     f"Dv={v_BxTxHxD.shape[-1]}")
  b = BLOCK
  blocks = fa.BlockSizes(block_q=b, block_k_major=b, block_k=b, block_b=1,
                         block_q_major_dkv=b, block_k_major_dkv=b, block_k_dkv=b,
                         block_q_dkv=b, block_k_major_dq=b, block_k_dq=b, block_q_dq=b)
  heads_first = lambda x: jnp.swapaxes(x, 1, 2)
  seg = segment_ids_BxT.astype(jnp.int32)
  o_BxHxTxD = fa.flash_attention(
      heads_first(q_BxTxHxD), heads_first(k_BxTxHxD), heads_first(v_BxTxHxD),
      segment_ids=fa.SegmentIds(q=seg, kv=seg), causal=True, sm_scale=D ** -0.5,
      block_sizes=blocks)
  return heads_first(o_BxHxTxD).astype(q_BxTxHxD.dtype)
