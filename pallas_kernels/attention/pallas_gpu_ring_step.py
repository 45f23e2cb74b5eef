"""One ring-attention step as flash kernels (Pallas; Triton lowering on GPU, `interpret=True`
on CPU): this shard's queries against one travelling K/V block, forward and backward.

Query t sits at absolute position q_first + t, key s at k_first + s; t sees s when
k_first + s ≤ q_first + t and their segment ids are equal. The forward returns the step's
normalised output and log-sum-exp, which the ring merges across steps; the backward takes
the *final* log-sum-exp and delta = rowsum(dO ⊙ O), so each step's dq, dk, dv are exactly
its share of the full gradient. No [T, T] scores are ever stored, and key blocks in a
query block's causal future are never loaded.

  forward  grid (B, H, Tq/rows): online softmax over the visible key blocks
  dq       grid (B, H, Tq/rows): the same key blocks, dq += dS·K
  dk, dv   grid (B, H, Tk/rows): the query blocks that can see the key block,
           dv += Pᵀ·dO, dk += dSᵀ·Q

Each loop runs in two parts: the blocks wholly on one side of the diagonal need only the
segment mask, the few the diagonal crosses also the causal one. Blocks before the first or
after the last that can share a document with the tile (per-block min/max segment ids) are
skipped: packed short documents cost their own triangles, not the row's. Scores are scaled
into log2 units so the softmax uses exp2. Each kernel's tiles (Tiles: rows, loop block,
warps, stages) are a module constant, measured by benchmarks/bench_attention.py.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.attention.pallas_gpu_tiles import head_parts, tile_dim

F32 = jnp.float32
LOG2E = 1.4426950408889634   # scores are kept in log2 units: exp2 is one MUFU instruction


@dataclasses.dataclass(frozen=True)
class Tiles:
  """One kernel's launch: rows of the grid's tile (query positions for the forward and dq,
  key positions for dk/dv), rows of the block its loop walks, and Triton's warps and
  pipeline stages."""
  rows: int
  loop: int
  warps: int = 4
  stages: int = 3

  def __str__(self):
    return f"{self.rows}x{self.loop} w{self.warps} s{self.stages}"


# The fastest of benchmarks/bench_attention.py's sweep at [4, 8192, 16, 64] bf16 on the H200
# (benchmarks/attention.md): forward 2.08 ms against 2.42 at 64 × 64; dk/dv
# is 1.3-1.6× slower with 128-row or 32-wide tiles.
FWD = Tiles(128, 64)
DQ = Tiles(128, 64)
DKV = Tiles(64, 64)
# Head dims padded past 128 (Kimi Linear's MLA: 128 + 64 shared key dims, so 256-wide
# tiles): at three stages dq asks for 246,784 bytes of shared memory, past the H100/H200's
# 232,448 per block (fwd 214,016, dk/dv 206,848); two stages fit (197,632 / 164,096 /
# 156,672; triton 3.6 for sm_90a, benchmarks/attention.md).
WIDE_DIM, WIDE_STAGES = 128, 2
# ... and past 128 the default tiles spill: at Kimi's 192 (split, below) / 128 the kernels
# at FWD, DQ, DKV spill 2,448, 4,060 and 2,292 bytes a thread (sm_90a ptxas; 2,852, 4,840,
# 3,048 padded to 256). Narrower tiles at 4 warps spill little: 0, 88 and 12 bytes at the
# tiles below. Swept at [1, 8192, 32, 192], dv 128, on an H100 (benchmarks/attention.md,
# 2026-12-06), each kernel's best against the 64x32 8-warp tiles that spill none (fwd
# 1.87 → 1.05 ms; the op's fwd+bwd with dq's 7.66 → 6.17, with dk/dv's 7.72 → 6.86); the
# three together: fwd+bwd 7.86 → 4.25 ms.
WIDE_FWD, WIDE_DQ, WIDE_DKV = Tiles(64, 64, 4, 2), Tiles(64, 32, 4, 2), Tiles(32, 64, 4, 2)
# A query/key head dim of two tiles (Kimi's 192 = 128 + 64) as two arrays whose score
# products are summed, instead of one padded to 256 (pallas_gpu_tiles.head_parts); False
# pads it.
SPLIT_HEAD_DIM = True
_PAD_Q, _PAD_K = -2, -1   # segment ids of padding rows: they see, and are seen by, nothing


def _dot_t(a, b):
  """a @ bᵀ, fp32 accumulation."""
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=F32)


def _t_dot(a, b):
  """aᵀ @ b, fp32 accumulation."""
  return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=F32)


def _visible(off_ref, i_q, j_k, seg_Q, seg_K, BQ, BK, causal):
  """[BQ, BK] mask of query block i_q against key block j_k: same segment, and (for blocks
  the diagonal crosses, `causal`) key position ≤ query position."""
  mask = seg_Q[:, None] == seg_K[None, :]
  if not causal:
    return mask
  pos_Q = off_ref[0] + i_q * BQ + jax.lax.broadcasted_iota(jnp.int32, (BQ,), 0)
  pos_K = off_ref[1] + j_k * BK + jax.lax.broadcasted_iota(jnp.int32, (BK,), 0)
  return mask & (pos_K[None, :] <= pos_Q[:, None])


def _key_blocks(off_ref, i_q, BQ, BK, n_k):
  """(n_below, n): key blocks [0, n_below) lie wholly at or before the query block's first
  position (no causal mask), [n_below, n) reach its positions; blocks ≥ n are all in its
  future and never loaded."""
  first_q = off_ref[0] + i_q * BQ - off_ref[1]
  n_below = jnp.clip((first_q + 1) // BK, 0, n_k)
  n = jnp.clip((first_q + BQ - 1) // BK + 1, 0, n_k)
  return n_below, n


def _query_blocks(off_ref, j_k, BQ, BK, n_q):
  """(first, first_after): query blocks [first, first_after) see part of key block j_k (the
  diagonal crosses them), [first_after, n_q) see all of it; blocks < first see none."""
  first_k = off_ref[1] + j_k * BK - off_ref[0]
  first = jnp.clip(first_k // BQ, 0, n_q)
  first_after = jnp.clip(-((-(first_k + BK - 1)) // BQ), first, n_q)
  return first, first_after


def _meeting_blocks(ids_ref, seg_X, start, stop):
  """[lo, hi): the loop's blocks in [start, stop) from the first to the last whose segment
  ids can equal one of seg_X (their [min, max] meets seg_X's); empty when none can. Blocks
  outside it hold only other documents and are never loaded. ids_ref: [2, NB] per-block
  (min, max) ids of the loop's side (_block_ids)."""
  lo_X, hi_X = seg_X.min(), seg_X.max()
  idx = jax.lax.broadcasted_iota(jnp.int32, ids_ref.shape[1:], 0)
  meets = (ids_ref[0] <= hi_X) & (ids_ref[1] >= lo_X) & (idx >= start) & (idx < stop)
  lo = jnp.min(jnp.where(meets, idx, stop))
  return lo, jnp.maximum(lo, jnp.max(jnp.where(meets, idx + 1, start)))


def _parts(refs, n):
  """(off, q parts, k parts, the rest) of a kernel's refs: q and k are n arrays each (two
  when the head dim is split, _qk_parts)."""
  return refs[0], refs[1:1 + n], refs[1 + n:1 + 2 * n], refs[1 + 2 * n:]


def _scores(q_parts, k_parts):
  """Σ_p q_p · k_pᵀ: the scores of a split head dim summed over its parts."""
  s = _dot_t(q_parts[0], k_parts[0])
  for q, k in zip(q_parts[1:], k_parts[1:]):
    s += _dot_t(q, k)
  return s


def _fwd_kernel(*refs, scale, block_k, n_parts):
  off_ref, q_refs, k_refs, (v_ref, segq_ref, segk_ref, ids_ref, o_ref, lse_ref) = _parts(
      refs, n_parts)
  BQ = q_refs[0].shape[0]
  Tk, Dv = v_ref.shape
  BK = min(block_k, Tk)
  i = pl.program_id(2)
  q_parts, seg_Q = [r[...] for r in q_refs], segq_ref[...]

  def body(j, carry, causal):
    m_Q, l_Q, acc_QxDv = carry    # m in log2 units
    ks = pl.ds(pl.multiple_of(j * BK, BK), BK)
    s_QxK = _scores(q_parts, [r[ks, :] for r in k_refs]) * (scale * LOG2E)
    s_QxK = jnp.where(_visible(off_ref, i, j, seg_Q, segk_ref[ks], BQ, BK, causal), s_QxK,
                      -jnp.inf)
    m_new = jnp.maximum(m_Q, s_QxK.max(axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p_QxK = jnp.exp2(s_QxK - m_safe[:, None])
    corr_Q = jnp.exp2(m_Q - m_safe)
    acc_QxDv = acc_QxDv * corr_Q[:, None] + jnp.dot(
        p_QxK.astype(v_ref.dtype), v_ref[ks, :], preferred_element_type=F32)
    return m_new, l_Q * corr_Q + p_QxK.sum(axis=1), acc_QxDv

  n_below, n = _key_blocks(off_ref, i, BQ, BK, Tk // BK)
  lo, hi = _meeting_blocks(ids_ref, seg_Q, 0, n)
  mid = jnp.clip(n_below, lo, hi)
  carry = (jnp.full((BQ,), -jnp.inf, F32), jnp.zeros((BQ,), F32), jnp.zeros((BQ, Dv), F32))
  carry = jax.lax.fori_loop(lo, mid, functools.partial(body, causal=False), carry)
  m_Q, l_Q, acc_QxDv = jax.lax.fori_loop(mid, hi, functools.partial(body, causal=True), carry)
  seen = l_Q > 0.0
  o_ref[...] = (acc_QxDv / jnp.where(seen, l_Q, 1.0)[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, (m_Q + jnp.log2(jnp.where(seen, l_Q, 1.0))) / LOG2E,
                           -jnp.inf)


def _dq_kernel(*refs, scale, block_k, n_parts):
  off_ref, q_refs, k_refs, rest = _parts(refs, n_parts)
  v_ref, segq_ref, segk_ref, ids_ref, do_ref, lse_ref, delta_ref, *dq_refs = rest
  BQ = q_refs[0].shape[0]
  Tk = k_refs[0].shape[0]
  BK = min(block_k, Tk)
  i = pl.program_id(2)
  q_parts, do_QxDv, seg_Q = [r[...] for r in q_refs], do_ref[...], segq_ref[...]
  lse2_Q, delta_Q = lse_ref[...] * LOG2E, delta_ref[...]

  def body(j, dq_parts, causal):
    ks = pl.ds(pl.multiple_of(j * BK, BK), BK)
    k_parts, v_KxDv = [r[ks, :] for r in k_refs], v_ref[ks, :]
    visible = _visible(off_ref, i, j, seg_Q, segk_ref[ks], BQ, BK, causal)
    p_QxK = jnp.exp2(jnp.where(visible, _scores(q_parts, k_parts) * (scale * LOG2E)
                               - lse2_Q[:, None], -jnp.inf))
    ds_QxK = p_QxK * (_dot_t(do_QxDv, v_KxDv) - delta_Q[:, None])
    return tuple(dq + jnp.dot(ds_QxK.astype(k.dtype), k, preferred_element_type=F32)
                 for dq, k in zip(dq_parts, k_parts))

  n_below, n = _key_blocks(off_ref, i, BQ, BK, Tk // BK)
  lo, hi = _meeting_blocks(ids_ref, seg_Q, 0, n)
  mid = jnp.clip(n_below, lo, hi)
  dq_parts = jax.lax.fori_loop(lo, mid, functools.partial(body, causal=False),
                               tuple(jnp.zeros((BQ, r.shape[1]), F32) for r in q_refs))
  dq_parts = jax.lax.fori_loop(mid, hi, functools.partial(body, causal=True), dq_parts)
  for dq_ref, dq in zip(dq_refs, dq_parts):
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, scale, block_q, n_parts):
  off_ref, q_refs, k_refs, rest = _parts(refs, n_parts)
  v_ref, segq_ref, segk_ref, ids_ref, do_ref, lse_ref, delta_ref, *out_refs = rest
  dk_refs, dv_ref = out_refs[:n_parts], out_refs[n_parts]
  BK = k_refs[0].shape[0]
  Tq, Dv = do_ref.shape
  BQ = min(block_q, Tq)
  j = pl.program_id(2)
  k_parts, v_KxDv, seg_K = [r[...] for r in k_refs], v_ref[...], segk_ref[...]

  def body(i, carry, causal):
    dk_parts, dv_KxDv = carry
    qs = pl.ds(pl.multiple_of(i * BQ, BQ), BQ)
    q_parts, do_QxDv = [r[qs, :] for r in q_refs], do_ref[qs, :]
    visible = _visible(off_ref, i, j, segq_ref[qs], seg_K, BQ, BK, causal)
    p_QxK = jnp.exp2(jnp.where(visible, _scores(q_parts, k_parts) * (scale * LOG2E)
                               - (lse_ref[qs] * LOG2E)[:, None], -jnp.inf))
    dv_KxDv = dv_KxDv + _t_dot(p_QxK.astype(do_QxDv.dtype), do_QxDv)
    ds_QxK = (p_QxK * (_dot_t(do_QxDv, v_KxDv) - delta_ref[qs][:, None])).astype(
        q_parts[0].dtype)
    return tuple(dk + _t_dot(ds_QxK, q) for dk, q in zip(dk_parts, q_parts)), dv_KxDv

  first, first_after = _query_blocks(off_ref, j, BQ, BK, Tq // BQ)
  lo, hi = _meeting_blocks(ids_ref, seg_K, first, Tq // BQ)
  mid = jnp.clip(first_after, lo, hi)
  carry = (tuple(jnp.zeros((BK, r.shape[1]), F32) for r in k_refs), jnp.zeros((BK, Dv), F32))
  carry = jax.lax.fori_loop(lo, mid, functools.partial(body, causal=True), carry)
  dk_parts, dv_KxDv = jax.lax.fori_loop(mid, hi, functools.partial(body, causal=False), carry)
  for dk_ref, dk in zip(dk_refs, dk_parts):
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv_KxDv.astype(dv_ref.dtype)


def _pad4(x, Tp):
  """[B, T, H, d] → [B, Tp, H, tile_dim(d)] with zeros: zero head-dim columns change no
  score and give output columns that are sliced off."""
  T, d = x.shape[1], x.shape[-1]
  return jnp.pad(x, ((0, 0), (0, Tp - T), (0, 0), (0, tile_dim(d) - d)))


def _padded(q, k, v, seg_q, seg_k, tiles):
  """Pads T to whole blocks of every tile in `tiles` (powers of two, clipped to T's next
  power of two) and head dims to tile dims, q and k as the parts of their head dim
  (_qk_parts); padding rows get segment ids nothing matches. Returns q's parts, k's parts,
  v, the segment ids, the clipped tiles and Tp."""
  T = q.shape[1]
  L = min(max(max(t.rows, t.loop) for t in tiles), pl.next_power_of_2(T))
  tiles = [dataclasses.replace(t, rows=min(t.rows, L), loop=min(t.loop, L)) for t in tiles]
  if _wide(q.shape[-1], v.shape[-1]):
    tiles = [dataclasses.replace(t, stages=min(t.stages, WIDE_STAGES)) for t in tiles]
  Tp = pl.cdiv(T, L) * L
  pad2 = lambda x, c: jnp.pad(x.astype(jnp.int32), ((0, 0), (0, Tp - T)), constant_values=c)
  parts = lambda x: [_pad4(x[..., a:a + w], Tp) for a, w in _qk_parts(x.shape[-1])]
  return (parts(q), parts(k), _pad4(v, Tp), pad2(seg_q, _PAD_Q), pad2(seg_k, _PAD_K), tiles,
          Tp)


def _wide(D, Dv):
  """Whether a head dim's tile is past WIDE_DIM (the WIDE_ tiles and stages)."""
  return tile_dim(max(D, Dv)) > WIDE_DIM


def _qk_parts(D):
  return head_parts(D, SPLIT_HEAD_DIM)


def _joined(parts, D):
  """[B, Tp, H, D] from the per-part gradients (each padded to its tile)."""
  return jnp.concatenate([x[..., :w] for x, (_, w) in zip(parts, _qk_parts(D))], axis=-1)


def _block_ids(seg_BxTp, Bl):
  """[B, 2, NB] (min, max) segment id of each block of Bl positions, NB padded to a power of
  two (Triton's loads) with blocks that meet nothing."""
  B, Tp = seg_BxTp.shape
  blocks = seg_BxTp.reshape(B, Tp // Bl, Bl)
  ids = jnp.stack([blocks.min(-1), blocks.max(-1)], axis=1)
  pad = pl.next_power_of_2(Tp // Bl) - Tp // Bl
  never = jnp.broadcast_to(jnp.array([[jnp.iinfo(jnp.int32).max], [jnp.iinfo(jnp.int32).min]],
                                     jnp.int32), (B, 2, pad))
  return jnp.concatenate([ids, never], axis=-1)


def _ids_spec(ids):
  return pl.BlockSpec((None, *ids.shape[1:]), lambda b, h, i: (b, 0, 0))


def _specs(Bl, Tp, Ds, Dv, rows_of_q):
  """Offsets, then q's and k's parts (widths Ds), v, seg_q, seg_k; the grid axis walks q
  blocks or k blocks."""
  tile = lambda d: pl.BlockSpec((None, Bl, None, d), lambda b, h, i: (b, i, h, 0))
  whole = lambda d: pl.BlockSpec((None, Tp, None, d), lambda b, h, i: (b, 0, h, 0))
  seg_tile = pl.BlockSpec((None, Bl), lambda b, h, i: (b, i))
  seg_whole = pl.BlockSpec((None, Tp), lambda b, h, i: (b, 0))
  off = pl.BlockSpec((2,), lambda b, h, i: (0,))
  if rows_of_q:
    return [off, *map(tile, Ds), *map(whole, Ds), whole(Dv), seg_tile, seg_whole]
  return [off, *map(whole, Ds), *map(tile, Ds), tile(Dv), seg_whole, seg_tile]


def _call(kernel, grid, in_specs, out_specs, out_shape, interpret, name, tiles):
  params = None if interpret else pltriton.CompilerParams(num_warps=tiles.warps,
                                                          num_stages=tiles.stages)
  return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                        out_shape=out_shape, interpret=interpret, name=name,
                        compiler_params=params)


def ring_step_forward(q_BxTxHxD, k_BxTxHxD, v_BxTxHxDv, seg_q_BxT, seg_k_BxT, q_first, k_first,
                      *, scale, interpret=None, tiles=None, out_dtype=F32):
  """(o [B,T,H,Dv] in out_dtype, normalised over this block; lse [B,H,T] fp32, -inf where
  the block shows a query nothing). tiles: the kernel's Tiles (default FWD, WIDE_FWD past
  WIDE_DIM). out_dtype: fp32
  where steps are merged (ring attention); the model's dtype where the block is the whole
  attention (pallas_gpu_causal.py), so no convert follows the kernel."""
  B, T, H, D = q_BxTxHxD.shape
  Dv = v_BxTxHxDv.shape[-1]
  interpret = jax.default_backend() != "gpu" if interpret is None else interpret
  wide = _wide(D, Dv)
  qs, ks, v, sq, sk, (t,), Tp = _padded(q_BxTxHxD, k_BxTxHxD, v_BxTxHxDv, seg_q_BxT,
                                        seg_k_BxT, [tiles or (WIDE_FWD if wide else FWD)])
  Ds, Dvp = [x.shape[-1] for x in qs], v.shape[-1]
  off = jnp.stack([q_first, k_first]).astype(jnp.int32)
  ids = _block_ids(sk, t.loop)
  o, lse = _call(
      functools.partial(_fwd_kernel, scale=scale, block_k=t.loop, n_parts=len(qs)),
      (B, H, Tp // t.rows), _specs(t.rows, Tp, Ds, Dvp, rows_of_q=True) + [_ids_spec(ids)],
      [pl.BlockSpec((None, t.rows, None, Dvp), lambda b, h, i: (b, i, h, 0)),
       pl.BlockSpec((None, None, t.rows), lambda b, h, i: (b, h, i))],
      [jax.ShapeDtypeStruct((B, Tp, H, Dvp), out_dtype), jax.ShapeDtypeStruct((B, H, Tp), F32)],
      interpret, "ring_step_fwd", t)(off, *qs, *ks, v, sq, sk, ids)
  return o[:, :T, :, :Dv], lse[..., :T]


def ring_step_backward(q_BxTxHxD, k_BxTxHxD, v_BxTxHxDv, seg_q_BxT, seg_k_BxT, q_first, k_first,
                       do_BxTxHxDv, lse_BxHxT, delta_BxHxT, *, scale, interpret=None,
                       tiles=None, out_dtype=F32):
  """This step's share of (dq, dk, dv), in out_dtype (fp32 where steps are summed), from the
  final lse and delta = rowsum(dO ⊙ O). tiles: (dq's, dk/dv's) Tiles (default DQ, DKV;
  WIDE_DQ, WIDE_DKV past WIDE_DIM)."""
  B, T, H, D = q_BxTxHxD.shape
  Dv = v_BxTxHxDv.shape[-1]
  interpret = jax.default_backend() != "gpu" if interpret is None else interpret
  default = (WIDE_DQ, WIDE_DKV) if _wide(D, Dv) else (DQ, DKV)
  qs, ks, v, sq, sk, (tq, tk), Tp = _padded(q_BxTxHxD, k_BxTxHxD, v_BxTxHxDv, seg_q_BxT,
                                            seg_k_BxT, list(tiles or default))
  Ds, Dvp, n = [x.shape[-1] for x in qs], v.shape[-1], len(qs)
  do = _pad4(do_BxTxHxDv.astype(qs[0].dtype), Tp)
  lse, delta = (jnp.pad(x, ((0, 0), (0, 0), (0, Tp - T))) for x in (lse_BxHxT, delta_BxHxT))
  off = jnp.stack([q_first, k_first]).astype(jnp.int32)
  row_tile = lambda Bl: pl.BlockSpec((None, None, Bl), lambda b, h, i: (b, h, i))
  row_whole = pl.BlockSpec((None, None, Tp), lambda b, h, i: (b, h, 0))
  tile = lambda Bl, d: pl.BlockSpec((None, Bl, None, d), lambda b, h, i: (b, i, h, 0))
  whole = lambda d: pl.BlockSpec((None, Tp, None, d), lambda b, h, i: (b, 0, h, 0))
  out = lambda d: jax.ShapeDtypeStruct((B, Tp, H, d), out_dtype)
  k_ids, q_ids = _block_ids(sk, tq.loop), _block_ids(sq, tk.loop)
  dq = _call(functools.partial(_dq_kernel, scale=scale, block_k=tq.loop, n_parts=n),
             (B, H, Tp // tq.rows),
             _specs(tq.rows, Tp, Ds, Dvp, rows_of_q=True)
             + [_ids_spec(k_ids), tile(tq.rows, Dvp), row_tile(tq.rows), row_tile(tq.rows)],
             [tile(tq.rows, d) for d in Ds], [out(d) for d in Ds], interpret, "ring_step_dq",
             tq)(off, *qs, *ks, v, sq, sk, k_ids, do, lse, delta)
  *dk, dv = _call(functools.partial(_dkv_kernel, scale=scale, block_q=tk.loop, n_parts=n),
                  (B, H, Tp // tk.rows),
                  _specs(tk.rows, Tp, Ds, Dvp, rows_of_q=False)
                  + [_ids_spec(q_ids), whole(Dvp), row_whole, row_whole],
                  [*(tile(tk.rows, d) for d in Ds), tile(tk.rows, Dvp)],
                  [*(out(d) for d in Ds), out(Dvp)], interpret, "ring_step_dkv", tk
                  )(off, *qs, *ks, v, sq, sk, q_ids, do, lse, delta)
  return (_joined(dq, D)[:, :T], _joined(dk, D)[:, :T], dv[:, :T, :, :Dv])
