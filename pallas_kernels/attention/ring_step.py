"""One ring-attention step as flash kernels (Pallas; Triton lowering on GPU, `interpret=True`
on CPU): this shard's queries against one travelling K/V block, forward and backward.

Query t sits at absolute position q_first + t, key s at k_first + s; t sees s when
k_first + s ≤ q_first + t and their segment ids are equal. The forward returns the step's
normalised output and log-sum-exp, which the ring merges across steps; the backward takes
the *final* log-sum-exp and delta = rowsum(dO ⊙ O), so each step's dq, dk, dv are exactly
its share of the full gradient. No [T, T] scores are ever stored, and key blocks in a
query block's causal future are never loaded.

  forward  grid (B, H, Tq/BLOCK): online softmax over the visible key blocks
  dq       grid (B, H, Tq/BLOCK): the same key blocks, dq += dS·K
  dk, dv   grid (B, H, Tk/BLOCK): the query blocks that can see the key block,
           dv += Pᵀ·dO, dk += dSᵀ·Q
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.attention.tiles import tile_dim

F32 = jnp.float32
BLOCK = 64        # query and key positions per tile
NUM_WARPS = 4
NUM_STAGES = 3    # fwd+bwd at [4, 8192, 16, 64] on the H200: 9.8 ms, against 11.0 at 2 stages
                  # and 18.8-25 ms at 8 warps or 128-row blocks (dev sweep, 2026-12-01)
_PAD_Q, _PAD_K = -2, -1   # segment ids of padding rows: they see, and are seen by, nothing


def _dot_t(a, b):
  """a @ bᵀ, fp32 accumulation."""
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=F32)


def _t_dot(a, b):
  """aᵀ @ b, fp32 accumulation."""
  return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=F32)


def _visible(off_ref, i_q, j_k, seg_Q, seg_K, BQ, BK):
  """[BQ, BK] mask of query block i_q against key block j_k."""
  pos_Q = off_ref[0] + i_q * BQ + jax.lax.broadcasted_iota(jnp.int32, (BQ,), 0)
  pos_K = off_ref[1] + j_k * BK + jax.lax.broadcasted_iota(jnp.int32, (BK,), 0)
  return (pos_K[None, :] <= pos_Q[:, None]) & (seg_Q[:, None] == seg_K[None, :])


def _n_key_blocks(off_ref, i_q, BQ, BK, n_k):
  """Key blocks [0, n) holding any position ≤ the query block's last position."""
  last = off_ref[0] + i_q * BQ + BQ - 1 - off_ref[1]
  return jnp.clip(last // BK + 1, 0, n_k)


def _fwd_kernel(off_ref, q_ref, k_ref, v_ref, segq_ref, segk_ref, o_ref, lse_ref, *, scale):
  BQ, D = q_ref.shape
  Tk, Dv = v_ref.shape
  BK = min(BLOCK, Tk)
  i = pl.program_id(2)
  q_QxD, seg_Q = q_ref[...], segq_ref[...]

  def body(j, carry):
    m_Q, l_Q, acc_QxDv = carry
    ks = pl.ds(pl.multiple_of(j * BK, BK), BK)
    s_QxK = _dot_t(q_QxD, k_ref[ks, :]) * scale
    s_QxK = jnp.where(_visible(off_ref, i, j, seg_Q, segk_ref[ks], BQ, BK), s_QxK, -jnp.inf)
    m_new = jnp.maximum(m_Q, s_QxK.max(axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p_QxK = jnp.exp(s_QxK - m_safe[:, None])
    corr_Q = jnp.exp(m_Q - m_safe)
    acc_QxDv = acc_QxDv * corr_Q[:, None] + jnp.dot(
        p_QxK.astype(v_ref.dtype), v_ref[ks, :], preferred_element_type=F32)
    return m_new, l_Q * corr_Q + p_QxK.sum(axis=1), acc_QxDv

  init = (jnp.full((BQ,), -jnp.inf, F32), jnp.zeros((BQ,), F32), jnp.zeros((BQ, Dv), F32))
  m_Q, l_Q, acc_QxDv = jax.lax.fori_loop(0, _n_key_blocks(off_ref, i, BQ, BK, Tk // BK),
                                         body, init)
  seen = l_Q > 0.0
  o_ref[...] = acc_QxDv / jnp.where(seen, l_Q, 1.0)[:, None]
  lse_ref[...] = jnp.where(seen, m_Q + jnp.log(jnp.where(seen, l_Q, 1.0)), -jnp.inf)


def _dq_kernel(off_ref, q_ref, k_ref, v_ref, segq_ref, segk_ref, do_ref, lse_ref, delta_ref,
               dq_ref, *, scale):
  BQ, D = q_ref.shape
  Tk = k_ref.shape[0]
  BK = min(BLOCK, Tk)
  i = pl.program_id(2)
  q_QxD, do_QxDv, seg_Q = q_ref[...], do_ref[...], segq_ref[...]
  lse_Q, delta_Q = lse_ref[...], delta_ref[...]

  def body(j, dq_QxD):
    ks = pl.ds(pl.multiple_of(j * BK, BK), BK)
    k_KxD, v_KxDv = k_ref[ks, :], v_ref[ks, :]
    visible = _visible(off_ref, i, j, seg_Q, segk_ref[ks], BQ, BK)
    p_QxK = jnp.exp(jnp.where(visible, _dot_t(q_QxD, k_KxD) * scale - lse_Q[:, None],
                              -jnp.inf))
    ds_QxK = p_QxK * (_dot_t(do_QxDv, v_KxDv) - delta_Q[:, None])
    return dq_QxD + jnp.dot(ds_QxK.astype(k_KxD.dtype), k_KxD, preferred_element_type=F32)

  dq_QxD = jax.lax.fori_loop(0, _n_key_blocks(off_ref, i, BQ, BK, Tk // BK), body,
                             jnp.zeros((BQ, D), F32))
  dq_ref[...] = dq_QxD * scale


def _dkv_kernel(off_ref, q_ref, k_ref, v_ref, segq_ref, segk_ref, do_ref, lse_ref, delta_ref,
                dk_ref, dv_ref, *, scale):
  BK, D = k_ref.shape
  Tq, Dv = do_ref.shape
  BQ = min(BLOCK, Tq)
  j = pl.program_id(2)
  k_KxD, v_KxDv, seg_K = k_ref[...], v_ref[...], segk_ref[...]
  # The first query block whose last position reaches this key block's first.
  first = jnp.clip((off_ref[1] + j * BK - off_ref[0]) // BQ, 0, Tq // BQ)

  def body(i, carry):
    dk_KxD, dv_KxDv = carry
    qs = pl.ds(pl.multiple_of(i * BQ, BQ), BQ)
    q_QxD, do_QxDv = q_ref[qs, :], do_ref[qs, :]
    visible = _visible(off_ref, i, j, segq_ref[qs], seg_K, BQ, BK)
    p_QxK = jnp.exp(jnp.where(visible, _dot_t(q_QxD, k_KxD) * scale - lse_ref[qs][:, None],
                              -jnp.inf))
    dv_KxDv = dv_KxDv + _t_dot(p_QxK.astype(do_QxDv.dtype), do_QxDv)
    ds_QxK = p_QxK * (_dot_t(do_QxDv, v_KxDv) - delta_ref[qs][:, None])
    return dk_KxD + _t_dot(ds_QxK.astype(q_QxD.dtype), q_QxD), dv_KxDv

  dk_KxD, dv_KxDv = jax.lax.fori_loop(first, Tq // BQ, body,
                                      (jnp.zeros((BK, D), F32), jnp.zeros((BK, Dv), F32)))
  dk_ref[...] = dk_KxD * scale
  dv_ref[...] = dv_KxDv


def _pad4(x, Tp):
  """[B, T, H, d] → [B, Tp, H, tile_dim(d)] with zeros: zero head-dim columns change no
  score and give output columns that are sliced off."""
  T, d = x.shape[1], x.shape[-1]
  return jnp.pad(x, ((0, 0), (0, Tp - T), (0, 0), (0, tile_dim(d) - d)))


def _padded(q, k, v, seg_q, seg_k):
  """Pads T to whole blocks and head dims to tile dims; padding rows get segment ids
  nothing matches."""
  T = q.shape[1]
  Bl = min(BLOCK, pl.next_power_of_2(T))
  Tp = pl.cdiv(T, Bl) * Bl
  pad2 = lambda x, c: jnp.pad(x.astype(jnp.int32), ((0, 0), (0, Tp - T)), constant_values=c)
  return (_pad4(q, Tp), _pad4(k, Tp), _pad4(v, Tp), pad2(seg_q, _PAD_Q), pad2(seg_k, _PAD_K),
          Bl, Tp)


def _specs(Bl, Tp, D, Dv, rows_of_q):
  """Offsets, then q, k, v, seg_q, seg_k; the grid axis walks q blocks or k blocks."""
  tile = lambda d: pl.BlockSpec((None, Bl, None, d), lambda b, h, i: (b, i, h, 0))
  whole = lambda d: pl.BlockSpec((None, Tp, None, d), lambda b, h, i: (b, 0, h, 0))
  seg_tile = pl.BlockSpec((None, Bl), lambda b, h, i: (b, i))
  seg_whole = pl.BlockSpec((None, Tp), lambda b, h, i: (b, 0))
  off = pl.BlockSpec((2,), lambda b, h, i: (0,))
  if rows_of_q:
    return [off, tile(D), whole(D), whole(Dv), seg_tile, seg_whole]
  return [off, whole(D), tile(D), tile(Dv), seg_whole, seg_tile]


def _call(kernel, grid, in_specs, out_specs, out_shape, interpret, name):
  params = None if interpret else pltriton.CompilerParams(num_warps=NUM_WARPS,
                                                          num_stages=NUM_STAGES)
  return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                        out_shape=out_shape, interpret=interpret, name=name,
                        compiler_params=params)


def ring_step_forward(q_BxTxHxD, k_BxTxHxD, v_BxTxHxDv, seg_q_BxT, seg_k_BxT, q_first, k_first,
                      *, scale, interpret=None):
  """(o [B,T,H,Dv] fp32, normalised over this block; lse [B,H,T] fp32, -inf where the block
  shows a query nothing)."""
  B, T, H, D = q_BxTxHxD.shape
  Dv = v_BxTxHxDv.shape[-1]
  interpret = jax.default_backend() != "gpu" if interpret is None else interpret
  q, k, v, sq, sk, Bl, Tp = _padded(q_BxTxHxD, k_BxTxHxD, v_BxTxHxDv, seg_q_BxT, seg_k_BxT)
  Dp, Dvp = q.shape[-1], v.shape[-1]
  off = jnp.stack([q_first, k_first]).astype(jnp.int32)
  o, lse = _call(
      functools.partial(_fwd_kernel, scale=scale), (B, H, Tp // Bl),
      _specs(Bl, Tp, Dp, Dvp, rows_of_q=True),
      [pl.BlockSpec((None, Bl, None, Dvp), lambda b, h, i: (b, i, h, 0)),
       pl.BlockSpec((None, None, Bl), lambda b, h, i: (b, h, i))],
      [jax.ShapeDtypeStruct((B, Tp, H, Dvp), F32), jax.ShapeDtypeStruct((B, H, Tp), F32)],
      interpret, "ring_step_fwd")(off, q, k, v, sq, sk)
  return o[:, :T, :, :Dv], lse[..., :T]


def ring_step_backward(q_BxTxHxD, k_BxTxHxD, v_BxTxHxDv, seg_q_BxT, seg_k_BxT, q_first, k_first,
                       do_BxTxHxDv, lse_BxHxT, delta_BxHxT, *, scale, interpret=None):
  """This step's share of (dq, dk, dv), fp32, from the final lse and delta = rowsum(dO ⊙ O)."""
  B, T, H, D = q_BxTxHxD.shape
  Dv = v_BxTxHxDv.shape[-1]
  interpret = jax.default_backend() != "gpu" if interpret is None else interpret
  q, k, v, sq, sk, Bl, Tp = _padded(q_BxTxHxD, k_BxTxHxD, v_BxTxHxDv, seg_q_BxT, seg_k_BxT)
  Dp, Dvp = q.shape[-1], v.shape[-1]
  do = _pad4(do_BxTxHxDv.astype(q.dtype), Tp)
  lse, delta = (jnp.pad(x, ((0, 0), (0, 0), (0, Tp - T))) for x in (lse_BxHxT, delta_BxHxT))
  off = jnp.stack([q_first, k_first]).astype(jnp.int32)
  row_tile = pl.BlockSpec((None, None, Bl), lambda b, h, i: (b, h, i))
  row_whole = pl.BlockSpec((None, None, Tp), lambda b, h, i: (b, h, 0))
  tile = lambda d: pl.BlockSpec((None, Bl, None, d), lambda b, h, i: (b, i, h, 0))
  whole = lambda d: pl.BlockSpec((None, Tp, None, d), lambda b, h, i: (b, 0, h, 0))
  out = lambda d: jax.ShapeDtypeStruct((B, Tp, H, d), F32)
  dq = _call(functools.partial(_dq_kernel, scale=scale), (B, H, Tp // Bl),
             _specs(Bl, Tp, Dp, Dvp, rows_of_q=True) + [tile(Dvp), row_tile, row_tile],
             tile(Dp), out(Dp), interpret, "ring_step_dq")(off, q, k, v, sq, sk, do, lse, delta)
  dk, dv = _call(functools.partial(_dkv_kernel, scale=scale), (B, H, Tp // Bl),
                 _specs(Bl, Tp, Dp, Dvp, rows_of_q=False) + [whole(Dvp), row_whole, row_whole],
                 [tile(Dp), tile(Dvp)], [out(Dp), out(Dvp)], interpret,
                 "ring_step_dkv")(off, q, k, v, sq, sk, do, lse, delta)
  return dq[:, :T, :, :D], dk[:, :T, :, :D], dv[:, :T, :, :Dv]
