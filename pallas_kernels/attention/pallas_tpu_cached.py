"""Flash attention of a chunk of queries over a key/value cache on TPU (Pallas Mosaic TPU;
the TPU interpreter off a TPU), forward only: the prefill step of long-context inference, as
pallas_gpu_cached.py is on GPU, with the same contract.

Query t of row b sits at position q_start[b] + t and sees cache positions j ≤ that with
j < kv_len[b]. The two per-row numbers are prefetched into SMEM and steer the key blocks'
index map: a key block past what any query of the block can see maps to the last visible
one, so it is never fetched again, and its step does no work. A chunk's cost therefore
follows the filled length, not the preallocated cache.

  grid (B, H, T/BQ, S/BK), the key axis "arbitrary": an online softmax over key blocks
  with m, l and the [BQ, Dv] accumulator in VMEM scratch, written out at the last block.

Arrays are head-major inside ([B, H, ·, D]), so every block is a [rows, D] tile meeting the
(8, 128) rule: rows a multiple of 8 and D the whole head dim.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import platform
from pallas_kernels.attention.pallas_gpu_cached import check_shapes

F32 = jnp.float32
BLOCK_Q = 128   # query rows per program (fewer for a short chunk: T rounded up to 8)
BLOCK_K = 128   # cache positions per key step


def _last_block(q_start, kv_len, i, BQ, BK):
  """The last key block that query block i can see (0 when it sees none)."""
  last_visible = jnp.minimum(q_start + (i + 1) * BQ, kv_len) - 1
  return jnp.maximum(last_visible, 0) // BK


def _kernel(q_start_ref, kv_len_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *,
            scale):
  BQ, BK = q_ref.shape[0], k_ref.shape[0]
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  q_start, kv_len = q_start_ref[b], kv_len_ref[b]

  @pl.when(j == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, F32)
    l_ref[...] = jnp.zeros(l_ref.shape, F32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, F32)

  first_q = q_start + i * BQ
  # Any key of block j visible to any query of the block?
  @pl.when((j * BK <= first_q + BQ - 1) & (j * BK < kv_len))
  def _step():
    q_QxD = (q_ref[...].astype(F32) * scale).astype(k_ref.dtype)
    s_QxK = jax.lax.dot_general(q_QxD, k_ref[...], (((1,), (1,)), ((), ())),
                                preferred_element_type=F32)
    pos_Qx1 = first_q + jax.lax.broadcasted_iota(jnp.int32, (BQ, 1), 0)
    j_1xK = j * BK + jax.lax.broadcasted_iota(jnp.int32, (1, BK), 1)
    s_QxK = jnp.where((j_1xK <= pos_Qx1) & (j_1xK < kv_len), s_QxK, -jnp.inf)
    m_Qx1 = m_ref[...]
    m_new_Qx1 = jnp.maximum(m_Qx1, s_QxK.max(axis=1, keepdims=True))
    m_safe_Qx1 = jnp.where(m_new_Qx1 == -jnp.inf, 0.0, m_new_Qx1)   # rows that see nothing yet
    p_QxK = jnp.exp(s_QxK - m_safe_Qx1)
    corr_Qx1 = jnp.exp(m_Qx1 - m_safe_Qx1)
    l_ref[...] = l_ref[...] * corr_Qx1 + p_QxK.sum(axis=1, keepdims=True)
    acc_ref[...] = acc_ref[...] * corr_Qx1 + jnp.dot(
        p_QxK.astype(v_ref.dtype), v_ref[...], preferred_element_type=F32)
    m_ref[...] = m_new_Qx1

  @pl.when(j == pl.num_programs(3) - 1)
  def _write():
    l_Qx1 = l_ref[...]
    o_ref[...] = (acc_ref[...] / jnp.where(l_Qx1 == 0.0, 1.0, l_Qx1)).astype(o_ref.dtype)


def cached_attention(q_BxTxHxD, k_BxSxHxD, v_BxSxHxDv, q_start_B, kv_len_B, *, scale=None,
                     interpret=None):
  """softmax(q·kᵀ·scale) v over the visible cache positions; [B, T, H, Dv] in q's dtype.

  Query t of row b is at position q_start_B[b] + t and sees keys j ≤ that position with
  j < kv_len_B[b]. A query that sees no key gets zeros. `interpret` defaults to True off a
  TPU target.
  """
  B, T, H, D = q_BxTxHxD.shape
  S, Dv = check_shapes(q_BxTxHxD, k_BxSxHxD, v_BxSxHxDv)
  if interpret is None:
    interpret = platform.target() != "tpu"
  scale = D ** -0.5 if scale is None else scale
  BQ = min(BLOCK_Q, -(-T // 8) * 8)
  Tp, Sp = -(-T // BQ) * BQ, -(-S // BLOCK_K) * BLOCK_K   # padded keys lie past kv_len
  heads_first = lambda x, n: jnp.pad(jnp.swapaxes(x, 1, 2),
                                     ((0, 0), (0, 0), (0, n - x.shape[1]), (0, 0)))
  q, k, v = heads_first(q_BxTxHxD, Tp), heads_first(k_BxSxHxD, Sp), heads_first(v_BxSxHxDv, Sp)

  def kv_block(b, h, i, j, q_start_ref, kv_len_ref):
    return b, h, jnp.minimum(j, _last_block(q_start_ref[b], kv_len_ref[b], i, BQ, BLOCK_K)), 0

  q_tile = pl.BlockSpec((None, None, BQ, D), lambda b, h, i, j, *_: (b, h, i, 0))
  o_BxHxTxDv = pl.pallas_call(
      functools.partial(_kernel, scale=scale),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(B, H, Tp // BQ, Sp // BLOCK_K),
          in_specs=[q_tile, pl.BlockSpec((None, None, BLOCK_K, D), kv_block),
                    pl.BlockSpec((None, None, BLOCK_K, Dv), kv_block)],
          out_specs=pl.BlockSpec((None, None, BQ, Dv), lambda b, h, i, j, *_: (b, h, i, 0)),
          scratch_shapes=[pltpu.VMEM((BQ, 1), F32), pltpu.VMEM((BQ, 1), F32),
                          pltpu.VMEM((BQ, Dv), F32)]),
      out_shape=jax.ShapeDtypeStruct((B, H, Tp, Dv), q_BxTxHxD.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      interpret=pltpu.InterpretParams() if interpret else False,
      name="tpu_cached_attention",
  )(q_start_B.astype(jnp.int32), kv_len_B.astype(jnp.int32), q, k, v)
  return jnp.swapaxes(o_BxHxTxDv[:, :, :T], 1, 2)
