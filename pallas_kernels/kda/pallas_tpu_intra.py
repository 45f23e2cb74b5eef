"""KDA stage 1 (reference.chunk_intra, bounded gates) as Mosaic TPU kernels, one chunk per
program, forward and backward.

A chunk's working set is small next to VMEM (C = 64, K = V = 128 in fp32: q, k, v, G are
32 KB each, A and T 16 KB), so, unlike the GPU kernels, which split K into register-sized
column blocks over three launches, one program holds the whole chunk and does everything:

  _intra_kernel      A, Aqk from [16, C] anchored row tiles (each 16-row sub-chunk against
                     all rows before it, decays anchored at its middle row), T = (I+βA)^-1
                     by block substitution, then W = T·β(K⊙Γ), U0 = T·βV, Qg, Kd.
  _intra_bwd_kernel  A and T recomputed in VMEM, then the cotangents of q, k, v, G and β
                     (the derivation is written out beside each step).

Arrays are head-major [B, H, Tp, D] so that a block is a [C, D] tile whose last two dims
satisfy Mosaic's (8, 128) rule (C is a multiple of 8; D is the whole array dim). β and the
segment index arrive as [C, 1] columns, the segment index also as a [1, C] row, so that no
kernel has to transpose a vector. Every dot is fp32 at HIGHEST precision: stage 1 feeds a
triangular solve, where bf16 passes would cost the accuracy the fp64 tests check.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kda import reference

SUB = reference.SUB
F32 = jnp.float32
HI = jax.lax.Precision.HIGHEST


def dot(a, b):
  """a @ b in fp32."""
  return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=HI,
                             preferred_element_type=F32)


def dot_t(a, b):
  """a @ bᵀ (Mosaic's native transposed-rhs matmul)."""
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=HI,
                             preferred_element_type=F32)


def t_dot(a, b):
  """aᵀ @ b."""
  return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=HI,
                             preferred_element_type=F32)


def _iota(shape, dim):
  return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def chunk_masks(seg_C1, seg_1C):
  """(strict [C,C], causal [C,C], from_start [C,1], to_end [C,1]) of one chunk: where A and
  Aqk are kept (same segment, j < i / j ≤ i), the rows S0 reaches (before any reset) and the
  rows that reach the chunk's end state."""
  C = seg_C1.shape[0]
  same_CC = seg_C1 == seg_1C
  i_CC, j_CC = _iota((C, C), 0), _iota((C, C), 1)
  seg_end = jnp.max(seg_1C, axis=1, keepdims=True)   # [1, 1]: the index only grows in a chunk
  return same_CC & (i_CC > j_CC), same_CC & (i_CC >= j_CC), seg_C1 == 0, seg_C1 == seg_end


def gate_factors(G_CK, from_start_C1, to_end_C1):
  """Γ = e^G on rows S0 reaches, E = e^{G_end - G} on rows that reach the end state; both ≤ 1
  for any gate."""
  G_end_1K = jnp.min(G_CK, axis=0, keepdims=True)     # the last row: G = cumsum g, g ≤ 0
  gamma_CK = jnp.where(from_start_C1, jnp.exp(G_CK), 0.0)
  to_end_CK = jnp.where(to_end_C1, jnp.exp(G_end_1K - G_CK), 0.0)
  return gamma_CK, to_end_CK


