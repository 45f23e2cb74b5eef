"""Causal, segment-masked attention on TPU: jax's Pallas Mosaic flash attention
(jax.experimental.pallas.ops.tpu.flash_attention), forward and backward kernels, in the
[B, T, H, D] layout the model uses.

That kernel takes segment ids natively, so packed documents need no [T, T] mask. It wants
one head dim for q, k and v (at most 128, or a multiple of 128) and key tiles of 128, so T
a multiple of 128. Head dims are padded here (`common_dim`: zero columns change no score,
and extra output columns are sliced off), so only T limits it (`fits`); other lengths take
the XLA path. There is no interpret switch on it: on CPU the tests run it under
`pltpu.force_tpu_interpret_mode()`.
"""

import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import flash_attention as fa

BLOCK = 128   # the kernel's default tile: query and key positions per block
BLOCKS = fa.BlockSizes(block_q=BLOCK, block_k_major=BLOCK, block_k=BLOCK, block_b=1,
                       block_q_major_dkv=BLOCK, block_k_major_dkv=BLOCK, block_k_dkv=BLOCK,
                       block_q_dkv=BLOCK, block_k_major_dq=BLOCK, block_k_dq=BLOCK,
                       block_q_dq=BLOCK)


def fits(T) -> bool:
  """Lengths the kernel takes: a whole number of 128-position tiles (any head dims)."""
  return T % BLOCK == 0


def common_dim(Dqk, Dv) -> int:
  """The one head dim q, k and v are padded to: the larger, rounded up to a multiple of 128
  past 128 (the kernel's lane rule)."""
  D = max(Dqk, Dv)
  return D if D <= BLOCK else -(-D // BLOCK) * BLOCK


def heads_first(x_BxTxHxD, D):
  """[B, T, H, d] → [B, H, T, D], zero-padded along the head dim."""
  x = jnp.swapaxes(x_BxTxHxD, 1, 2)
  return jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, D - x.shape[-1])))


def heads_last(x_BxHxTxD, d):
  """Inverse of heads_first: [B, H, T, D] → [B, T, H, d]."""
  return jnp.swapaxes(x_BxHxTxD[..., :d], 1, 2)


def causal_attention(q_BxTxHxD, k_BxTxHxD, v_BxTxHxDv, segment_ids_BxT):
  """softmax(q kᵀ / √D, causal, same segment only) v: [B, T, H, Dv] in q's dtype. Padding
  (id 0) attends to padding, as in the model's XLA path."""
  B, T, H, D = q_BxTxHxD.shape
  Dv = v_BxTxHxDv.shape[-1]
  if not fits(T):
    raise ValueError(f"tpu_flash.causal_attention takes T a multiple of {BLOCK}; got T={T}")
  Dp = common_dim(D, Dv)
  seg = segment_ids_BxT.astype(jnp.int32)
  o_BxHxTxDp = fa.flash_attention(
      heads_first(q_BxTxHxD, Dp), heads_first(k_BxTxHxD, Dp), heads_first(v_BxTxHxDv, Dp),
      segment_ids=fa.SegmentIds(q=seg, kv=seg), causal=True, sm_scale=D ** -0.5,
      block_sizes=BLOCKS)
  return heads_last(o_BxHxTxDp, Dv).astype(q_BxTxHxD.dtype)
