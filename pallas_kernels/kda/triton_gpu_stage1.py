"""Stage 1 of implementation="triton" at chunk 64: its forward as one Triton kernel a chunk
(_kda_stage1_triton), and the unbounded gates' backward (intra_bwd_unbounded).

triton_gpu.intra_triton runs stage 1 as three launches: the tiles kernel writes A (fp32)
and Aqk, pallas_gpu's solve reads A and writes T = (I + Diag(β)A)^-1 (fp32), and the W/U
kernel reads T, q, k, v and G again. At 8×4096×32 (K = V = 128, H200) those took 0.79 +
0.24 + 0.88 ms of a 2.84 ms forward (benchmarks/kda.md). One program here owns a whole
64-row chunk, as FlashKDA's token-parallel K1 and fla's inter_solve_fused do, and keeps
the chunk's 4×4 grid of [16, 16] blocks in registers:

  1. A and Aqk block by block over K: a diagonal block on decays anchored at its middle
     row (both factors ≤ e^40 at the gate's bound; unbounded gates: column by column, or
     as [16, 16, 8] products (UNBOUNDED_DIAGONAL), every factor ≤ 1), an off-diagonal
     block (a, c < a) at the first row of a (both factors ≤ 1: e^{G_r - G_a0} and
     e^{G_a0 - G_j}).
  2. The solve in registers: each diagonal block (I + N)^-1 = (I - N)(I + N²)(I + N⁴)(I + N⁸)
     for the strictly lower N = Diag(β)A_aa (N^16 = 0): six dependent [16, 16] dots, where
     row-by-row substitution takes fifteen steps (the reason a solve fused into the W/U
     kernel was slower, kda.md); then the blocks below the diagonal as fla merges them,
     T_ab = -T_aa Σ_{b≤c<a} N_ac T_cb.
  3. W = T·Diag(β)(K⊙Γ), U0 = T·Diag(β)V block row by block row, Qg, Kd and the chunk's
     decay, as the W/U kernel computes them.

A and T leave the kernel only as the backward's residuals (RESIDUALS); the forward without
a backward writes neither. Other chunk sizes take triton_gpu's three kernels, and so do
bounded gates by default (STAGE1_FUSED below: the three are faster there)."""

import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels import triton_launch
from pallas_kernels.kda import pallas_gpu, triton_gpu
from pallas_kernels.kda.triton_gpu import chunk_rows, fp32_sum

F32 = jnp.float32
CHUNK = 64            # the one chunk size this kernel is written for (4 sub-chunks of 16)

# Launch knobs (benchmarks/kda.md). Built for sm_90a in bf16 at K = V = 64 and 128, 4 warps
# with 16-column tiles steps and 32-column W/U steps take 247-249 registers and spill
# nothing; 32-column tiles steps spill 68-168 bytes a thread, 64-column W/U steps 8 at
# K = 64, and one loop for all four block rows 300-1000. The unbounded gates' build spills
# 4-8 bytes a thread at 4 warps (UNBOUNDED_DIAGONAL below; column by column 56), 52-64 at
# 8 warps, whose forward is 1.55x slower.
# Bounded gates: triton_gpu's three kernels, 1.35-1.52x faster forward on an H100 (this
# kernel's long dependent chain of [16, 16] dots runs at 12.5% occupancy, 252 registers).
# Unbounded gates: this kernel, 1.28x faster forward than pallas_gpu's three (its
# diagonal tiles elementwise) at 1x8192x32. benchmarks/kda.md, 2026-12-07.
STAGE1_FUSED = False            # bounded gates: stage 1 as this kernel at chunk 64
STAGE1_FUSED_UNBOUNDED = True   # unbounded gates: likewise
UNBOUNDED_WU_BWD = True         # unbounded gates' backward: triton_gpu's W/U backward (its
                                # factors are all ≤ 1, safe for any gate) before pallas_gpu's
                                # unbounded tiles backward; else pallas_gpu's whole backward
                                # (1x8192x32 fwd+bwd 9.79 against 10.05 ms on an H100, kda.md)
UNBOUNDED_DIAGONAL = "products"  # unbounded gates' diagonal blocks in the fused kernel:
                                 # [16, 16, 8] products in a K loop of their own after each
                                 # block row's ("products": 4-8 bytes a thread spilled), or
                                 # a loop over their 16 columns inside it ("columns": 56);
                                 # 1x8192x32 fwd 2.34 against 2.48 ms, fwd+bwd 9.38 against
                                 # 9.80 on an H100 (kda.md, 2026-12-08)
STAGE1_BLOCK_K = 16       # K columns per step of the tiles loops
STAGE1_WU_BLOCK = 32      # K / V columns per step of the W/U loops
STAGE1_WARPS = 4
STAGE1_STAGES = 2         # column blocks in flight in each loop
STAGE1_SOLVE_PREC = "ieee"  # the [16, 16] solve dots: fp32 FMA (tf32 would round T to 10 bits)


@triton.jit
def _rows(x, row0, r, col, Tp: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
          BD: tl.constexpr):
  """Sub-chunk r's 16 rows, columns col … col + BD, of a [B, Tp, H, D] array as fp32."""
  return tl.load(chunk_rows(x, row0, r, col, Tp, H, D, 16, BD)).to(tl.float32)


