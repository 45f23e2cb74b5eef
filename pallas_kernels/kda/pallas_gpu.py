"""KDA chunked kernels in Pallas (Triton lowering on GPU, `interpret=True` on CPU).

Prologue (pallas_gpu_prologue.py): padding masks, the chunk cumsum G of the gate and, when asked,
the gate itself and the q/k L2 norm, forward and backward.
Stage 1 (reference.chunk_intra, bounded gates) as three kernels, fla-style:
  _tiles_kernel     grid (B, H, N): A and Aqk of a chunk as [16, C] matmuls, each 16-row
                    sub-chunk against all rows before it on decays anchored at its middle
                    row, K contracted in BLOCK_K columns.
  _solve_kernel     grid (B, H, N): (I + Diag(β)A)^-1 — 16×16 diagonal blocks by forward
                    substitution in registers, off-diagonal blocks by block substitution.
  _wu_kernel        grid (B, H, N): W, U0 (T times [C, BLOCK_K] column blocks), Qg, Kd, decay.
Stage 2 (reference.chunk_recurrence):
  _recurrence_kernel      grid (B, H, V/BV): the state S [K, BV] stays in registers across
                          all chunks (one launch for the sequence); emits O, the final state
                          and, for the backward pass only, each chunk's start state.
  _recurrence_bwd_kernel  the same loop in reverse carrying dS; emits dU0, each chunk's U and
                          the dS at each chunk's end, and the cotangent of S0.
  _recurrence_grads_kernel  grid (B, H, N): the cotangents that contract over V (of W, Qg,
                          Kd, Aqk, decay), chunk by chunk over the whole of V.

Backward: stage 1 by _wu_bwd_kernel (solve and W/U0 terms, grid (B, H, N)) and
_tiles_bwd_kernel (the anchored [16, 16] tiles transposed, grid (B, H, N·K/BLOCK_K));
stage 2 by the recurrence kernels (chunk states recomputed, not stored by the forward).
A and T are kept from stage 1's forward.

The launch knobs below were chosen by benchmarks/profile_kda_stages.py and
benchmarks/bench_kda.py --knobs on the H200 (benchmarks/kda.md).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import residuals
from pallas_kernels.kda import pallas_gpu_prologue, reference
from pallas_kernels.kda.recurrence_vjp import recurrence_with_vjp

SUB = reference.SUB
F32 = jnp.float32


def _dot(a, b):
  return jnp.dot(a, b, preferred_element_type=F32)


def _dot_t(a, b):
  """a @ bᵀ."""
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=F32)


def _t_dot(a, b):
  """aᵀ @ b."""
  return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=F32)


def _inv_unit_lower(N_LL):
  """(I + N)^-1 for strictly lower-triangular N [L, L], by forward substitution.

  Row i of T solves T_i = e_i - Σ_{j<i} N_ij T_j; rows are picked with masks so the
  whole solve stays in registers (no dynamic indexing).
  """
  L = N_LL.shape[0]
  rows = jax.lax.broadcasted_iota(jnp.int32, (L, L), 0)
  cols = jax.lax.broadcasted_iota(jnp.int32, (L, L), 1)
  T_LL = (rows == cols).astype(F32)
  col_L = jax.lax.broadcasted_iota(jnp.int32, (L,), 0)
  for i in range(1, L):
    n_i = jnp.sum(jnp.where(rows == i, N_LL, 0.0), axis=0)          # row i of N as [L]
    t_i = jnp.where(col_L == i, 1.0, 0.0) - jnp.sum(n_i[:, None] * T_LL, axis=0)
    T_LL = jnp.where(rows == i, t_i[None, :], T_LL)
  return T_LL


def _col_loop(n_blocks, block, body, carry, rolled=True):
  """body(cols, carry) over `n_blocks` column blocks of width `block`: a rolled loop keeps
  the kernel's code (and its compile time) the same size whatever K and V are; unrolled,
  the compiler can issue the next block's loads early."""
  if not rolled:
    for i in range(n_blocks):
      carry = body(pl.ds(i * block, block), carry)
    return carry
  return jax.lax.fori_loop(
      0, n_blocks, lambda i, c: body(pl.ds(pl.multiple_of(i * block, block), block), c), carry)


def _exp_where(mask, x):
  """e^x where mask, else 0; the exponential never sees x outside the mask (rows whose
  anchored exponent could overflow)."""
  return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


def _anchor_row(a, b):
  """Anchor row of tile (a, b) (see reference._sub_chunk_decays): the middle row of sub-chunk
  a on the diagonal, the last row of sub-chunk b below it. A Python int, as the forward's:
  the same row computed in the kernel (jnp.where of constants) gave NaN dq/dk/dg from this
  kernel under Triton on the H200 (41% of elements) while interpret mode was
  exact. Any anchor gives the same products, so a wrong row overflows e^{anchor - G}."""
  return a * SUB + SUB // 2 if a == b else b * SUB + SUB - 1


def _chunk_gates(G_ref, seg_ref, cols):
  """Per-chunk decay factors on columns `cols`: Γ = e^G [C,BK] on rows S0 reaches (before
  any reset); e^{G_end - G} on rows that reach the chunk's end state; decay = Γ_end [1,BK]."""
  C = G_ref.shape[0]
  G, seg = G_ref[:, cols].astype(F32), seg_ref[...]
  seg_end = seg_ref[pl.ds(C - 1, 1)]
  G_end = G_ref[pl.ds(C - 1, 1), cols].astype(F32)
  gamma = jnp.where((seg == 0)[:, None], jnp.exp(G), 0.0)
  to_end = jnp.where((seg == seg_end)[:, None], jnp.exp(G_end - G), 0.0)
  decay = jnp.where(seg_end == 0, jnp.exp(G_end), 0.0)
  return gamma, to_end, decay


