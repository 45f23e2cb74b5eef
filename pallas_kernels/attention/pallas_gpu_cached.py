"""Flash attention of a chunk of queries over a key/value cache, forward only (Pallas;
Triton lowering on GPU, `interpret=True` on CPU).

The prefill step of long-context inference: the T new queries of row b sit at absolute
positions q_start[b] + t and see the cache positions j ≤ q_start[b] + t with j < kv_len[b]
(causal with an offset, plus the filled length). Keys past what any query of a block can
see are never loaded, so a chunk's cost grows with the filled length, not with the
preallocated cache. Nothing is differentiated here: inference only.

  grid (B, H, T/BLOCK_Q): one block of queries, an online softmax over key blocks
  [0, n_full) without a mask (every query of the block sees them all), then the masked
  tail up to the block's last visible key.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.attention.pallas_gpu_tiles import head_parts, tile_dim

F32 = jnp.float32

# Launch knobs for head dims ≤ 128 (H200).
BLOCK_Q = 128
BLOCK_K = 64
NUM_WARPS = 4
NUM_STAGES = 2
# ... and the launch width past 128 (Kimi's MLA: 192 query/key, 128 values): at 4 warps a
# program's query tiles and [128, 128] accumulator take 255 registers and spill 2,228 bytes
# a thread (2,308 with the head padded to 256); at 8 none (sm_90a, benchmarks/
# kernel_registers.py; tests/test_cached_attention.py).
WIDE_NUM_WARPS = 8


# A query/key head dim that is two tiles, as Kimi's 192 = 128 + 64, runs as two products
# (q·kᵀ = q₁·k₁ᵀ + q₂·k₂ᵀ) instead of one padded to 256: a quarter fewer score FLOPs and
# loads, and smaller tiles in registers. False pads it (the kernel before the split).
SPLIT_HEAD_DIM = True


def head_split(D: int) -> tuple[int, int] | None:
  """(D₁, D₂) where D runs as two tiles (pallas_gpu_tiles.head_parts, SPLIT_HEAD_DIM on);
  else None (D padded to one tile)."""
  parts = head_parts(D, SPLIT_HEAD_DIM)
  return (parts[0][1], parts[1][1]) if len(parts) == 2 else None


def num_warps(D: int) -> int:
  """The launch width for query/key head dim D (split or not)."""
  return NUM_WARPS if tile_dim(D) <= 128 else WIDE_NUM_WARPS


def _kernel(q_start_ref, kv_len_ref, *refs, scale, block_k, split):
  """refs: q, k (or q, q2, k, k2 with a split head dim: scores are q·kᵀ + q2·k2ᵀ), v, then
  the output and, with return_lse, the log-sum-exp."""
  if split:
    q_ref, q2_ref, k_ref, k2_ref, v_ref, o_ref, *lse_ref = refs
  else:
    (q_ref, k_ref, v_ref, o_ref, *lse_ref), q2_ref = refs, None
  BQ, BK = q_ref.shape[0], block_k
  S = k_ref.shape[0]
  q_start, kv_len = q_start_ref[0], kv_len_ref[0]
  first_q = q_start + pl.program_id(2) * BQ
  pos_Q = first_q + jax.lax.broadcasted_iota(jnp.int32, (BQ,), 0)
  scaled = lambda ref: (ref[...].astype(F32) * scale).astype(k_ref.dtype)
  q_QxD = scaled(q_ref)
  q2_QxD2 = scaled(q2_ref) if split else None
  # Blocks below n_full are visible to every query of the block; the rest up to n_all
  # are partly visible.
  n_full = jnp.maximum(jnp.minimum(first_q + 1, kv_len), 0) // BK
  n_all = (jnp.maximum(jnp.minimum(first_q + BQ, kv_len), 0) + BK - 1) // BK

  def body(masked, j, carry):
    m_Q, l_Q, acc_QxDv = carry
    # The last block may run past S: it then starts at S - BK, overlapping the one
    # before, whose keys are masked out here.
    start = jnp.minimum(j * BK, S - BK)
    ks = pl.ds(start, BK)
    k_KxD, v_KxDv = k_ref[ks, :], v_ref[ks, :]
    s_QxK = jax.lax.dot_general(q_QxD, k_KxD, (((1,), (1,)), ((), ())),
                                preferred_element_type=F32)
    if split:
      s_QxK += jax.lax.dot_general(q2_QxD2, k2_ref[ks, :], (((1,), (1,)), ((), ())),
                                   preferred_element_type=F32)
    if masked:
      j_K = start + jax.lax.broadcasted_iota(jnp.int32, (BK,), 0)
      visible_QxK = ((j_K[None, :] >= j * BK) & (j_K[None, :] <= pos_Q[:, None])
                     & (j_K[None, :] < kv_len))
      s_QxK = jnp.where(visible_QxK, s_QxK, -jnp.inf)
    m_new = jnp.maximum(m_Q, s_QxK.max(axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)   # rows that see nothing yet
    p_QxK = jnp.exp(s_QxK - m_safe[:, None])
    corr_Q = jnp.exp(m_Q - m_safe)
    acc_QxDv = acc_QxDv * corr_Q[:, None] + jnp.dot(
        p_QxK.astype(v_KxDv.dtype), v_KxDv, preferred_element_type=F32)
    return m_new, l_Q * corr_Q + p_QxK.sum(axis=1), acc_QxDv

  Dv = v_ref.shape[-1]
  carry = (jnp.full((BQ,), -jnp.inf, F32), jnp.zeros((BQ,), F32), jnp.zeros((BQ, Dv), F32))
  carry = jax.lax.fori_loop(0, n_full, functools.partial(body, False), carry)
  m_Q, l_Q, acc_QxDv = jax.lax.fori_loop(n_full, n_all, functools.partial(body, True), carry)
  o_ref[...] = (acc_QxDv / jnp.where(l_Q == 0.0, 1.0, l_Q)[:, None]).astype(o_ref.dtype)
  if lse_ref:   # log Σ exp(scores) of each query: -inf where it sees nothing
    lse_ref[0][...] = jnp.where(l_Q == 0.0, -jnp.inf, m_Q + jnp.log(jnp.where(l_Q == 0.0, 1.0,
                                                                              l_Q)))


def check_shapes(q_BxTxHxD, k_BxSxHxD, v_BxSxHxDv):
  """(S, Dv) where k and v are [B, S, H, D] and [B, S, H, Dv] with q [B, T, H, D], else a
  ValueError (the contract of this kernel and of tpu_cached_attention's)."""
  B, _, H, D = q_BxTxHxD.shape
  S, Dv = k_BxSxHxD.shape[1], v_BxSxHxDv.shape[-1]
  if k_BxSxHxD.shape != (B, S, H, D) or v_BxSxHxDv.shape != (B, S, H, Dv):
    raise ValueError(f"cached_attention: k {k_BxSxHxD.shape} and v {v_BxSxHxDv.shape} must be "
                     f"[B={B}, S, H={H}, D] with q {q_BxTxHxD.shape}")
  return S, Dv


def cached_attention(q_BxTxHxD, k_BxSxHxD, v_BxSxHxDv, q_start_B, kv_len_B, *, scale=None,
                     return_lse=False, interpret=None):
  """softmax(q·kᵀ·scale) v over the visible cache positions; [B, T, H, Dv] in q's dtype.

  Query t of row b is at position q_start_B[b] + t and sees keys j ≤ that position with
  j < kv_len_B[b]. A query that sees no key gets zeros. With return_lse, also each query's
  log-sum-exp of its visible scores, [B, T, H] fp32 (-inf where it sees none): what merges
  attention over separate windows of one cache (ops.latent_cache_attention).
  """
  B, T, H, D = q_BxTxHxD.shape
  S, Dv = check_shapes(q_BxTxHxD, k_BxSxHxD, v_BxSxHxDv)
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  scale = D ** -0.5 if scale is None else scale
  BQ = min(BLOCK_Q, pl.next_power_of_2(T))
  Tp = pl.cdiv(T, BQ) * BQ
  Sp = max(S, BLOCK_K)  # a block must fit in the cache; padded keys are past kv_len
  # Zero head-dim columns change no score; the extra output columns are sliced off. A head
  # dim of two tiles (head_split) is two arrays instead, each a whole tile.
  pad = lambda x, rows: jnp.pad(x, ((0, 0), (0, rows), (0, 0),
                                    (0, tile_dim(x.shape[-1]) - x.shape[-1])))
  parts = head_parts(D, SPLIT_HEAD_DIM)
  qk = ([pad(q_BxTxHxD[..., a:a + w], Tp - T) for a, w in parts]
        + [pad(k_BxSxHxD[..., a:a + w], Sp - S) for a, w in parts])
  v_BxSxHxDv = pad(v_BxSxHxDv, Sp - S)
  Dvp = v_BxSxHxDv.shape[-1]
  S = Sp
  row = pl.BlockSpec((1,), lambda b, h, i: (b,))
  params = None if interpret else pltriton.CompilerParams(num_warps=num_warps(D),
                                                          num_stages=NUM_STAGES)
  lse_spec = pl.BlockSpec((None, None, BQ), lambda b, h, i: (b, h, i))
  q_spec = lambda d: pl.BlockSpec((None, BQ, None, d), lambda b, h, i: (b, i, h, 0))
  k_spec = lambda d: pl.BlockSpec((None, S, None, d), lambda b, h, i: (b, 0, h, 0))
  qk_specs = ([q_spec(x.shape[-1]) for x in qk[:len(parts)]]
              + [k_spec(x.shape[-1]) for x in qk[len(parts):]])
  out = pl.pallas_call(
      functools.partial(_kernel, scale=scale, block_k=BLOCK_K, split=len(parts) == 2),
      grid=(B, H, Tp // BQ),
      in_specs=[row, row, *qk_specs,
                pl.BlockSpec((None, S, None, Dvp), lambda b, h, i: (b, 0, h, 0))],
      out_specs=[pl.BlockSpec((None, BQ, None, Dvp), lambda b, h, i: (b, i, h, 0)),
                 *([lse_spec] if return_lse else [])],
      out_shape=[jax.ShapeDtypeStruct((B, Tp, H, Dvp), q_BxTxHxD.dtype),
                 *([jax.ShapeDtypeStruct((B, H, Tp), F32)] if return_lse else [])],
      interpret=interpret, name="cached_attention", compiler_params=params,
  )(q_start_B.astype(jnp.int32), kv_len_B.astype(jnp.int32), *qk, v_BxSxHxDv)
  o_BxTxHxDv = out[0][:, :T, :, :Dv]
  if not return_lse:
    return o_BxTxHxDv
  return o_BxTxHxDv, jnp.transpose(out[1][:, :, :T], (0, 2, 1))