@triton.jit
def _gate_row(G, row0, t, col, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
  """Row t, columns col … col + BK, of a [B, Tp, H, K] array as [BK] fp32: an anchor row of
  G, or one row of k or G in the unbounded diagonal's column loop."""
  return tl.load(G + (row0 + t * H) * K + col + tl.arange(0, BK)).to(tl.float32)


@triton.jit
def _diagonal(q_a, k_a, G_a, mid_K, A_aa, Aqk_aa, PREC: tl.constexpr):
  """Block (a, a) of A and Aqk, one BK column block, anchored at a's middle row."""
  left = tl.exp(G_a - mid_K[None, :])
  right_t = tl.trans(k_a * tl.exp(mid_K[None, :] - G_a))
  A_aa = tl.dot(k_a * left, right_t, acc=A_aa, input_precision=PREC)
  Aqk_aa = tl.dot(q_a * left, right_t, acc=Aqk_aa, input_precision=PREC)
  return A_aa, Aqk_aa


@triton.jit
def _diagonal_columns(q_a, k_a, G_a, k, G, row0, t, col, A_aa, Aqk_aa, H: tl.constexpr,
                      K: tl.constexpr, BK: tl.constexpr):
  """Block (a, a) column by column for unbounded gates (t = a's first row): column j is
  Σ_k k_i k_j e^{G_i - G_j} over rows i ≥ j, every factor ≤ 1 whatever the gate, summed in
  fp32 (pallas_gpu's _diagonal_columns)."""
  i_L = tl.arange(0, 16)
  for j in tl.range(0, 16):
    k_j = _gate_row(k, row0, t + j, col, H, K, BK)
    G_j = _gate_row(G, row0, t + j, col, H, K, BK)
    seen = (i_L >= j)[:, None]
    e = tl.where(seen, tl.exp(tl.where(seen, G_a - G_j[None, :], 0.0)), 0.0) * k_j[None, :]
    at_j = (i_L == j)[None, :]
    A_aa += tl.where(at_j, fp32_sum(k_a * e, 1)[:, None], 0.0)
    Aqk_aa += tl.where(at_j, fp32_sum(q_a * e, 1)[:, None], 0.0)
  return A_aa, Aqk_aa


@triton.jit
def _diagonal_products(q_a, k_a, G_a, A_aa, Aqk_aa):
  """Block (a, a) for unbounded gates, one BD column block: A_ij = Σ_k k_ik k_jk e^{G_ik - G_jk}
  over rows i ≥ j as one [16, 16, BD] product, every factor ≤ 1 whatever the gate, summed in
  fp32 (the columns of _diagonal_columns at once, without reloading a's rows)."""
  i_L = tl.arange(0, 16)
  seen = (i_L[:, None] >= i_L[None, :])[:, :, None]
  e = tl.where(seen, tl.exp(tl.where(seen, G_a[:, None, :] - G_a[None, :, :], 0.0)), 0.0)
  e = e * k_a[None, :, :]
  return (A_aa + fp32_sum(k_a[:, None, :] * e, 2), Aqk_aa + fp32_sum(q_a[:, None, :] * e, 2))


@triton.jit
def _diagonal_block(q_a, k_a, G_a, k, G, row0, t, col, A_aa, Aqk_aa, H: tl.constexpr,
                    K: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                    DIAG: tl.constexpr):
  """Block (a, a) of A and Aqk, one BK column block (t = a's first row): two dots on decays
  anchored at a's middle row ("anchored": bounded gates), or column by column ("columns");
  "products" leaves it to _diagonal_row, after the block row's loop."""
  if DIAG == "anchored":
    return _diagonal(q_a, k_a, G_a, _gate_row(G, row0, t + 8, col, H, K, BK), A_aa, Aqk_aa,
                     PREC)
  elif DIAG == "columns":
    return _diagonal_columns(q_a, k_a, G_a, k, G, row0, t, col, A_aa, Aqk_aa, H, K, BK)
  else:
    return A_aa, Aqk_aa


@triton.jit
def _diagonal_row(q, k, G, row0, r, Tp: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                  NUM_STAGES: tl.constexpr):
  """Block (r, r) of A and Aqk for unbounded gates ("products"), over all of K in a loop of
  its own, 8 columns a step: [16, 16, 16] products beside a block row's other accumulators
  spill registers (20-24 bytes a thread at 4 warps against 4-8 so)."""
  BD: tl.constexpr = 8
  z = tl.full((16, 16), 0.0, tl.float32)
  A_rr, Q_rr = z, z
  for ik in tl.range(0, K // BD, num_stages=NUM_STAGES):
    col = ik * BD
    A_rr, Q_rr = _diagonal_products(_rows(q, row0, r, col, Tp, H, K, BD),
                                   _rows(k, row0, r, col, Tp, H, K, BD),
                                   _rows(G, row0, r, col, Tp, H, K, BD), A_rr, Q_rr)
  return A_rr, Q_rr


@triton.jit
def _below(kl_a, ql_a, first_K, k_c, G_c, A_ac, Aqk_ac, PREC: tl.constexpr):
  """Block (a, c < a), one BK column block: kl_a, ql_a are a's rows decayed to a's first
  row (first_K), k_c decayed from that row back to its own (both factors ≤ 1)."""
  right_t = tl.trans(k_c * tl.exp(first_K[None, :] - G_c))
  A_ac = tl.dot(kl_a, right_t, acc=A_ac, input_precision=PREC)
  Aqk_ac = tl.dot(ql_a, right_t, acc=Aqk_ac, input_precision=PREC)
  return A_ac, Aqk_ac


@triton.jit
def _row_operands(q, k, G, row0, r, t, col, Tp: tl.constexpr, H: tl.constexpr,
                  K: tl.constexpr, BK: tl.constexpr):
  """Block row r's q, k, G [16, BK] and its first row's G [BK] (t = that row)."""
  return (_rows(q, row0, r, col, Tp, H, K, BK), _rows(k, row0, r, col, Tp, H, K, BK),
          _rows(G, row0, r, col, Tp, H, K, BK), _gate_row(G, row0, t, col, H, K, BK))


@triton.jit
def _row0(q, k, G, row0, r0, t0, Tp: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
          BK: tl.constexpr, PREC: tl.constexpr, DIAG: tl.constexpr,
          NUM_STAGES: tl.constexpr):
  """Block (0, 0) of A and Aqk."""
  if DIAG == "products":
    return _diagonal_row(q, k, G, row0, r0, Tp, H, K, NUM_STAGES)
  z = tl.full((16, 16), 0.0, tl.float32)
  A00, Q00 = z, z
  for ik in tl.range(0, K // BK, num_stages=NUM_STAGES):
    col = ik * BK
    q0, k0, G0, _ = _row_operands(q, k, G, row0, r0, t0, col, Tp, H, K, BK)
    A00, Q00 = _diagonal_block(q0, k0, G0, k, G, row0, t0, col, A00, Q00, H, K,
                               BK, PREC, DIAG)
  return A00, Q00


@triton.jit
def _row1(q, k, G, row0, r0, t0, Tp: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
          BK: tl.constexpr, PREC: tl.constexpr, DIAG: tl.constexpr,
          NUM_STAGES: tl.constexpr):
  """Blocks (1, 0) and (1, 1) of A and Aqk."""
  z = tl.full((16, 16), 0.0, tl.float32)
  A10, Q10, A11, Q11 = z, z, z, z
  for ik in tl.range(0, K // BK, num_stages=NUM_STAGES):
    col = ik * BK
    q1, k1, G1, f1 = _row_operands(q, k, G, row0, r0 + 1, t0 + 16, col, Tp, H, K, BK)
    A11, Q11 = _diagonal_block(q1, k1, G1, k, G, row0, t0 + 16, col, A11, Q11, H, K,
                               BK, PREC, DIAG)
    left = tl.exp(G1 - f1[None, :])
    A10, Q10 = _below(k1 * left, q1 * left, f1, _rows(k, row0, r0, col, Tp, H, K, BK),
                      _rows(G, row0, r0, col, Tp, H, K, BK), A10, Q10, PREC)
  if DIAG == "products":
    A11, Q11 = _diagonal_row(q, k, G, row0, r0 + 1, Tp, H, K, NUM_STAGES)
  return A10, Q10, A11, Q11


@triton.jit
def _row2(q, k, G, row0, r0, t0, Tp: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
          BK: tl.constexpr, PREC: tl.constexpr, DIAG: tl.constexpr,
          NUM_STAGES: tl.constexpr):
  """Blocks (2, 0), (2, 1), (2, 2) of A and Aqk."""
  z = tl.full((16, 16), 0.0, tl.float32)
  A20, Q20, A21, Q21, A22, Q22 = z, z, z, z, z, z
  for ik in tl.range(0, K // BK, num_stages=NUM_STAGES):
    col = ik * BK
    q2, k2, G2, f2 = _row_operands(q, k, G, row0, r0 + 2, t0 + 32, col, Tp, H, K, BK)
    A22, Q22 = _diagonal_block(q2, k2, G2, k, G, row0, t0 + 32, col, A22, Q22, H, K,
                               BK, PREC, DIAG)
    left = tl.exp(G2 - f2[None, :])
    kl, ql = k2 * left, q2 * left
    A20, Q20 = _below(kl, ql, f2, _rows(k, row0, r0, col, Tp, H, K, BK),
                      _rows(G, row0, r0, col, Tp, H, K, BK), A20, Q20, PREC)
    A21, Q21 = _below(kl, ql, f2, _rows(k, row0, r0 + 1, col, Tp, H, K, BK),
                      _rows(G, row0, r0 + 1, col, Tp, H, K, BK), A21, Q21, PREC)
  if DIAG == "products":
    A22, Q22 = _diagonal_row(q, k, G, row0, r0 + 2, Tp, H, K, NUM_STAGES)
  return A20, Q20, A21, Q21, A22, Q22


@triton.jit
def _row3(q, k, G, row0, r0, t0, Tp: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
          BK: tl.constexpr, PREC: tl.constexpr, DIAG: tl.constexpr,
          NUM_STAGES: tl.constexpr):
  """Blocks (3, 0) … (3, 3) of A and Aqk."""
  z = tl.full((16, 16), 0.0, tl.float32)
  A30, Q30, A31, Q31, A32, Q32, A33, Q33 = z, z, z, z, z, z, z, z
  for ik in tl.range(0, K // BK, num_stages=NUM_STAGES):
    col = ik * BK
    q3, k3, G3, f3 = _row_operands(q, k, G, row0, r0 + 3, t0 + 48, col, Tp, H, K, BK)
    A33, Q33 = _diagonal_block(q3, k3, G3, k, G, row0, t0 + 48, col, A33, Q33, H, K,
                               BK, PREC, DIAG)
    left = tl.exp(G3 - f3[None, :])
    kl, ql = k3 * left, q3 * left
    A30, Q30 = _below(kl, ql, f3, _rows(k, row0, r0, col, Tp, H, K, BK),
                      _rows(G, row0, r0, col, Tp, H, K, BK), A30, Q30, PREC)
    A31, Q31 = _below(kl, ql, f3, _rows(k, row0, r0 + 1, col, Tp, H, K, BK),
                      _rows(G, row0, r0 + 1, col, Tp, H, K, BK), A31, Q31, PREC)
    A32, Q32 = _below(kl, ql, f3, _rows(k, row0, r0 + 2, col, Tp, H, K, BK),
                      _rows(G, row0, r0 + 2, col, Tp, H, K, BK), A32, Q32, PREC)
  if DIAG == "products":
    A33, Q33 = _diagonal_row(q, k, G, row0, r0 + 3, Tp, H, K, NUM_STAGES)
  return A30, Q30, A31, Q31, A32, Q32, A33, Q33



@triton.jit
def _store_block(x, row0, r, c, val, Tp: tl.constexpr, H: tl.constexpr, C: tl.constexpr):
  """Block (r's 16 rows, columns c·16 …) of a [B, Tp, H, C] array, in its dtype."""
  tl.store(chunk_rows(x, row0, r, c * 16, Tp, H, C, 16, 16), val.to(x.dtype.element_ty))


@triton.jit
def _store_lower(x, row0, r0, X00, X10, X11, X20, X21, X22, X30, X31, X32, X33,
                 Tp: tl.constexpr, H: tl.constexpr):
  """A chunk's [64, 64] block lower-triangular matrix (zeros above) into rows r0 … r0 + 3
  (sub-chunks) of a [B, Tp, H, 64] array."""
  z = tl.full((16, 16), 0.0, tl.float32)
  _store_block(x, row0, r0, 0, X00, Tp, H, 64)
  for c in tl.static_range(1, 4):
    _store_block(x, row0, r0, c, z, Tp, H, 64)
  _store_block(x, row0, r0 + 1, 0, X10, Tp, H, 64)
  _store_block(x, row0, r0 + 1, 1, X11, Tp, H, 64)
  _store_block(x, row0, r0 + 1, 2, z, Tp, H, 64)
  _store_block(x, row0, r0 + 1, 3, z, Tp, H, 64)
  _store_block(x, row0, r0 + 2, 0, X20, Tp, H, 64)
  _store_block(x, row0, r0 + 2, 1, X21, Tp, H, 64)
  _store_block(x, row0, r0 + 2, 2, X22, Tp, H, 64)
  _store_block(x, row0, r0 + 2, 3, z, Tp, H, 64)
  _store_block(x, row0, r0 + 3, 0, X30, Tp, H, 64)
  _store_block(x, row0, r0 + 3, 1, X31, Tp, H, 64)
  _store_block(x, row0, r0 + 3, 2, X32, Tp, H, 64)
  _store_block(x, row0, r0 + 3, 3, X33, Tp, H, 64)


@triton.jit
def _inverse(N, eye, PREC: tl.constexpr):
  """(I + N)^-1 for a strictly lower-triangular [16, 16] N: Σ_{j<16} (-N)^j as
  (I + M)(I + M²)(I + M⁴)(I + M⁸), M = -N."""
  M = -N
  X = eye + M
  M = tl.dot(M, M, input_precision=PREC)
  X = tl.dot(X, M, acc=X, input_precision=PREC)
  M = tl.dot(M, M, input_precision=PREC)
  X = tl.dot(X, M, acc=X, input_precision=PREC)
  M = tl.dot(M, M, input_precision=PREC)
  return tl.dot(X, M, acc=X, input_precision=PREC)


@triton.jit
def _block_rows(out, row0, r0, col, T00, T10, T11, T20, T21, T22, T30, T31, T32, T33,
                X0, X1, X2, X3, Tp: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                BD: tl.constexpr, PREC: tl.constexpr):
  """out's four block rows T·X (T block lower-triangular), columns col … col + BD."""
  dt = out.dtype.element_ty
  tl.store(chunk_rows(out, row0, r0, col, Tp, H, D, 16, BD),
           tl.dot(T00, X0, input_precision=PREC).to(dt))
  acc = tl.dot(T10, X0, input_precision=PREC)
  tl.store(chunk_rows(out, row0, r0 + 1, col, Tp, H, D, 16, BD),
           tl.dot(T11, X1, acc=acc, input_precision=PREC).to(dt))
  acc = tl.dot(T21, X1, acc=tl.dot(T20, X0, input_precision=PREC), input_precision=PREC)
  tl.store(chunk_rows(out, row0, r0 + 2, col, Tp, H, D, 16, BD),
           tl.dot(T22, X2, acc=acc, input_precision=PREC).to(dt))
  acc = tl.dot(T31, X1, acc=tl.dot(T30, X0, input_precision=PREC), input_precision=PREC)
  acc = tl.dot(T32, X2, acc=acc, input_precision=PREC)
  tl.store(chunk_rows(out, row0, r0 + 3, col, Tp, H, D, 16, BD),
           tl.dot(T33, X3, acc=acc, input_precision=PREC).to(dt))


@triton.jit
def _decayed(q, k, G, seg_a, seg_end, G_end_K, row0, r, col, SCALE: tl.constexpr,
             Tp: tl.constexpr, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
  """Sub-chunk r's k [16, BK], Qg = q·Γ·scale, Kd = k·e^{G_end - G} (triton_gpu._chunk_gates'
  masks: Γ = e^G on rows the chunk's start state reaches, e^{G_end - G} on rows that reach
  its end) and Γ."""
  G_a = _rows(G, row0, r, col, Tp, H, K, BK)
  k_a = _rows(k, row0, r, col, Tp, H, K, BK)
  gamma = tl.where((seg_a == 0)[:, None], tl.exp(G_a), 0.0)
  to_end = tl.where((seg_a == seg_end)[:, None], tl.exp(G_end_K[None, :] - G_a), 0.0)
  Qg = _rows(q, row0, r, col, Tp, H, K, BK) * gamma * SCALE
  return k_a, Qg, k_a * to_end, gamma


@triton.jit
def _kda_stage1_triton(q, k, v, G, beta, seg, W, U0, Qg, Kd, decay, Aqk, A, T,
                       Tp: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BK: tl.constexpr, BW: tl.constexpr, SCALE: tl.constexpr,
                       PREC: tl.constexpr, SOLVE: tl.constexpr, LOW_DOTS: tl.constexpr,
                       RESIDUALS: tl.constexpr, DIAG: tl.constexpr,
                       NUM_STAGES: tl.constexpr):
  """One 64-row chunk (program id 0) of one (b, h) (id 1): the W/U kernel's outputs (W, U0,
  Qg, Kd in q's dtype, decay [B, N, H, K] fp32), Aqk (causal, scaled, q's dtype) and, with
  RESIDUALS, A (strictly causal, fp32, without β) and T (fp32), as triton_gpu.intra_triton
  returns them. DIAG: the diagonal blocks' form (_diagonal_block). q, k, G [B, Tp, H, K];
  v [B, Tp, H, V]; beta [B, Tp, H] fp32; seg [B, Tp]."""
  n, b, h, row0, r0, t0, seg0, seg1, seg2, seg3, seg_end = _chunk(seg, Tp, H)
  i_L = tl.arange(0, 16)

  # 1. A and Aqk, one block row at a time (its blocks' accumulators alone are live), K in
  # BK-wide column blocks.
  A00, Q00 = _row0(q, k, G, row0, r0, t0, Tp, H, K, BK, PREC, DIAG, NUM_STAGES)
  A10, Q10, A11, Q11 = _row1(q, k, G, row0, r0, t0, Tp, H, K, BK, PREC, DIAG,
                              NUM_STAGES)
  A20, Q20, A21, Q21, A22, Q22 = _row2(q, k, G, row0, r0, t0, Tp, H, K, BK, PREC, DIAG,
                                        NUM_STAGES)
  A30, Q30, A31, Q31, A32, Q32, A33, Q33 = _row3(q, k, G, row0, r0, t0, Tp, H, K, BK, PREC,
                                                 DIAG, NUM_STAGES)

  # Masks: one segment, strictly causal for A, causal for Aqk; then Aqk's blocks (zeros
  # above the diagonal) and A's.
  lower = i_L[:, None] > i_L[None, :]
  A00 = tl.where((seg0[:, None] == seg0[None, :]) & lower, A00, 0.0)
  A11 = tl.where((seg1[:, None] == seg1[None, :]) & lower, A11, 0.0)
  A22 = tl.where((seg2[:, None] == seg2[None, :]) & lower, A22, 0.0)
  A33 = tl.where((seg3[:, None] == seg3[None, :]) & lower, A33, 0.0)
  A10 = tl.where(seg1[:, None] == seg0[None, :], A10, 0.0)
  A20 = tl.where(seg2[:, None] == seg0[None, :], A20, 0.0)
  A21 = tl.where(seg2[:, None] == seg1[None, :], A21, 0.0)
  A30 = tl.where(seg3[:, None] == seg0[None, :], A30, 0.0)
  A31 = tl.where(seg3[:, None] == seg1[None, :], A31, 0.0)
  A32 = tl.where(seg3[:, None] == seg2[None, :], A32, 0.0)
  causal = i_L[:, None] >= i_L[None, :]
  _store_lower(Aqk, row0, r0,
               tl.where((seg0[:, None] == seg0[None, :]) & causal, Q00 * SCALE, 0.0),
               tl.where(seg1[:, None] == seg0[None, :], Q10 * SCALE, 0.0),
               tl.where((seg1[:, None] == seg1[None, :]) & causal, Q11 * SCALE, 0.0),
               tl.where(seg2[:, None] == seg0[None, :], Q20 * SCALE, 0.0),
               tl.where(seg2[:, None] == seg1[None, :], Q21 * SCALE, 0.0),
               tl.where((seg2[:, None] == seg2[None, :]) & causal, Q22 * SCALE, 0.0),
               tl.where(seg3[:, None] == seg0[None, :], Q30 * SCALE, 0.0),
               tl.where(seg3[:, None] == seg1[None, :], Q31 * SCALE, 0.0),
               tl.where(seg3[:, None] == seg2[None, :], Q32 * SCALE, 0.0),
               tl.where((seg3[:, None] == seg3[None, :]) & causal, Q33 * SCALE, 0.0), Tp, H)
  if RESIDUALS:
    _store_lower(A, row0, r0, A00, A10, A11, A20, A21, A22, A30, A31, A32, A33, Tp, H)

  # 2. T = (I + Diag(β)A)^-1; 3. W, U0, Qg, Kd, decay.
  T00, T10, T11, T20, T21, T22, T30, T31, T32, T33 = _solve(
      beta, b, h, t0, A00, A10, A11, A20, A21, A22, A30, A31, A32, A33, Tp, H, SOLVE)
  if RESIDUALS:
    _store_lower(T, row0, r0, T00, T10, T11, T20, T21, T22, T30, T31, T32, T33, Tp, H)
  _wu(q, k, v, G, beta, W, U0, Qg, Kd, decay, b, h, n, row0, seg0, seg1, seg2, seg3, seg_end,
      T00, T10, T11, T20, T21, T22, T30, T31, T32, T33, Tp, H, K, V, BW, SCALE, PREC, LOW_DOTS,
      NUM_STAGES)


@triton.jit
def _chunk(seg, Tp: tl.constexpr, H: tl.constexpr):
  """A one-chunk program's chunk n (program id 0), b, h (id 1 is b·H + h), row0 =
  b·Tp·H + h, first sub-chunk r0 and row t0, its sub-chunks' segment ids [16] and its last
  row's."""
  n = tl.program_id(0)
  bh = tl.program_id(1).to(tl.int64)
  b, h = bh // H, bh % H
  t0 = n * 64
  rows = seg + b * Tp + t0 + tl.arange(0, 16)
  return (n, b, h, b * Tp * H + h, n * 4, t0, tl.load(rows), tl.load(rows + 16),
          tl.load(rows + 32), tl.load(rows + 48), tl.load(seg + b * Tp + t0 + 63))


@triton.jit
def _betas(beta, b, h, t0, Tp: tl.constexpr, H: tl.constexpr):
  """β of the chunk's four sub-chunks as [16, 1] fp32 columns."""
  i_L = tl.arange(0, 16)
  rows = beta + (b * Tp + t0 + i_L) * H + h
  return (tl.load(rows).to(tl.float32)[:, None], tl.load(rows + 16 * H).to(tl.float32)[:, None],
          tl.load(rows + 32 * H).to(tl.float32)[:, None],
          tl.load(rows + 48 * H).to(tl.float32)[:, None])


@triton.jit
def _solve(beta, b, h, t0, A00, A10, A11, A20, A21, A22, A30, A31, A32, A33,
           Tp: tl.constexpr, H: tl.constexpr, SOLVE: tl.constexpr):
  """T = (I + Diag(β)A)^-1 of one chunk, block by block: the diagonal blocks by _inverse,
  then T_ab = -T_aa Σ_{b≤c<a} N_ac T_cb with N = Diag(β)A, as fla merges them."""
  b0, b1, b2, b3 = _betas(beta, b, h, t0, Tp, H)
  i_L = tl.arange(0, 16)
  eye = tl.where(i_L[:, None] == i_L[None, :], 1.0, 0.0)
  T00 = _inverse(b0 * A00, eye, SOLVE)
  T11 = _inverse(b1 * A11, eye, SOLVE)
  T22 = _inverse(b2 * A22, eye, SOLVE)
  T33 = _inverse(b3 * A33, eye, SOLVE)
  N10, N20, N21 = b1 * A10, b2 * A20, b2 * A21
  N30, N31, N32 = b3 * A30, b3 * A31, b3 * A32
  T10 = -tl.dot(T11, tl.dot(N10, T00, input_precision=SOLVE), input_precision=SOLVE)
  T21 = -tl.dot(T22, tl.dot(N21, T11, input_precision=SOLVE), input_precision=SOLVE)
  T20 = -tl.dot(T22, tl.dot(N21, T10, acc=tl.dot(N20, T00, input_precision=SOLVE),
                            input_precision=SOLVE), input_precision=SOLVE)
  T32 = -tl.dot(T33, tl.dot(N32, T22, input_precision=SOLVE), input_precision=SOLVE)
  acc = tl.dot(N32, T21, acc=tl.dot(N31, T11, input_precision=SOLVE), input_precision=SOLVE)
  T31 = -tl.dot(T33, acc, input_precision=SOLVE)
  acc = tl.dot(N31, T10, acc=tl.dot(N30, T00, input_precision=SOLVE), input_precision=SOLVE)
  T30 = -tl.dot(T33, tl.dot(N32, T20, acc=acc, input_precision=SOLVE), input_precision=SOLVE)
  return T00, T10, T11, T20, T21, T22, T30, T31, T32, T33


@triton.jit
def _wu(q, k, v, G, beta, W, U0, Qg, Kd, decay, b, h, n, row0, seg0, seg1, seg2, seg3, seg_end,
        T00, T10, T11, T20, T21, T22, T30, T31, T32, T33, Tp: tl.constexpr, H: tl.constexpr,
        K: tl.constexpr, V: tl.constexpr, BW: tl.constexpr, SCALE: tl.constexpr,
        PREC: tl.constexpr, LOW_DOTS: tl.constexpr, NUM_STAGES: tl.constexpr):
  """W = T·Diag(β)(K⊙Γ), Qg, Kd and the decay over BW-wide column blocks of K, then
  U0 = T·Diag(β)V over those of V. LOW_DOTS: the dots' operands in q's dtype."""
  N: tl.constexpr = Tp // 64
  r0, t0 = n * 4, n * 64
  b0, b1, b2, b3 = _betas(beta, b, h, t0, Tp, H)
  dot_dt = q.dtype.element_ty if LOW_DOTS else tl.float32
  T00, T11, T22, T33 = T00.to(dot_dt), T11.to(dot_dt), T22.to(dot_dt), T33.to(dot_dt)
  T10, T20, T21 = T10.to(dot_dt), T20.to(dot_dt), T21.to(dot_dt)
  T30, T31, T32 = T30.to(dot_dt), T31.to(dot_dt), T32.to(dot_dt)
  dt = Qg.dtype.element_ty
  for ik in tl.range(0, K // BW, num_stages=NUM_STAGES):
    col = ik * BW
    G_end = _gate_row(G, row0, t0 + 63, col, H, K, BW)
    k0, Qg0, Kd0, g0 = _decayed(q, k, G, seg0, seg_end, G_end, row0, r0, col, SCALE, Tp, H,
                                K, BW)
    k1, Qg1, Kd1, g1 = _decayed(q, k, G, seg1, seg_end, G_end, row0, r0 + 1, col, SCALE, Tp,
                                H, K, BW)
    k2, Qg2, Kd2, g2 = _decayed(q, k, G, seg2, seg_end, G_end, row0, r0 + 2, col, SCALE, Tp,
                                H, K, BW)
    k3, Qg3, Kd3, g3 = _decayed(q, k, G, seg3, seg_end, G_end, row0, r0 + 3, col, SCALE, Tp,
                                H, K, BW)
    tl.store(chunk_rows(Qg, row0, r0, col, Tp, H, K, 16, BW), Qg0.to(dt))
    tl.store(chunk_rows(Qg, row0, r0 + 1, col, Tp, H, K, 16, BW), Qg1.to(dt))
    tl.store(chunk_rows(Qg, row0, r0 + 2, col, Tp, H, K, 16, BW), Qg2.to(dt))
    tl.store(chunk_rows(Qg, row0, r0 + 3, col, Tp, H, K, 16, BW), Qg3.to(dt))
    tl.store(chunk_rows(Kd, row0, r0, col, Tp, H, K, 16, BW), Kd0.to(dt))
    tl.store(chunk_rows(Kd, row0, r0 + 1, col, Tp, H, K, 16, BW), Kd1.to(dt))
    tl.store(chunk_rows(Kd, row0, r0 + 2, col, Tp, H, K, 16, BW), Kd2.to(dt))
    tl.store(chunk_rows(Kd, row0, r0 + 3, col, Tp, H, K, 16, BW), Kd3.to(dt))
    tl.store(decay + ((b * N + n) * H + h) * K + col + tl.arange(0, BW),
             tl.where(seg_end == 0, tl.exp(G_end), 0.0))
    _block_rows(W, row0, r0, col, T00, T10, T11, T20, T21, T22, T30, T31, T32, T33,
                (b0 * k0 * g0).to(dot_dt), (b1 * k1 * g1).to(dot_dt),
                (b2 * k2 * g2).to(dot_dt), (b3 * k3 * g3).to(dot_dt), Tp, H, K, BW, PREC)
  for iv in tl.range(0, V // BW, num_stages=NUM_STAGES):
    col = iv * BW
    _block_rows(U0, row0, r0, col, T00, T10, T11, T20, T21, T22, T30, T31, T32, T33,
                (b0 * _rows(v, row0, r0, col, Tp, H, V, BW)).to(dot_dt),
                (b1 * _rows(v, row0, r0 + 1, col, Tp, H, V, BW)).to(dot_dt),
                (b2 * _rows(v, row0, r0 + 2, col, Tp, H, V, BW)).to(dot_dt),
                (b3 * _rows(v, row0, r0 + 3, col, Tp, H, V, BW)).to(dot_dt), Tp, H, V, BW, PREC)


def stage1_call(q, k, v, G, beta, seg, *, scale, residuals, interpret, bounded=True):
  """(W, U0, Qg, Kd, decay, Aqk, A, T) of chunk 64; A and T are (1,) placeholders without
  residuals. Grid (N, B·H)."""
  if UNBOUNDED_DIAGONAL not in ("columns", "products"):
    raise ValueError("triton_gpu_stage1.UNBOUNDED_DIAGONAL must be 'columns' or 'products', "
                     f"got {UNBOUNDED_DIAGONAL!r}")
  B, Tp, H, K = q.shape
  V = v.shape[-1]
  C, N, dt = CHUNK, Tp // CHUNK, q.dtype
  rows = lambda D, dtype=dt: jax.ShapeDtypeStruct((B, Tp, H, D), dtype)
  res = rows(C, F32) if residuals else jax.ShapeDtypeStruct((1,), F32)
  out_type = [rows(K), rows(V), rows(K), rows(K), jax.ShapeDtypeStruct((B, N, H, K), F32),
              rows(C), res, res]
  meta = dict(Tp=Tp, H=H, K=K, V=V, BK=min(K, STAGE1_BLOCK_K), BW=min(K, V, STAGE1_WU_BLOCK),
              SCALE=float(scale), PREC=triton_launch.fp32_dots(), SOLVE=STAGE1_SOLVE_PREC,
              LOW_DOTS=bool(triton_gpu.WU_LOW_DOTS and dt != F32), RESIDUALS=residuals,
              DIAG="anchored" if bounded else UNBOUNDED_DIAGONAL)
  W, U0, Qg, Kd, decay, Aqk, A, T = triton_launch.launch(
      _kda_stage1_triton, (N, B * H), (q, k, v, G, beta, seg.astype(jnp.int32)), out_type,
      meta, name="kda_stage1_triton", interpret=interpret, warps=STAGE1_WARPS,
      max_stages=STAGE1_STAGES, stages=STAGE1_STAGES)
  return W, U0, Qg, Kd, decay, Aqk, A, T


def intra_fused(q, k, v, G, beta, seg, *, scale, chunk_size, interpret, residuals=True,
                bounded=True):
  """triton_gpu.intra_triton's contract (stage-1 outputs, A, T; A and T None without
  residuals) at chunk 64 from one kernel (STAGE1_FUSED, STAGE1_FUSED_UNBOUNDED), else from
  the three kernels (for unbounded gates, pallas_gpu.intra_pallas's)."""
  fused = STAGE1_FUSED if bounded else STAGE1_FUSED_UNBOUNDED
  if chunk_size == CHUNK and fused:
    W, U0, Qg, Kd, decay, Aqk, A, T = stage1_call(q, k, v, G, beta, seg, scale=scale,
                                                  residuals=residuals, interpret=interpret,
                                                  bounded=bounded)
  else:
    three = (triton_gpu.intra_triton if bounded
             else functools.partial(pallas_gpu.intra_pallas, bounded=False))
    return three(q, k, v, G, beta, seg, scale=scale, chunk_size=chunk_size,
                 interpret=interpret)
  st = {"W": W, "U0": U0, "Qg": Qg, "Kd": Kd, "Aqk": Aqk, "decay": decay}
  return (st, A, T) if residuals else (st, None, None)


def intra_bwd_unbounded(q, k, v, G, beta, seg, A, T, d_st, *, scale, chunk_size, interpret):
  """Stage 1's backward for unbounded gates: with UNBOUNDED_WU_BWD triton_gpu's W/U
  backward before pallas_gpu's unbounded tiles backward (triton_gpu's tiles backward
  anchors its diagonal tiles at their middle rows: bounded gates only), else pallas_gpu's."""
  kw = dict(scale=scale, chunk_size=chunk_size, interpret=interpret)
  if not UNBOUNDED_WU_BWD:
    return pallas_gpu.intra_bwd_pallas(q, k, v, G, beta, seg, A, T, d_st, bounded=False, **kw)
  dA, dq0, dk0, dv, dbeta, dG0 = triton_gpu.wu_bwd_call(T, A, q, k, v, G, beta, seg, d_st, **kw)
  dq1, dk1, dG1 = pallas_gpu.tiles_bwd_call(q, k, G, seg, dA, d_st["Aqk"], bounded=False, **kw)
  return dq0 + dq1, dk0 + dk1, dv, dG0 + dG1, dbeta


# Stage 1 of implementation="triton": this forward, triton_gpu's backward; for unbounded
# gates (pallas_gpu.UNBOUNDED_STAGE1 "pallas"), this forward with its diagonal blocks summed
# with every factor ≤ 1 (UNBOUNDED_DIAGONAL) and intra_bwd_unbounded.
intra = pallas_gpu.intra_with_vjp(intra_fused, triton_gpu.intra_bwd_triton)
intra_unbounded = pallas_gpu.intra_with_vjp(functools.partial(intra_fused, bounded=False),
                                            intra_bwd_unbounded)