def _tiles_kernel(q_ref, k_ref, G_ref, seg_ref, Akk_ref, Aqk_ref, *, scale, block_k, bounded):
  """A (strictly causal) and Aqk of one chunk, a 16-row sub-chunk a at a time against all
  the rows before it: A_a = (K_a ⊙ e^{G_a - m_a}) (K ⊙ e^{m_a - G})ᵀ, with m_a the middle
  row of sub-chunk a as anchor. Rows before sub-chunk a have G ≥ m_a (factor ≤ 1), rows
  of a are within 8 steps (e^{≤40}), rows after it are zeroed before the exponential, so
  nothing overflows. [16, C] tiles, K contracted in `block_k` columns.

  Unbounded gates (Kimi's): e^{40} no longer bounds a sub-chunk's own rows, so the product
  covers the rows before sub-chunk a only, anchored at the last of them (both factors ≤ 1
  for any gate), and the [16, 16] diagonal tile is summed elementwise, column by column
  (_diagonal_columns)."""
  C, K = q_ref.shape
  L, S = SUB, C // SUB
  row_C1 = jax.lax.broadcasted_iota(jnp.int32, (C, 1), 0)
  j_LC = jax.lax.broadcasted_iota(jnp.int32, (L, C), 1)

  def k_block(cols, acc):
    k, G = k_ref[:, cols].astype(F32), G_ref[:, cols].astype(F32)
    out = []
    for a in range(S):
      rows = pl.ds(a * L, L)
      A_kk, A_qk = acc[2 * a], acc[2 * a + 1]
      if bounded or a > 0:
        anchor_row = a * L + L // 2 if bounded else a * L - 1
        anchor = G_ref[pl.ds(anchor_row, 1), cols].astype(F32)
        left = jnp.exp(G_ref[rows, cols].astype(F32) - anchor)
        seen = row_C1 < (a + 1 if bounded else a) * L
        k_right = k * _exp_where(seen, anchor - G)
        A_kk = A_kk + _dot_t(k_ref[rows, cols].astype(F32) * left, k_right)
        A_qk = A_qk + _dot_t(q_ref[rows, cols].astype(F32) * left, k_right)
      if not bounded:
        k_a, q_a = k_ref[rows, cols].astype(F32), q_ref[rows, cols].astype(F32)
        for j, col_kk, col_qk in _diagonal_columns(k_ref, G_ref, a, cols, k_a, q_a):
          A_kk = A_kk + jnp.where(j_LC == a * L + j, col_kk[:, None], 0.0)
          A_qk = A_qk + jnp.where(j_LC == a * L + j, col_qk[:, None], 0.0)
      out += [A_kk, A_qk]
    return tuple(out)

  acc = _col_loop(K // block_k, block_k, k_block,
                  tuple(jnp.zeros((L, C), F32) for _ in range(2 * S)), rolled=ROLLED)
  seg = seg_ref[...]
  j_LC = jax.lax.broadcasted_iota(jnp.int32, (L, C), 1)
  for a in range(S):
    rows = pl.ds(a * L, L)
    i_LC = a * L + jax.lax.broadcasted_iota(jnp.int32, (L, C), 0)
    same = seg_ref[rows][:, None] == seg[None, :]
    Akk_ref[rows, :] = jnp.where(same & (i_LC > j_LC), acc[2 * a], 0.0).astype(Akk_ref.dtype)
    Aqk_ref[rows, :] = (jnp.where(same & (i_LC >= j_LC), acc[2 * a + 1], 0.0)
                        * scale).astype(Aqk_ref.dtype)


def _diagonal_columns(k_ref, G_ref, a, cols, k_a, q_a):
  """Column j of sub-chunk a's diagonal tiles, elementwise: for its rows i ≥ j,
  Σ_k k_i k_j e^{G_i - G_j} and Σ_k q_i k_j e^{G_i - G_j} (each exponent ≤ 0 for any
  gate; rows i < j are zeroed before the exponential). Yields (j, [16], [16]) for the 16
  columns, over the `cols` block of K."""
  L = SUB
  i_L1 = jax.lax.broadcasted_iota(jnp.int32, (L, 1), 0)
  G_a = G_ref[pl.ds(a * L, L), cols].astype(F32)
  for j in range(L):
    k_j = k_ref[pl.ds(a * L + j, 1), cols].astype(F32)
    e = _exp_where(i_L1 >= j, G_a - G_ref[pl.ds(a * L + j, 1), cols].astype(F32))
    yield j, jnp.sum(k_a * k_j * e, axis=1), jnp.sum(q_a * k_j * e, axis=1)


def _solve_kernel(A_ref, beta_ref, T_ref):
  """T = (I + Diag(β)A)^-1 for one chunk: diagonal 16×16 blocks by substitution, then
  T_ab = -T_aa Σ_{b≤c<a} (β A)_ac T_cb."""
  C = A_ref.shape[0]
  L, S = SUB, C // SUB
  blk = lambda a, b: (beta_ref[pl.ds(a * L, L)].astype(F32)[:, None]
                      * A_ref[pl.ds(a * L, L), pl.ds(b * L, L)].astype(F32))
  T = {}
  for a in range(S):
    T[a, a] = _inv_unit_lower(blk(a, a))
    for b in range(a):
      T[a, b] = -_dot(T[a, a], sum(_dot(blk(a, c), T[c, b]) for c in range(b, a)))
    for b in range(S):
      T_ref[pl.ds(a * L, L), pl.ds(b * L, L)] = (
          T[a, b] if b <= a else jnp.zeros((L, L), F32)).astype(T_ref.dtype)