def _anchored(G_CK, a):
  """(left [16,K], right [C,K]) of row tile a: e^{G_i - m} for its rows and e^{m - G_j} for
  every row j up to its end (0 after it, masked before the exponential), m = G of its middle
  row. Rows before the tile have G_j ≥ m (right ≤ 1); its own rows lie within 8 steps of m,
  so both factors stay in [e^-40, e^40] for gates ≥ -5."""
  C = G_CK.shape[0]
  m_1K = G_CK[a * SUB + SUB // 2:a * SUB + SUB // 2 + 1, :]
  left = jnp.exp(G_CK[a * SUB:(a + 1) * SUB, :] - m_1K)
  seen_C1 = _iota((C, 1), 0) < (a + 1) * SUB
  right = jnp.where(seen_C1, jnp.exp(jnp.where(seen_C1, m_1K - G_CK, 0.0)), 0.0)
  return left, right


def tiles(q_CK, k_CK, G_CK, strict_CC, causal_CC, scale):
  """(A, Aqk) [C, C]: Σ_c k_ic k_jc e^{G_ic - G_jc} on `strict`, scale·(q, k) on `causal`."""
  C = q_CK.shape[0]
  A_rows, Aqk_rows = [], []
  for a in range(C // SUB):
    left, right = _anchored(G_CK, a)
    rows = slice(a * SUB, (a + 1) * SUB)
    k_right = k_CK * right
    A_rows.append(dot_t(k_CK[rows] * left, k_right))
    Aqk_rows.append(dot_t(q_CK[rows] * left, k_right))
  A = jnp.concatenate(A_rows, axis=0)
  Aqk = jnp.concatenate(Aqk_rows, axis=0)
  return jnp.where(strict_CC, A, 0.0), jnp.where(causal_CC, Aqk, 0.0) * scale


def unit_lower_inverse(N_CC):
  """(I + N)^-1 for strictly lower-triangular N, exactly (no series): the 16×16 diagonal
  blocks by row substitution, all blocks at once (step r fixes row r of every block from the
  rows above it), then block substitution T_a = D_a^-1 (e_a - N_a,<a T_<a) one row block at a
  time. Rows are picked with masks over the whole [C, C], so no lane is ever sliced."""
  C = N_CC.shape[0]
  i_CC, j_CC = _iota((C, C), 0), _iota((C, C), 1)
  eye = (i_CC == j_CC).astype(F32)
  blk_row, blk_col = i_CC // SUB, j_CC // SUB
  N_diag = jnp.where(blk_row == blk_col, N_CC, 0.0)
  D_inv = eye
  for r in range(1, SUB):
    D_inv = jnp.where(i_CC % SUB == r, eye - dot(N_diag, D_inv), D_inv)
  N_off = N_CC - N_diag
  T = D_inv
  for a in range(1, C // SUB):
    T = jnp.where(blk_row == a, dot(D_inv, eye - dot(N_off, T)), T)
  return T


def _intra_kernel(q_ref, k_ref, v_ref, G_ref, beta_ref, segc_ref, segr_ref,
                  W_ref, U0_ref, Qg_ref, Kd_ref, Aqk_ref, *, scale):
  q, k, v, G = (r[...].astype(F32) for r in (q_ref, k_ref, v_ref, G_ref))
  beta_C1 = beta_ref[...].astype(F32)
  strict, causal, from_start, to_end = chunk_masks(segc_ref[...], segr_ref[...])
  A, Aqk = tiles(q, k, G, strict, causal, scale)
  T = unit_lower_inverse(beta_C1 * A)
  gamma, E = gate_factors(G, from_start, to_end)
  W_ref[...] = dot(T, beta_C1 * k * gamma).astype(W_ref.dtype)
  U0_ref[...] = dot(T, beta_C1 * v).astype(U0_ref.dtype)
  Qg_ref[...] = (q * gamma * scale).astype(Qg_ref.dtype)
  Kd_ref[...] = (k * E).astype(Kd_ref.dtype)
  Aqk_ref[...] = Aqk.astype(Aqk_ref.dtype)


def _tiles_bwd(q, k, G, dA, dAqk):
  """(dq, dk, dG) of the anchored tiles (A = masked kl·krᵀ per row tile, likewise Aqk); dA,
  dAqk arrive masked and scaled. For a tile (X·left)(Y·right)ᵀ with cotangent D:
  d(X·left) = D (Y·right), d(Y·right) = Dᵀ (X·left); e^{G_i - m} gives +, e^{m - G_j} gives
  − to dG; the anchor m carries none (the product does not depend on it)."""
  C = q.shape[0]
  dq_rows, dk_rows, dG_rows = [], [], []
  dk, dG = jnp.zeros_like(k), jnp.zeros_like(G)
  for a in range(C // SUB):
    left, right = _anchored(G, a)
    rows = slice(a * SUB, (a + 1) * SUB)
    kl, ql, kr = k[rows] * left, q[rows] * left, k * right
    dA_a, dAqk_a = dA[rows], dAqk[rows]
    d_kl, d_ql = dot(dA_a, kr), dot(dAqk_a, kr)
    d_kr = t_dot(dA_a, kl) + t_dot(dAqk_a, ql)
    dq_rows.append(d_ql * left)
    dk_rows.append(d_kl * left)
    dG_rows.append(d_kl * kl + d_ql * ql)
    dk = dk + d_kr * right
    dG = dG - d_kr * kr
  cat = lambda xs: jnp.concatenate(xs, axis=0)
  return cat(dq_rows), dk + cat(dk_rows), dG + cat(dG_rows)


def _intra_bwd_kernel(q_ref, k_ref, v_ref, G_ref, beta_ref, segc_ref, segr_ref,
                      dW_ref, dU0_ref, dQg_ref, dKd_ref, dAqk_ref,
                      dq_ref, dk_ref, dv_ref, dG_ref, dbeta_ref, *, scale):
  C = q_ref.shape[0]
  q, k, v, G = (r[...].astype(F32) for r in (q_ref, k_ref, v_ref, G_ref))
  beta_C1 = beta_ref[...].astype(F32)
  dW, dU0, dQg, dKd, dAqk = (r[...].astype(F32)
                             for r in (dW_ref, dU0_ref, dQg_ref, dKd_ref, dAqk_ref))
  strict, causal, from_start, to_end = chunk_masks(segc_ref[...], segr_ref[...])
  A, _ = tiles(q, k, G, strict, causal, scale)
  T = unit_lower_inverse(beta_C1 * A)
  gamma, E = gate_factors(G, from_start, to_end)
  X, Y = beta_C1 * k * gamma, beta_C1 * v                 # W = T X, U0 = T Y

  dT = dot_t(dW, X) + dot_t(dU0, Y)
  dL = -t_dot(T, dot_t(dT, T))                            # L = I + βA, T = L^-1
  dA = jnp.where(strict, beta_C1 * dL, 0.0)
  dX, dY = t_dot(T, dW), t_dot(T, dU0)
  dbeta = (jnp.sum(dL * A, axis=1, keepdims=True) + jnp.sum(dX * k * gamma, axis=1, keepdims=True)
           + jnp.sum(dY * v, axis=1, keepdims=True))
  dv = beta_C1 * dY
  dq = dQg * scale * gamma                                # Qg = scale q Γ
  dk = dX * beta_C1 * gamma + dKd * E                     # Kd = k E
  P = dKd * k * E                                         # ∂/∂G of Kd: -P, and +Σ P at G_end
  dG = dX * X + dQg * scale * q * gamma - P
  last_C1 = _iota((C, 1), 0) == C - 1
  dG = dG + jnp.where(last_C1, jnp.sum(P, axis=0, keepdims=True), 0.0)
  dq_t, dk_t, dG_t = _tiles_bwd(q, k, G, dA, jnp.where(causal, dAqk, 0.0) * scale)
  dq, dk, dG = dq + dq_t, dk + dk_t, dG + dG_t
  for ref, x in ((dq_ref, dq), (dk_ref, dk), (dv_ref, dv), (dG_ref, dG), (dbeta_ref, dbeta)):
    ref[...] = x.astype(ref.dtype)


def _chunk(C, D):
  """[C, D] tile of chunk n of a head-major [B, H, Tp, D] array, grid (B, H, N)."""
  return pl.BlockSpec((None, None, C, D), lambda b, h, n: (b, h, n, 0))


def _seg_specs(C):
  """Chunk n's segment index as a [C, 1] column ([B, Tp, 1]) and a [1, C] row ([B, N, 1, C])."""
  return [pl.BlockSpec((None, C, 1), lambda b, h, n: (b, n, 0)),
          pl.BlockSpec((None, None, 1, C), lambda b, h, n: (b, n, 0, 0))]


def _seg_views(seg_BxTp, C):
  B, Tp = seg_BxTp.shape
  return seg_BxTp[..., None], seg_BxTp.reshape(B, Tp // C, 1, C)


def _compiler_params(interpret):
  return None if interpret else pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "parallel"))


def intra_call(q, k, v, G, beta, seg, *, scale, chunk_size, interpret):
  """(W, U0, Qg, Kd in q's dtype, Aqk) of every chunk; inputs head-major, β [B,H,Tp,1]."""
  B, H, Tp, K = q.shape
  V = v.shape[-1]
  C, dt = chunk_size, q.dtype
  rows = lambda D, dtype=dt: jax.ShapeDtypeStruct((B, H, Tp, D), dtype)
  return pl.pallas_call(
      lambda *refs: _intra_kernel(*refs, scale=scale),
      grid=(B, H, Tp // C),
      in_specs=[_chunk(C, K), _chunk(C, K), _chunk(C, V), _chunk(C, K), _chunk(C, 1),
                *_seg_specs(C)],
      out_specs=[_chunk(C, K), _chunk(C, V), _chunk(C, K), _chunk(C, K), _chunk(C, C)],
      out_shape=[rows(K), rows(V), rows(K), rows(K), rows(C)],
      interpret=interpret, compiler_params=_compiler_params(interpret),
      name="kda_tpu_intra",
  )(q, k, v, G, beta, *_seg_views(seg, C))


def intra_bwd_call(q, k, v, G, beta, seg, d_st, *, scale, chunk_size, interpret):
  """(dq, dk, dv, dG, dβ) fp32 from the cotangents of intra_call's outputs."""
  B, H, Tp, K = q.shape
  V = v.shape[-1]
  C = chunk_size
  rows = lambda D: jax.ShapeDtypeStruct((B, H, Tp, D), F32)
  return pl.pallas_call(
      lambda *refs: _intra_bwd_kernel(*refs, scale=scale),
      grid=(B, H, Tp // C),
      in_specs=[_chunk(C, K), _chunk(C, K), _chunk(C, V), _chunk(C, K), _chunk(C, 1),
                *_seg_specs(C), _chunk(C, K), _chunk(C, V), _chunk(C, K), _chunk(C, K),
                _chunk(C, C)],
      out_specs=[_chunk(C, K), _chunk(C, K), _chunk(C, V), _chunk(C, K), _chunk(C, 1)],
      out_shape=[rows(K), rows(K), rows(V), rows(K), rows(1)],
      interpret=interpret, compiler_params=_compiler_params(interpret),
      name="kda_tpu_intra_bwd",
  )(q, k, v, G, beta, *_seg_views(seg, C), d_st["W"], d_st["U0"], d_st["Qg"], d_st["Kd"],
    d_st["Aqk"])