def _wu_kernel(T_ref, q_ref, k_ref, v_ref, G_ref, beta_ref, seg_ref,
               W_ref, U0_ref, Qg_ref, Kd_ref, decay_ref, *, scale, block):
  """W = T·Diag(β)(K⊙Γ), U0 = T·Diag(β)V, and the decayed Qg, Kd, decay of one chunk, in
  `block`-wide column blocks (a whole [C, K] in fp32 would spill)."""
  C, K = k_ref.shape
  V = v_ref.shape[1]
  T_CC = T_ref[...].astype(F32)
  beta_C1 = beta_ref[...].astype(F32)[:, None]

  def k_block(cols, carry):
    gamma, to_end, decay = _chunk_gates(G_ref, seg_ref, cols)
    k = k_ref[:, cols].astype(F32)
    W_ref[:, cols] = _dot(T_CC, beta_C1 * k * gamma).astype(W_ref.dtype)
    Qg_ref[:, cols] = (q_ref[:, cols].astype(F32) * gamma * scale).astype(Qg_ref.dtype)
    Kd_ref[:, cols] = (k * to_end).astype(Kd_ref.dtype)
    decay_ref[cols] = decay.reshape(-1).astype(decay_ref.dtype)
    return carry

  def v_block(cols, carry):
    U0_ref[:, cols] = _dot(T_CC, beta_C1 * v_ref[:, cols].astype(F32)).astype(U0_ref.dtype)
    return carry

  _col_loop(K // block, block, k_block, 0, rolled=ROLLED)
  _col_loop(V // block, block, v_block, 0, rolled=ROLLED)


def _lower_tiles(S):
  """(a, b) for the lower-triangular grid of 16×16 tiles, b ≤ a."""
  return [(a, b) for a in range(S) for b in range(a + 1)]


def _wu_bwd_kernel(T_ref, A_ref, q_ref, k_ref, v_ref, G_ref, beta_ref, seg_ref,
                   dW_ref, dU0_ref, dQg_ref, dKd_ref, ddecay_ref,
                   dA_ref, dq_ref, dk_ref, dv_ref, dbeta_ref, dG_ref, *, scale, block):
  """Backward of _wu_kernel and of the triangular solve, one chunk, in `block`-wide column
  blocks: first dT = dW Xᵀ + dU0 Yᵀ (X = β K⊙Γ, Y = β V), then d(βA) = -Tᵀ dT Tᵀ on A's
  support (emitted as dA for _tiles_bwd_kernel), then per block dX = Tᵀ dW, dY = Tᵀ dU0
  and the elementwise Qg / Kd / decay terms."""
  C, K = k_ref.shape
  V = v_ref.shape[1]
  T_CC = T_ref[...].astype(F32)
  seg = seg_ref[...]
  beta_C1 = beta_ref[...].astype(F32)[:, None]

  def dT_k(cols, dT):
    gamma, _, _ = _chunk_gates(G_ref, seg_ref, cols)
    X = beta_C1 * k_ref[:, cols].astype(F32) * gamma
    return dT + _dot_t(dW_ref[:, cols].astype(F32), X)

  def dT_v(cols, dT):
    return dT + _dot_t(dU0_ref[:, cols].astype(F32), beta_C1 * v_ref[:, cols].astype(F32))

  dT = _col_loop(V // block, block, dT_v,
                 _col_loop(K // block, block, dT_k, jnp.zeros((C, C), F32), rolled=ROLLED),
                 rolled=ROLLED)
  dL = -_t_dot(T_CC, _dot_t(dT, T_CC))                  # cotangent of L = I + Diag(β)A
  i_CC = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
  j_CC = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
  support = (seg[:, None] == seg[None, :]) & (i_CC > j_CC)       # where A is not masked
  dA_ref[...] = jnp.where(support, beta_C1 * dL, 0.0).astype(dA_ref.dtype)
  dbeta = jnp.sum(dL * A_ref[...].astype(F32), axis=1)
  last_C1 = jax.lax.broadcasted_iota(jnp.int32, (C, 1), 0) == C - 1

  def k_block(cols, dbeta):
    gamma, to_end, decay = _chunk_gates(G_ref, seg_ref, cols)
    q, k = q_ref[:, cols].astype(F32), k_ref[:, cols].astype(F32)
    dQg, dKd = dQg_ref[:, cols].astype(F32), dKd_ref[:, cols].astype(F32)
    dX = _t_dot(T_CC, dW_ref[:, cols].astype(F32))
    dq_ref[:, cols] = (dQg * scale * gamma).astype(dq_ref.dtype)
    dk_ref[:, cols] = (dX * beta_C1 * gamma + dKd * to_end).astype(dk_ref.dtype)
    P = dKd * k * to_end                                   # d/dG of Kd = k e^{G_end - G}
    dG_end = (jnp.sum(P, axis=0, keepdims=True)
              + ddecay_ref[cols].astype(F32).reshape(1, -1) * decay)
    dG = (dX * beta_C1 * k + dQg * scale * q) * gamma - P + jnp.where(last_C1, dG_end, 0.0)
    dG_ref[:, cols] = dG.astype(dG_ref.dtype)
    return dbeta + jnp.sum(dX * k * gamma, axis=1)

  def v_block(cols, dbeta):
    v = v_ref[:, cols].astype(F32)
    dY = _t_dot(T_CC, dU0_ref[:, cols].astype(F32))
    dv_ref[:, cols] = (beta_C1 * dY).astype(dv_ref.dtype)
    return dbeta + jnp.sum(dY * v, axis=1)

  dbeta = _col_loop(K // block, block, k_block, dbeta, rolled=ROLLED)
  dbeta = _col_loop(V // block, block, v_block, dbeta, rolled=ROLLED)
  dbeta_ref[...] = dbeta.astype(dbeta_ref.dtype)


def _tile_bwd(q, k, G, a, b, anchor, dA, dAqk, dq, dk, dG):
  """Adds one anchored tile pair's cotangents into the per-sub-chunk lists dq, dk, dG. For
  a tile X_a·left (Y_b·right)ᵀ with cotangent D: d(X_a·left) = D (Y_b·right), d(Y_b·right)
  = Dᵀ (X_a·left); the anchor carries no gradient. dAqk is already masked and scaled."""
  left, right = jnp.exp(G[a] - anchor), jnp.exp(anchor - G[b])
  kl, ql, kr = k[a] * left, q[a] * left, k[b] * right
  d_kl, d_ql = _dot(dA, kr), _dot(dAqk, kr)
  d_kr = _t_dot(dA, kl) + _t_dot(dAqk, ql)
  dk[a] += d_kl * left
  dq[a] += d_ql * left
  dG[a] += d_kl * kl + d_ql * ql
  dk[b] += d_kr * right
  dG[b] -= d_kr * kr


def _diagonal_tile_bwd(q, k, G, a, dA, dAqk, dq, dk, dG):
  """Adds the cotangents of sub-chunk a's elementwise diagonal tiles (unbounded gates;
  _diagonal_columns) into dq, dk, dG, a column j at a time. With E_ij = e^{G_i - G_j}
  (i ≥ j), A_ij = Σ_k k_i k_j E_ij and Aqk_ij = Σ_k q_i k_j E_ij: row i gets
  dk_i += Σ_j dA_ij k_j E_ij and dq_i += Σ_j dAqk_ij k_j E_ij, column j gets
  dk_j += Σ_i (dA_ij k_i + dAqk_ij q_i) E_ij, and dG = k·(row part of dk) + q·dq − k·(column
  part of dk). dA and dAqk are already masked (and dAqk scaled)."""
  L = SUB
  i_L1 = jax.lax.broadcasted_iota(jnp.int32, (L, 1), 0)
  j_1L = jax.lax.broadcasted_iota(jnp.int32, (1, L), 1)
  dk_row = dq_d = dk_col = jnp.zeros_like(k[a])
  for j in range(L):
    pick = i_L1 == j
    k_j = jnp.sum(jnp.where(pick, k[a], 0.0), axis=0, keepdims=True)        # row j, [1, BK]
    G_j = jnp.sum(jnp.where(pick, G[a], 0.0), axis=0, keepdims=True)
    e = _exp_where(i_L1 >= j, G[a] - G_j)
    dA_j = jnp.sum(jnp.where(j_1L == j, dA, 0.0), axis=1, keepdims=True)     # column j, [L, 1]
    dAqk_j = jnp.sum(jnp.where(j_1L == j, dAqk, 0.0), axis=1, keepdims=True)
    dk_row += dA_j * k_j * e
    dq_d += dAqk_j * k_j * e
    dk_col += jnp.where(pick, jnp.sum((dA_j * k[a] + dAqk_j * q[a]) * e, axis=0,
                                      keepdims=True), 0.0)
  dq[a] += dq_d
  dk[a] += dk_row + dk_col
  dG[a] += k[a] * dk_row + q[a] * dq_d - k[a] * dk_col


def _tiles_bwd_kernel(q_ref, k_ref, G_ref, seg_ref, dA_ref, dAqk_ref, dq_ref, dk_ref, dG_ref,
                      *, scale, bounded):
  """Backward of _tiles_kernel for one chunk and one block of K columns (they are
  independent): the anchored [16, 16] tiles transposed (_tile_bwd). Its anchors are
  _anchor_row's; any anchor gives the same products, and these keep both factors ≤ 1 below
  the diagonal. Unbounded gates take the diagonal tiles elementwise (_diagonal_tile_bwd)."""
  C, BK = q_ref.shape
  L, S = SUB, C // SUB
  i_LL = jax.lax.broadcasted_iota(jnp.int32, (L, L), 0)
  j_LL = jax.lax.broadcasted_iota(jnp.int32, (L, L), 1)
  rows = [pl.ds(a * L, L) for a in range(S)]
  q, k, G = ([ref[r, :].astype(F32) for r in rows] for ref in (q_ref, k_ref, G_ref))
  dq, dk, dG = ([jnp.zeros((L, BK), F32) for _ in range(S)] for _ in range(3))
  for a, b in _lower_tiles(S):
    blk = (rows[a], rows[b])
    keep = (i_LL >= j_LL) if a == b else (i_LL >= 0)
    same = seg_ref[rows[a]][:, None] == seg_ref[rows[b]][None, :]
    dAqk = jnp.where(keep & same, dAqk_ref[blk].astype(F32), 0.0) * scale
    if a == b and not bounded:
      dA = jnp.where((i_LL > j_LL) & same, dA_ref[blk].astype(F32), 0.0)
      _diagonal_tile_bwd(q, k, G, a, dA, dAqk, dq, dk, dG)
      continue
    anchor = G_ref[pl.ds(_anchor_row(a, b), 1), :].astype(F32)
    _tile_bwd(q, k, G, a, b, anchor, dA_ref[blk].astype(F32), dAqk, dq, dk, dG)
  for a in range(S):
    dq_ref[rows[a], :] = dq[a].astype(dq_ref.dtype)
    dk_ref[rows[a], :] = dk[a].astype(dk_ref.dtype)
    dG_ref[rows[a], :] = dG[a].astype(dG_ref.dtype)


def _recurrence_kernel(W_ref, U0_ref, Qg_ref, Kd_ref, Aqk_ref, decay_ref, S0_ref,
                       O_ref, S_ref, *states_ref, chunk_size):
  C = chunk_size
  N = W_ref.shape[0] // C
  dot_dtype = W_ref.dtype

  def body(n, S_KV):
    t = pl.ds(pl.multiple_of(n * C, C), C)
    if states_ref:
      states_ref[0][pl.ds(n, 1), :, :] = S_KV[None]
    S_d = S_KV.astype(dot_dtype)
    U_CV = U0_ref[t, :].astype(F32) - _dot(W_ref[t, :], S_d)
    O_CV = _dot(Qg_ref[t, :], S_d) + _dot(Aqk_ref[t, :], U_CV.astype(dot_dtype))
    O_ref[t, :] = O_CV.astype(O_ref.dtype)
    decay_K1 = decay_ref[pl.ds(n, 1), :].reshape(-1, 1)
    return decay_K1 * S_KV + _t_dot(Kd_ref[t, :], U_CV.astype(dot_dtype))

  S_ref[...] = jax.lax.fori_loop(0, N, body, S0_ref[...].astype(F32)).astype(S_ref.dtype)


def _recurrence_bwd_kernel(W_ref, U0_ref, Qg_ref, Kd_ref, Aqk_ref, decay_ref, states_ref,
                           dO_ref, dSN_ref, dU0_ref, U_ref, dstates_ref, dS0_ref, *, chunk_size):
  """The sequential part of stage 2's backward: dS carried from the last chunk to the
  first. Per chunk it emits dU0 = Aqkᵀ dO + Kd dS, the chunk's U = U0 - W S and the dS
  flowing into the chunk's end, for _recurrence_grads_kernel to contract over all of V."""
  C = chunk_size
  N = W_ref.shape[0] // C
  dot_dtype = W_ref.dtype
  S_KV_shape = dSN_ref.shape

  def body(i, dS_KV):
    n = N - 1 - i
    t = pl.ds(pl.multiple_of(n * C, C), C)
    S_KV = states_ref[pl.ds(n, 1), :, :].reshape(S_KV_shape)
    dstates_ref[pl.ds(n, 1), :, :] = dS_KV[None]
    W, Qg, Kd, Aqk = W_ref[t, :], Qg_ref[t, :], Kd_ref[t, :], Aqk_ref[t, :]
    dO = dO_ref[t, :].astype(dot_dtype)
    S_d, dS_d = S_KV.astype(dot_dtype), dS_KV.astype(dot_dtype)
    U_ref[t, :] = (U0_ref[t, :].astype(F32) - _dot(W, S_d)).astype(U_ref.dtype)
    dU_CV = _t_dot(Aqk, dO) + _dot(Kd, dS_d)
    dU0_ref[t, :] = dU_CV.astype(dU0_ref.dtype)
    decay_K1 = decay_ref[pl.ds(n, 1), :].reshape(-1, 1)
    return decay_K1 * dS_KV + _t_dot(Qg, dO) - _t_dot(W, dU_CV.astype(dot_dtype))

  dS0_ref[...] = jax.lax.fori_loop(0, N, body, dSN_ref[...].astype(F32)).astype(dS0_ref.dtype)


def _recurrence_grads_kernel(S_ref, dS_ref, dO_ref, U_ref, dU_ref,
                             dW_ref, dQg_ref, dKd_ref, dAqk_ref, ddecay_ref, *, block):
  """The parallel part, one chunk per program: with S its start state and dS the cotangent
  of its end state, dQg = dO Sᵀ, dKd = U dSᵀ, dW = -dU Sᵀ, dAqk = dO Uᵀ and
  d(decay) = Σ_v S ⊙ dS, each contracted over the whole of V here (no partial sums over
  V blocks to write and add up)."""
  K, V = S_ref.shape
  C = dO_ref.shape[0]
  dt = U_ref.dtype

  def k_block(kc, carry):
    def v_block(vc, acc):
      dQg, dKd, dW, dd = acc
      S, dS = S_ref[kc, vc], dS_ref[kc, vc]
      S_d, dS_d = S.astype(dt), dS.astype(dt)
      dO, U, dU = dO_ref[:, vc].astype(dt), U_ref[:, vc], dU_ref[:, vc].astype(dt)
      return (dQg + _dot_t(dO, S_d), dKd + _dot_t(U, dS_d), dW - _dot_t(dU, S_d),
              dd + jnp.sum(S * dS, axis=1))

    zeros = jnp.zeros((C, block), F32)
    dQg, dKd, dW, dd = _col_loop(V // block, block, v_block,
                                 (zeros, zeros, zeros, jnp.zeros((block,), F32)))
    dQg_ref[:, kc], dKd_ref[:, kc], dW_ref[:, kc] = (
        x.astype(r.dtype) for x, r in ((dQg, dQg_ref), (dKd, dKd_ref), (dW, dW_ref)))
    ddecay_ref[kc] = dd.astype(ddecay_ref.dtype)
    return carry

  _col_loop(K // block, block, k_block, 0)
  dAqk = _col_loop(V // block, block, lambda vc, acc: acc + _dot_t(
      dO_ref[:, vc].astype(dt), U_ref[:, vc]), jnp.zeros((C, C), F32))
  dAqk_ref[...] = dAqk.astype(dAqk_ref.dtype)


def _params(num_warps, num_stages, interpret):
  return None if interpret else pltriton.CompilerParams(num_warps=num_warps,
                                                        num_stages=num_stages)


# Launch knobs (H200: benchmarks/kda.md). Unrolled column loops were 10-70%
# slower; BLOCK_K 64 was faster for the tiles kernel alone, slower for the others.
BLOCK_K = 32         # K / V columns per step of the stage-1 kernels ...
ROLLED = True        # ... as a rolled loop (else unrolled)
# num_warps per kernel; the unbounded gates' tiles kernel spills at 2 and 4 warps with its
# elementwise diagonal, not at 8, at K = 128 (benchmarks/kernel_registers.py
# --op=kda_unbounded: 440, 72, 0 bytes a thread)
WARPS = {"tiles": 2, "solve": 1, "wu": 8, "wu_bwd": 4, "tiles_bwd": 4, "tiles_unbounded": 8}
RECURRENCE_WARPS = 4
BLOCK_V = 32         # V columns per recurrence program; the forward-only call widens it
WIDE_BLOCK_V = 64    # ... to this when the grid at BLOCK_V would not fit in one wave
GRADS_BLOCK = 32     # K and V block of the per-chunk gradient kernel (stage 2 backward)


def _chunk(C, D):
  """[C, D] rows of chunk n of a [B, Tp, H, D] array, for grid (B, H, N)."""
  return pl.BlockSpec((None, C, None, D), lambda b, h, n: (b, n, h, 0))


def _chunk_1d(C):
  """[C] of chunk n of a [B, Tp, H] array (β, dβ)."""
  return pl.BlockSpec((None, C, None), lambda b, h, n: (b, n, h))


def _chunk_seg(C):
  """[C] segment ids of chunk n ([B, Tp], shared by the heads)."""
  return pl.BlockSpec((None, C), lambda b, h, n: (b, n))


def _per_chunk(D):
  """[D] row of chunk n of a [B, N, H, D] array (the decay)."""
  return pl.BlockSpec((None, None, None, D), lambda b, h, n: (b, n, h, 0))


def _rows(q, D, dtype):
  B, Tp, H, _ = q.shape
  return jax.ShapeDtypeStruct((B, Tp, H, D), dtype)


def tiles_call(q, k, G, seg, *, scale, chunk_size, interpret, bounded=True):
  """(A fp32, Aqk) of every chunk."""
  B, Tp, H, K = q.shape
  C = chunk_size
  return pl.pallas_call(
      functools.partial(_tiles_kernel, scale=scale, block_k=min(K, BLOCK_K), bounded=bounded),
      grid=(B, H, Tp // C),
      in_specs=[_chunk(C, K)] * 3 + [_chunk_seg(C)],
      out_specs=[_chunk(C, C)] * 2, out_shape=[_rows(q, C, F32), _rows(q, C, q.dtype)],
      interpret=interpret, name="kda_intra_tiles" + ("" if bounded else "_unbounded"),
      compiler_params=_params(WARPS["tiles" if bounded else "tiles_unbounded"], 1, interpret),
  )(q, k, G, seg)


def solve_call(A, beta, *, chunk_size, interpret):
  """T = (I + Diag(β)A)^-1 of every chunk (fp32)."""
  B, Tp, H, C = A.shape
  return pl.pallas_call(
      _solve_kernel, grid=(B, H, Tp // C), in_specs=[_chunk(C, C), _chunk_1d(C)],
      out_specs=_chunk(C, C), out_shape=_rows(A, C, F32), interpret=interpret,
      name="kda_intra_solve", compiler_params=_params(WARPS["solve"], 1, interpret),
  )(A, beta)


def wu_call(T, q, k, v, G, beta, seg, *, scale, chunk_size, interpret):
  """(W, U0, Qg, Kd, decay) of every chunk from T."""
  B, Tp, H, K = q.shape
  V = v.shape[-1]
  C, N, dt = chunk_size, Tp // chunk_size, q.dtype
  return pl.pallas_call(
      functools.partial(_wu_kernel, scale=scale, block=min(K, V, BLOCK_K)),
      grid=(B, H, N),
      in_specs=[_chunk(C, C), _chunk(C, K), _chunk(C, K), _chunk(C, V), _chunk(C, K),
                _chunk_1d(C), _chunk_seg(C)],
      out_specs=[_chunk(C, K), _chunk(C, V), _chunk(C, K), _chunk(C, K), _per_chunk(K)],
      out_shape=[_rows(q, K, dt), _rows(q, V, dt), _rows(q, K, dt), _rows(q, K, dt),
                 jax.ShapeDtypeStruct((B, N, H, K), F32)],
      interpret=interpret, name="kda_intra_wu",
      compiler_params=_params(WARPS["wu"], 1, interpret),
  )(T, q, k, v, G, beta, seg)


def wu_bwd_call(T, A, q, k, v, G, beta, seg, d_st, *, scale, chunk_size, interpret):
  """(dA, and the W/U0/Qg/Kd/decay parts of dq, dk, dG, all fp32; dv in v's dtype and dβ
  fp32, whole)."""
  B, Tp, H, K = q.shape
  V = v.shape[-1]
  C = chunk_size
  return pl.pallas_call(
      functools.partial(_wu_bwd_kernel, scale=scale, block=min(K, V, BLOCK_K)),
      grid=(B, H, Tp // C),
      in_specs=[_chunk(C, C), _chunk(C, C), _chunk(C, K), _chunk(C, K), _chunk(C, V),
                _chunk(C, K), _chunk_1d(C), _chunk_seg(C), _chunk(C, K), _chunk(C, V),
                _chunk(C, K), _chunk(C, K), _per_chunk(K)],
      out_specs=[_chunk(C, C), _chunk(C, K), _chunk(C, K), _chunk(C, V), _chunk_1d(C),
                 _chunk(C, K)],
      out_shape=[_rows(q, C, F32), _rows(q, K, F32), _rows(q, K, F32), _rows(q, V, v.dtype),
                 jax.ShapeDtypeStruct((B, Tp, H), F32), _rows(q, K, F32)],
      interpret=interpret, name="kda_intra_wu_bwd",
      compiler_params=_params(WARPS["wu_bwd"], 1, interpret),
  )(T, A, q, k, v, G, beta, seg, d_st["W"], d_st["U0"], d_st["Qg"], d_st["Kd"], d_st["decay"])


def tiles_bwd_call(q, k, G, seg, dA, dAqk, *, scale, chunk_size, interpret, bounded=True):
  """The tiles' parts of (dq, dk, dG), fp32: one program per (chunk, K block), as the
  column blocks are independent. (Adding wu_bwd's parts here, to write dq and dk in bf16,
  made this kernel 40% slower in the 1B train step: benchmarks/kda.md.)"""
  B, Tp, H, K = q.shape
  C, BK = chunk_size, min(K, BLOCK_K)
  nk = K // BK
  cols = pl.BlockSpec((None, C, None, BK), lambda b, h, r: (b, r // nk, h, r % nk))
  whole = pl.BlockSpec((None, C, None, C), lambda b, h, r: (b, r // nk, h, 0))
  return pl.pallas_call(
      functools.partial(_tiles_bwd_kernel, scale=scale, bounded=bounded),
      grid=(B, H, Tp // C * nk),
      in_specs=[cols, cols, cols, pl.BlockSpec((None, C), lambda b, h, r: (b, r // nk)),
                whole, whole],
      out_specs=[cols] * 3, out_shape=[_rows(q, K, F32)] * 3,
      interpret=interpret, name="kda_intra_tiles_bwd",
      compiler_params=_params(WARPS["tiles_bwd"], 1, interpret),
  )(q, k, G, seg, dA, dAqk)


def intra_pallas(q, k, v, G, beta, seg, *, scale, chunk_size, interpret, bounded=True,
                 residuals=True):
  """Stage 1: (outputs of reference.chunk_intra(bounded=bounded), A, T), the last two kept
  for the backward pass (made whatever `residuals` says: the solve and W/U read them)."""
  C = chunk_size
  A, Aqk = tiles_call(q, k, G, seg, scale=scale, chunk_size=C, interpret=interpret,
                      bounded=bounded)
  T = solve_call(A, beta, chunk_size=C, interpret=interpret)
  W, U0, Qg, Kd, decay = wu_call(T, q, k, v, G, beta, seg, scale=scale, chunk_size=C,
                                 interpret=interpret)
  return {"W": W, "U0": U0, "Qg": Qg, "Kd": Kd, "Aqk": Aqk, "decay": decay}, A, T


def intra_bwd_pallas(q, k, v, G, beta, seg, A, T, d_st, *, scale, chunk_size, interpret,
                     bounded=True):
  """Cotangents (dq, dk, dv, dG, dβ) of stage 1 from those of its outputs (dq, dk, dG fp32;
  dv in v's dtype)."""
  C = chunk_size
  dA, dq0, dk0, dv, dbeta, dG0 = wu_bwd_call(T, A, q, k, v, G, beta, seg, d_st, scale=scale,
                                             chunk_size=C, interpret=interpret)
  dq1, dk1, dG1 = tiles_bwd_call(q, k, G, seg, dA, d_st["Aqk"], scale=scale, chunk_size=C,
                                 interpret=interpret, bounded=bounded)
  return dq0 + dq1, dk0 + dk1, dv, dG0 + dG1, dbeta


def _num_sms():
  return getattr(jax.devices()[0], "core_count", None) or 132


def _block_v(B, H, V, with_states):
  """BLOCK_V, or WIDE_BLOCK_V for the forward-only call when B·H·V/BLOCK_V programs exceed
  one wave: each program walks the whole sequence, so fewer, wider programs finish first
  (H200, 4×8192×16: 0.69 ms at 64 vs 1.20 ms at 32; at 1×8192×16, one wave, 32 is faster).
  The backward and the chunk-state call stay at BLOCK_V (64 exceeds shared memory)."""
  if not with_states and B * H * pl.cdiv(V, BLOCK_V) > _num_sms():
    return min(V, WIDE_BLOCK_V)
  return min(V, BLOCK_V)


def _recurrence_call(st, S0, *, chunk_size, with_states, interpret):
  B, Tp, H, K = st["W"].shape
  V = st["U0"].shape[-1]
  C, N, BV = chunk_size, Tp // chunk_size, _block_v(B, H, V, with_states)
  full = lambda D: pl.BlockSpec((None, Tp, None, D), lambda b, h, j: (b, 0, h, 0))
  vblk = pl.BlockSpec((None, Tp, None, BV), lambda b, h, j: (b, 0, h, j))
  state = pl.BlockSpec((None, None, K, BV), lambda b, h, j: (b, h, 0, j))
  # O in the inputs' dtype: one rounding, as a cast after the kernel would do.
  out_shape = [jax.ShapeDtypeStruct((B, Tp, H, V), st["U0"].dtype),
               jax.ShapeDtypeStruct((B, H, K, V), F32)]
  out_specs = [vblk, state]
  if with_states:
    out_shape.append(jax.ShapeDtypeStruct((B, H, N, K, V), F32))
    out_specs.append(pl.BlockSpec((None, None, N, K, BV), lambda b, h, j: (b, h, 0, 0, j)))
  return pl.pallas_call(
      functools.partial(_recurrence_kernel, chunk_size=C),
      grid=(B, H, V // BV),
      in_specs=[full(K), vblk, full(K), full(K), full(C),
                pl.BlockSpec((None, N, None, K), lambda b, h, j: (b, 0, h, 0)), state],
      out_specs=out_specs, out_shape=out_shape, interpret=interpret, name="kda_recurrence",
      compiler_params=_params(RECURRENCE_WARPS, 2, interpret),
  )(st["W"], st["U0"], st["Qg"], st["Kd"], st["Aqk"], st["decay"], S0)


def _recurrence_bwd_call(st, states, dO, dSN, *, chunk_size, interpret):
  B, Tp, H, K = st["W"].shape
  V = st["U0"].shape[-1]
  C, N, BV = chunk_size, Tp // chunk_size, _block_v(B, H, V, with_states=True)
  dt = st["W"].dtype
  full = lambda D: pl.BlockSpec((None, Tp, None, D), lambda b, h, j: (b, 0, h, 0))
  vblk = pl.BlockSpec((None, Tp, None, BV), lambda b, h, j: (b, 0, h, j))
  state = pl.BlockSpec((None, None, K, BV), lambda b, h, j: (b, h, 0, j))
  chunk_states = pl.BlockSpec((None, None, N, K, BV), lambda b, h, j: (b, h, 0, 0, j))
  dU0, U, dstates, dS0 = pl.pallas_call(
      functools.partial(_recurrence_bwd_kernel, chunk_size=C),
      grid=(B, H, V // BV),
      in_specs=[full(K), vblk, full(K), full(K), full(C),
                pl.BlockSpec((None, N, None, K), lambda b, h, j: (b, 0, h, 0)),
                chunk_states, vblk, state],
      out_specs=[vblk, vblk, chunk_states, state],
      out_shape=[jax.ShapeDtypeStruct((B, Tp, H, V), dt),        # dU0
                 jax.ShapeDtypeStruct((B, Tp, H, V), dt),        # U, for the grads kernel
                 jax.ShapeDtypeStruct((B, H, N, K, V), F32),     # dS at each chunk's end
                 jax.ShapeDtypeStruct((B, H, K, V), F32)],       # dS0
      interpret=interpret, name="kda_recurrence_bwd",
      compiler_params=_params(RECURRENCE_WARPS, 2, interpret),
  )(st["W"], st["U0"], st["Qg"], st["Kd"], st["Aqk"], st["decay"], states, dO, dSN)
  return _recurrence_grads_call(states, dstates, dO, U, dU0, dS0, chunk_size=C,
                                interpret=interpret)


def _recurrence_grads_call(states, dstates, dO, U, dU0, dS0, *, chunk_size, interpret):
  """The per-chunk cotangents (grid (B, H, N)) from the sequential kernel's outputs: the
  stage-2 backward's return value (d_st, dS0)."""
  B, H, N, K, V = states.shape
  Tp, C, dt = U.shape[1], chunk_size, U.dtype
  chunk = lambda D: pl.BlockSpec((None, C, None, D), lambda b, h, n: (b, n, h, 0))
  one_state = pl.BlockSpec((None, None, None, K, V), lambda b, h, n: (b, h, n, 0, 0))
  rows = lambda D: jax.ShapeDtypeStruct((B, Tp, H, D), dt)
  dW, dQg, dKd, dAqk, ddecay = pl.pallas_call(
      functools.partial(_recurrence_grads_kernel, block=min(K, V, GRADS_BLOCK)),
      grid=(B, H, N),
      in_specs=[one_state, one_state, chunk(V), chunk(V), chunk(V)],
      out_specs=[chunk(K), chunk(K), chunk(K), chunk(C),
                 pl.BlockSpec((None, None, None, K), lambda b, h, n: (b, n, h, 0))],
      out_shape=[rows(K), rows(K), rows(K), rows(C), jax.ShapeDtypeStruct((B, N, H, K), F32)],
      interpret=interpret, name="kda_recurrence_grads",
      compiler_params=_params(RECURRENCE_WARPS, 1, interpret),
  )(states, dstates, dO, U, dU0)
  return ({"W": dW, "U0": dU0, "Qg": dQg, "Kd": dKd, "Aqk": dAqk, "decay": ddecay}, dS0)


# Stage 2 with a Pallas forward and backward: (o [B,Tp,H,V] in the stage-1 dtype, S fp32).
recurrence = recurrence_with_vjp(_recurrence_call, _recurrence_bwd_call)


def _intra_xla(q, k, v, G, beta, seg, scale, chunk_size, bounded=True):
  """reference.chunk_intra in fp32, outputs stored like the kernel's (input dtype): the
  stage 1 of unbounded gates, and the XLA baseline in benchmarks/profile_kda_stages.py."""
  out = reference.chunk_intra(q.astype(F32), k.astype(F32), v.astype(F32), G, beta, seg,
                              scale=scale, chunk_size=chunk_size, bounded=bounded)
  return {n: x.astype(q.dtype) if n != "decay" else x for n, x in out.items()}


def intra_with_vjp(fwd_call, bwd_call):
  """Stage 1 (bounded gates) as a custom VJP. fwd_call(q, k, v, G, beta, seg, scale=,
  chunk_size=, interpret=, residuals=) -> (outputs, A, T) as intra_pallas; A and T are the
  residuals, which the primal (no backward) asks not to be stored;
  bwd_call(q, k, v, G, beta, seg, A, T, d_st, scale=, chunk_size=, interpret=) -> (dq, dk,
  dv, dG, dβ), cast here to the inputs' dtypes."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
  def intra(q, k, v, G, beta, seg, scale, chunk_size, interpret):
    return fwd_call(q, k, v, G, beta, seg, scale=scale, chunk_size=chunk_size,
                    interpret=interpret, residuals=False)[0]

  def fwd(q, k, v, G, beta, seg, scale, chunk_size, interpret):
    st, A, T = fwd_call(q, k, v, G, beta, seg, scale=scale, chunk_size=chunk_size,
                        interpret=interpret)
    # q̂, k̂ and G are the prologue's outputs: a policy may rebuild them with its launch.
    q, k, G = residuals.tag((q, k, G), residuals.CHEAP)
    v, beta, seg, A, T = residuals.tag((v, beta, seg, A, T))
    return st, (q, k, v, G, beta, seg, A, T)

  def bwd(scale, chunk_size, interpret, res, d_st):
    q, k, v, G, beta, seg, A, T = res
    grads = bwd_call(q, k, v, G, beta, seg, A, T, d_st, scale=scale, chunk_size=chunk_size,
                     interpret=interpret)
    return (*(g.astype(x.dtype) for g, x in zip(grads, (q, k, v, G, beta))), None)

  intra.defvjp(fwd, bwd)
  return intra


# Stage 1 with the Pallas kernels forward and backward; for unbounded gates, with the
# diagonal tiles elementwise.
intra = intra_with_vjp(intra_pallas, intra_bwd_pallas)
intra_unbounded = intra_with_vjp(functools.partial(intra_pallas, bounded=False),
                                 functools.partial(intra_bwd_pallas, bounded=False))
# Stage 1 of unbounded gates (Kimi's) in every implementation: "pallas" (the kernels:
# intra_unbounded here, triton_gpu_stage1.intra_unbounded for triton, which passes it as
# stage1_unbounded) or "xla" (reference.chunk_intra in fp32). At 1×8192×32, K = V = 128
# on an H100, pallas_gpu on the Pallas stage 1 took 3.56 / 12.49 ms forward /
# forward+backward, triton (its faster stage 2) on XLA's 5.29 / 22.52 (benchmarks/kda.md,
# 2026-12-06); tests/test_kda.py checks both against the fp64 spec.
UNBOUNDED_STAGE1 = "pallas"


def kda_pallas_gpu(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None,
                   chunk_size=64, lower_bound=-5.0, A_log=None, dt_bias=None, qk_l2norm=False,
                   interpret=None, stage1=None, stage2=None, prologue=None,
                   unbounded_stage1=None, stage1_unbounded=None, core=None):
  """Chunked KDA on the Pallas kernels. Unbounded gates (lower_bound None) take stage 1
  `unbounded_stage1` (default UNBOUNDED_STAGE1): "pallas", stage1_unbounded (default
  intra_unbounded), or "xla", the XLA stage 1 in fp32. With A_log and dt_bias, g is the
  gate's input and kda_gate(g, A_log, dt_bias, lower_bound) runs in the prologue kernel;
  qk_l2norm normalises q and k there.
  stage1 / stage1_unbounded / stage2 / prologue: another stage 1 (bounded gates) / stage 1
  (unbounded) / stage 2 / prologue with this module's `intra` / `intra_unbounded` /
  `recurrence` / pallas_gpu_prologue.prologue contract (triton's).
  core: bounded gates' prologue and stages 1 and 2 as one op (triton_gpu_fwd16.core):
  core(staged, q, k, v, g, β, seg, S0, exp(A_log), dt_bias, live, scale, chunk_size,
  interpret, gate, lower_bound, qk_l2norm) -> (O, S_final) on chunk-padded inputs, where
  `staged` is the prologue and stages this op runs otherwise (its backward's forward)."""
  unbounded_stage1 = unbounded_stage1 or UNBOUNDED_STAGE1
  if unbounded_stage1 not in ("xla", "pallas"):
    raise ValueError(f"unbounded_stage1 must be 'xla' or 'pallas', got {unbounded_stage1!r}")
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  gate = "none" if A_log is None else ("bounded" if lower_bound is not None else "unbounded")
  return _kda_jit(q, k, v, g, beta, initial_state, segment_ids, A_log, dt_bias, scale=scale,
                  chunk_size=chunk_size, lower_bound=lower_bound, gate=gate,
                  qk_l2norm=qk_l2norm, interpret=interpret, unbounded_stage1=unbounded_stage1,
                  stage1=intra if stage1 is None else stage1,
                  stage1_unbounded=(intra_unbounded if stage1_unbounded is None
                                    else stage1_unbounded),
                  stage2=recurrence if stage2 is None else stage2,
                  prologue=pallas_gpu_prologue.prologue if prologue is None else prologue,
                  core=core)


def _gate_params(A_log, dt_bias, H, K):
  """exp(A_log) and dt_bias as the prologue's [H, K] fp32 rows (zeros without a gate)."""
  if A_log is None:
    return jnp.zeros((H, K), F32), jnp.zeros((H, K), F32)
  a_HK = jnp.broadcast_to(jnp.exp(A_log.astype(F32))[:, None], (H, K))
  return a_HK, dt_bias.astype(F32).reshape(H, K)


# Jitted, so that every layer with these shapes shares one trace and one lowering of the
# kernels (forward, backward, recomputation): the step's trace + lower time stops growing
# with the number of KDA layers.
@functools.partial(jax.jit, static_argnames=("scale", "chunk_size", "lower_bound", "gate",
                                             "qk_l2norm", "interpret", "unbounded_stage1",
                                             "stage1", "stage1_unbounded", "stage2",
                                             "prologue", "core"))
def _kda_jit(q, k, v, g, beta, initial_state, segment_ids, A_log, dt_bias, *, scale,
             chunk_size, lower_bound, gate, qk_l2norm, interpret, unbounded_stage1, stage1,
             stage1_unbounded, stage2, prologue, core):
  B, T, H, K = q.shape
  V = v.shape[-1]
  C = chunk_size
  dt = q.dtype if q.dtype in (jnp.bfloat16, jnp.float16) else F32
  live_BxT, reset_BxT = reference.segment_masks(segment_ids, B, T)
  live_BxT = jnp.ones((B, T), jnp.int32) if live_BxT is None else live_BxT.astype(jnp.int32)
  q, k, v = (x.astype(dt) for x in (q, k, v))
  g = g if g.dtype in (jnp.bfloat16, jnp.float16) else g.astype(F32)
  beta = beta.astype(F32)
  if segment_ids is not None:   # padding inert (prepare's masks; q, k, g in the prologue)
    v, beta = v * live_BxT[:, :, None, None].astype(dt), beta * live_BxT[:, :, None]
  q, k, v, g, beta, live_BxT, reset_BxT = reference.pad_to_chunks(C, q, k, v, g, beta,
                                                                  live_BxT, reset_BxT)
  a_HK, bias_HK = _gate_params(A_log, dt_bias, H, K)
  # q̂ = q and k̂ = k without the L2 norm and padding: the prologue need not copy them.
  qk = qk_l2norm or segment_ids is not None or T % C != 0
  seg = reference.chunk_segments(reset_BxT, C)
  S0 = jnp.zeros((B, H, K, V), F32) if initial_state is None else initial_state.astype(F32)
  staged = functools.partial(
      _stages, scale=scale, chunk_size=chunk_size, lower_bound=lower_bound, gate=gate,
      qk_l2norm=qk_l2norm, qk=qk, interpret=interpret, unbounded_stage1=unbounded_stage1,
      stage1=stage1, stage1_unbounded=stage1_unbounded, stage2=stage2, prologue=prologue)
  args = (q, k, v, g, beta, seg, S0, a_HK, bias_HK, live_BxT)
  if lower_bound is not None and core is not None:
    O, S = core(staged, *args, scale, chunk_size, interpret, gate, lower_bound, qk_l2norm)
  else:
    O, S = staged(*args)
  return O[:, :T], S


def _stages(q, k, v, g, beta, seg, S0, a_HK, bias_HK, live_BxT, *, scale, chunk_size,
            lower_bound, gate, qk_l2norm, qk, interpret, unbounded_stage1, stage1,
            stage1_unbounded, stage2, prologue):
  """The prologue, stage 1 and stage 2 on chunk-padded inputs: (O [B, Tp, H, V], S)."""
  dt = q.dtype
  q, k, G = prologue(q, k, g, a_HK, bias_HK, live_BxT, dt, gate, lower_bound, qk_l2norm,
                     chunk_size, interpret, qk)
  if lower_bound is not None:
    st = stage1(q, k, v, G, beta, seg, scale, chunk_size, interpret)
  elif unbounded_stage1 == "pallas":   # diagonal tiles elementwise in the tiles kernels
    st = stage1_unbounded(q, k, v, G, beta, seg, scale, chunk_size, interpret)
  else:  # unbounded gates: diagonal tiles elementwise in fp32 (the safe path)
    st = _intra_xla(q, k, v, G, beta, seg, scale, chunk_size, bounded=False)
  return stage2(st, S0, chunk_size, interpret)
