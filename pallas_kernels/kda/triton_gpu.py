"""KDA's chunked kernels in native Triton: implementation="triton".

pallas_gpu's algorithm, kernel for kernel, with the kernels that dominate its time written
as @triton.jit kernels and called through jax_triton, and the prologue (gate, L2 norm, chunk
cumsum) in triton_gpu_prologue.py; stage 1's triangular solve stays Pallas (a Triton form,
substitution in registers, took 3.8x its time on the H200: benchmarks/kda.md).
On the H200 the op runs 1.25-1.32x as fast as pallas_gpu forward+backward on every
benchmark shape (benchmarks/kda.md); it is the GPU default where jax_triton is
installed. Triton pipelines its loops' loads (cp.async, `tl.range(..., num_stages=)`);
Pallas's lowering of a fori_loop does not.

Stage 1 (bounded gates):
  _kda_tiles_triton           grid (Tp/16, B·H): one 16-row sub-chunk's rows of A and Aqk,
                              [16, C] dots against the chunk on decays anchored at the
                              sub-chunk's middle row (pallas_gpu._tiles_kernel, a chunk a
                              program there), K in BK-wide column blocks.
  _kda_tiles_blocks_triton    the same rows tile by tile, only the [16, 16] tiles left of
                              the diagonal, each one dot over all of K (K ≥ 128's choice).
  _kda_wu_triton              grid (N, B·H): W, U0, Qg, Kd and the decay from T (bf16
                              inputs: dots on bf16 operands, as fla's recompute_w_u).
  _kda_wu_bwd_triton          grid (N, B·H): dT over column blocks, then dA (for the tiles
                              backward), dβ and the W/U0/Qg/Kd/decay parts of dq, dk, dG.
  _kda_tiles_bwd_triton       grid (K/BK, Tp/16, B·H): a sub-chunk's dq, dk, dG from the
                              [16, 16] tiles it is the row or the column block of, added to
                              the W/U parts and stored in the outputs' dtypes.
Stage 2:
  _kda_recurrence_triton      grid (V/BV, B·H): the state S [K, BV] stays in registers
                              across all chunks; per chunk U = U0 - W S, O = Qg S + Aqk U,
                              S <- decay * S + Kdᵀ U. Emits O, the final state and, for
                              the backward, each chunk's start state.
  _kda_recurrence_bwd_triton  the same loop in reverse carrying dS: dU0, each chunk's U
                              and the dS at each chunk's end, for the gradient kernel.
  _kda_recurrence_grads_triton  grid (K/BK, N, B·H): one chunk's dQg, dKd, dW, dAqk and
                              d(decay), contracted over V (pallas_gpu's grads kernel).

The kernels are launched by pallas_kernels/triton_launch.py: through jax_triton on a GPU,
Triton's interpreter on host arrays elsewhere (CPU tests). ops.py assembles the op from
these stages and triton_gpu_prologue.py's prologue (PROLOGUE below picks it)."""

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels import triton_launch
from pallas_kernels.kda import pallas_gpu
from pallas_kernels.kda.recurrence_vjp import recurrence_with_vjp

F32 = jnp.float32

# Launch knobs (chosen on the H200 by benchmarks/profile_kda_stages.py --triton; kda.md).
PROLOGUE = True      # the prologue in Triton (triton_gpu_prologue.py), else pallas_gpu_prologue's Pallas
BLOCK_V = 32         # V columns per program (64 was not faster once pipelined)
WARPS = 4
STAGES = 3           # chunks in flight in the recurrence loop, fewer where they do not fit
# Stage 1 (H200, 4×8192×16, benchmarks/profile_kda_stages.py --triton_stage1; benchmarks/kda.md),
# ms at K = V = 64 / 128 against pallas_gpu's kernels:
#   tiles      32 / 2 warps / 2 stages  0.466 / 0.757 (Pallas 0.524 / 0.775; 4 warps 0.56-1.20;
#                                       1 warp since, measured in the op: TILES_WARPS)
#   wu         32 / 4 / 2               0.447 / 0.662 (Pallas 0.711 / 0.940)
#   wu_bwd     32 / 4 / 3               0.984 / 1.684 (Pallas 1.40 / 2.19; 8 warps 1.3-2.5)
#   tiles_bwd  64 / 4 / 2               1.13 / 1.96 (Pallas + XLA's add of the W/U parts
#                                       1.70 / 2.95; 32 columns 1.39 / 2.67)
TILES_BLOCK_K = 32       # K columns per step of the tiles forward (one program a sub-chunk)
TILES_WARPS = 1          # as fla's intra_sub_chunk: 8×4096×32 op forward 3.133 → 2.842 ms,
                         # 4×8192×16 1.606 → 1.461 (H200, kda.md);
                         # 247 registers, no spills
TILES_STAGES = 2
TILES_BY_TILE = None      # _kda_tiles_blocks_triton (only the tiles left of the diagonal,
                          # each one dot over K): None = from K = 128 up, where it measured
                          # faster (H200, 4×8192×16: 0.85 → 0.74 ms; 0.55 → 0.57 at K = 64)
WU_BLOCK = 64            # K / V columns per step of the W/U forward (one program a chunk)
WU_WARPS = 8
WU_STAGES = 2
WU_LOW_DOTS = True       # its dots on bf16 operands for bf16 inputs (T rounded), as fla's
                         # recompute_w_u (K = 128: 0.91 → 0.69 ms, outputs within a bf16 step)
WU_BWD_BLOCK = 32        # ... of the W/U backward
WU_BWD_WARPS = 4
WU_BWD_STAGES = 3
TILES_BWD_BLOCK_K = 64   # K columns per program of the tiles backward
TILES_BWD_WARPS = 4
TILES_BWD_STAGES = 2     # (its loops run ≤ 4 sub-chunks: little to pipeline)
GRADS_BLOCK_K = 64       # K columns per program of stage 2's per-chunk gradient kernel ...
GRADS_BLOCK_V = 32       # ... and V columns per step of its loop
GRADS_WARPS = 8          # (4 warps spill at K = 128: 255 registers)
GRADS_STAGES = 2
PROLOGUE_WARPS = 4       # triton_gpu_prologue's kernels (one program a chunk, no loop); 8 warps
PROLOGUE_BWD_WARPS = 4   # were not faster in the op (kda.md: -4% to +8%)
GATE_ONLY_PROLOGUE = True   # where q̂ = q and k̂ = k (no L2 norm, no padding): the prologue
                            # computes G alone; False copies q and k through it (kda.md)


@triton.jit
def chunk_rows(ptr, row0, n, col, Tp: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                C: tl.constexpr, BD: tl.constexpr):
  """Block pointer to rows n·C … n·C + C and columns col … col + BD of one (b, h) of a
  [B, Tp, H, D] array whose row 0 is at row0 (= b·Tp·H + h)."""
  return tl.make_block_ptr(ptr + row0 * D, (Tp, D), (H * D, 1), (n * C, col), (C, BD), (1, 0))


@triton.jit
def _state_block(ptr, i, ik, iv, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr):
  """Block pointer to rows ik·BK … and columns iv·BV … of the i-th [K, V] fp32 state of an
  array of them."""
  return tl.make_block_ptr(ptr + i * K * V, (K, V), (V, 1), (ik * BK, iv * BV), (BK, BV),
                           (1, 0))


@triton.jit
def _state(ptr, i, iv, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
  """Block pointer to columns iv·BV … of the i-th [K, V] fp32 state of an array of them."""
  return _state_block(ptr, i, 0, iv, K, V, K, BV)


@triton.jit
def _kda_recurrence_triton(W, U0, Qg, Kd, Aqk, decay, S0, O, SN, states,
                           Tp: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                           V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
                           WITH_STATES: tl.constexpr, PREC: tl.constexpr,
                           NUM_STAGES: tl.constexpr):
  """W, Qg, Kd [B, Tp, H, K]; U0, O [B, Tp, H, V]; Aqk [B, Tp, H, C]; decay [B, N, H, K]
  fp32; S0, SN [B, H, K, V] fp32; states [B, H, N, K, V] fp32 (WITH_STATES). The chunk
  loop is a tl.range: with NUM_STAGES > 1 Triton prefetches the next chunks' rows (cp.async)
  while this one's dots run; a plain range is not pipelined."""
  iv = tl.program_id(0)
  bh = tl.program_id(1).to(tl.int64)
  b, h = bh // H, bh % H
  N: tl.constexpr = Tp // C
  dt = W.dtype.element_ty
  row0 = b * Tp * H + h                   # (b, t=0, h) in a [B, Tp, H, ·] array
  S_KV = tl.load(_state(S0, bh, iv, K, V, BV)).to(tl.float32)
  k_K = tl.arange(0, K)
  for n in tl.range(0, N, num_stages=NUM_STAGES):
    if WITH_STATES:
      tl.store(_state(states, bh * N + n, iv, K, V, BV), S_KV)
    S_d = S_KV.to(dt)
    W_CK = tl.load(chunk_rows(W, row0, n, 0, Tp, H, K, C, K))
    U0_CV = tl.load(chunk_rows(U0, row0, n, iv * BV, Tp, H, V, C, BV))
    U_CV = U0_CV.to(tl.float32) - tl.dot(W_CK, S_d, input_precision=PREC)
    U_d = U_CV.to(dt)
    Qg_CK = tl.load(chunk_rows(Qg, row0, n, 0, Tp, H, K, C, K))
    A_CC = tl.load(chunk_rows(Aqk, row0, n, 0, Tp, H, C, C, C))
    O_CV = tl.dot(A_CC, U_d, acc=tl.dot(Qg_CK, S_d, input_precision=PREC),
                  input_precision=PREC)
    tl.store(chunk_rows(O, row0, n, iv * BV, Tp, H, V, C, BV), O_CV.to(O.dtype.element_ty))
    Kd_CK = tl.load(chunk_rows(Kd, row0, n, 0, Tp, H, K, C, K))
    decay_K = tl.load(decay + ((b * N + n) * H + h) * K + k_K)
    S_KV = tl.dot(tl.trans(Kd_CK), U_d, acc=S_KV * decay_K[:, None], input_precision=PREC)
  tl.store(_state(SN, bh, iv, K, V, BV), S_KV)


@triton.jit
def _kda_recurrence_bwd_triton(W, U0, Qg, Kd, Aqk, decay, states, dO, dSN,
                               dU0, U, dstates, dS0,
                               Tp: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                               V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
                               PREC: tl.constexpr, NUM_STAGES: tl.constexpr):
  """The sequential part of stage 2's backward, dS carried from the last chunk to the
  first (pallas_gpu._recurrence_bwd_kernel's loop): per chunk dU0 = Aqkᵀ dO + Kd dS, the
  chunk's U = U0 - W S and the dS at its end, for the per-chunk gradient kernel."""
  iv = tl.program_id(0)
  bh = tl.program_id(1).to(tl.int64)
  b, h = bh // H, bh % H
  N: tl.constexpr = Tp // C
  dt = W.dtype.element_ty
  row0 = b * Tp * H + h
  dS_KV = tl.load(_state(dSN, bh, iv, K, V, BV)).to(tl.float32)
  k_K = tl.arange(0, K)
  for i in tl.range(0, N, num_stages=NUM_STAGES):
    n = N - 1 - i
    tl.store(_state(dstates, bh * N + n, iv, K, V, BV), dS_KV)
    S_d = tl.load(_state(states, bh * N + n, iv, K, V, BV)).to(dt)
    dS_d = dS_KV.to(dt)
    W_CK = tl.load(chunk_rows(W, row0, n, 0, Tp, H, K, C, K))
    dO_d = tl.load(chunk_rows(dO, row0, n, iv * BV, Tp, H, V, C, BV)).to(dt)
    U0_CV = tl.load(chunk_rows(U0, row0, n, iv * BV, Tp, H, V, C, BV))
    U_CV = U0_CV.to(tl.float32) - tl.dot(W_CK, S_d, input_precision=PREC)
    tl.store(chunk_rows(U, row0, n, iv * BV, Tp, H, V, C, BV), U_CV.to(U.dtype.element_ty))
    A_CC = tl.load(chunk_rows(Aqk, row0, n, 0, Tp, H, C, C, C))
    Kd_CK = tl.load(chunk_rows(Kd, row0, n, 0, Tp, H, K, C, K))
    dU_CV = tl.dot(tl.trans(A_CC), dO_d, acc=tl.dot(Kd_CK, dS_d, input_precision=PREC),
                   input_precision=PREC)
    tl.store(chunk_rows(dU0, row0, n, iv * BV, Tp, H, V, C, BV),
             dU_CV.to(dU0.dtype.element_ty))
    Qg_CK = tl.load(chunk_rows(Qg, row0, n, 0, Tp, H, K, C, K))
    decay_K = tl.load(decay + ((b * N + n) * H + h) * K + k_K)
    dS_KV = tl.dot(tl.trans(Qg_CK), dO_d, acc=dS_KV * decay_K[:, None], input_precision=PREC)
    dS_KV = tl.dot(tl.trans(W_CK), (-dU_CV).to(dt), acc=dS_KV, input_precision=PREC)
  tl.store(_state(dS0, bh, iv, K, V, BV), dS_KV)


@triton.jit
def _kda_recurrence_grads_triton(states, dstates, dO, U, dU0, dW, dQg, dKd, dAqk, ddecay,
                                 Tp: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                                 V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                                 BV: tl.constexpr, PREC: tl.constexpr,
                                 NUM_STAGES: tl.constexpr):
  """The parallel part of stage 2's backward (pallas_gpu._recurrence_grads_kernel), one
  chunk and BK of K a program, grid (K/BK, N, B·H): with S the chunk's start state and dS
  the cotangent of its end state, dQg = dO Sᵀ, dKd = U dSᵀ, dW = -dU Sᵀ and
  d(decay) = Σ_v S ⊙ dS, contracted over V in BV-wide blocks; dAqk = dO Uᵀ (stored by the
  K block 0 programs). states, dstates [B, H, N, K, V] fp32; dO, U, dU0 [B, Tp, H, V]."""
  ik = tl.program_id(0)
  n = tl.program_id(1)
  bh = tl.program_id(2).to(tl.int64)
  b, h = bh // H, bh % H
  N: tl.constexpr = Tp // C
  dt = U.dtype.element_ty
  row0 = b * Tp * H + h
  dQg_CK = tl.full((C, BK), 0.0, tl.float32)
  dKd_CK = tl.full((C, BK), 0.0, tl.float32)
  dUS_CK = tl.full((C, BK), 0.0, tl.float32)
  dAqk_CC = tl.full((C, C), 0.0, tl.float32)
  dd_K = tl.full((BK,), 0.0, tl.float32)
  for iv in tl.range(0, V // BV, num_stages=NUM_STAGES):
    S_KV = tl.load(_state_block(states, bh * N + n, ik, iv, K, V, BK, BV))
    dS_KV = tl.load(_state_block(dstates, bh * N + n, ik, iv, K, V, BK, BV))
    dO_CV = tl.load(chunk_rows(dO, row0, n, iv * BV, Tp, H, V, C, BV)).to(dt)
    U_CV = tl.load(chunk_rows(U, row0, n, iv * BV, Tp, H, V, C, BV))
    dU_CV = tl.load(chunk_rows(dU0, row0, n, iv * BV, Tp, H, V, C, BV)).to(dt)
    S_d, dS_d = S_KV.to(dt), dS_KV.to(dt)
    dQg_CK = tl.dot(dO_CV, tl.trans(S_d), acc=dQg_CK, input_precision=PREC)
    dKd_CK = tl.dot(U_CV, tl.trans(dS_d), acc=dKd_CK, input_precision=PREC)
    dUS_CK = tl.dot(dU_CV, tl.trans(S_d), acc=dUS_CK, input_precision=PREC)
    dAqk_CC = tl.dot(dO_CV, tl.trans(U_CV), acc=dAqk_CC, input_precision=PREC)
    dd_K += fp32_sum(S_KV * dS_KV, 1)
  tl.store(chunk_rows(dQg, row0, n, ik * BK, Tp, H, K, C, BK),
           dQg_CK.to(dQg.dtype.element_ty))
  tl.store(chunk_rows(dKd, row0, n, ik * BK, Tp, H, K, C, BK),
           dKd_CK.to(dKd.dtype.element_ty))
  tl.store(chunk_rows(dW, row0, n, ik * BK, Tp, H, K, C, BK), (-dUS_CK).to(dW.dtype.element_ty))
  tl.store(ddecay + ((b * N + n) * H + h) * K + ik * BK + tl.arange(0, BK), dd_K)
  if ik == 0:
    tl.store(chunk_rows(dAqk, row0, n, 0, Tp, H, C, C, C), dAqk_CC.to(dAqk.dtype.element_ty))


@triton.jit
def _subchunk_program(axis: tl.constexpr, Tp: tl.constexpr, H: tl.constexpr,
                      C: tl.constexpr):
  """What a one-sub-chunk program reads first: its sub-chunk r = n·S + a (program id
  `axis`) with chunk n and a, its b (program id axis + 1 is b·H + h) and row0 = b·Tp·H + h."""
  S: tl.constexpr = C // 16
  r = tl.program_id(axis)
  bh = tl.program_id(axis + 1).to(tl.int64)
  b, h = bh // H, bh % H
  return r, r // S, r % S, b, b * Tp * H + h


@triton.jit
def _kda_tiles_triton(q, k, G, seg, A, Aqk,
                      Tp: tl.constexpr, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
                      BK: tl.constexpr, SCALE: tl.constexpr, PREC: tl.constexpr,
                      NUM_STAGES: tl.constexpr):
  """Row block a (16 rows) of a chunk's A (strictly causal, fp32) and Aqk (causal, scaled,
  q's dtype), pallas_gpu._tiles_kernel's [16, C] form for one sub-chunk a program:
  A_a = (K_a ⊙ e^{G_a - m_a}) (K ⊙ e^{m_a - G})ᵀ with m_a a's middle row, rows after a
  zeroed before the exponential; K contracted in BK-wide column blocks."""
  L: tl.constexpr = 16
  r, n, a, b, row0 = _subchunk_program(0, Tp, H, C)
  i_L, i_C = tl.arange(0, L), tl.arange(0, C)
  seen_C = i_C < (a + 1) * L
  t = r * L + L // 2
  A_LC = tl.full((L, C), 0.0, tl.float32)
  Aqk_LC = tl.full((L, C), 0.0, tl.float32)
  for ik in tl.range(0, K // BK, num_stages=NUM_STAGES):
    col = ik * BK
    anchor_K = tl.load(G + (row0 + t * H) * K + col + tl.arange(0, BK)).to(tl.float32)
    left_LK = tl.exp(tl.load(chunk_rows(G, row0, r, col, Tp, H, K, L, BK)).to(tl.float32)
                     - anchor_K[None, :])
    kl_LK = tl.load(chunk_rows(k, row0, r, col, Tp, H, K, L, BK)).to(tl.float32) * left_LK
    ql_LK = tl.load(chunk_rows(q, row0, r, col, Tp, H, K, L, BK)).to(tl.float32) * left_LK
    G_CK = tl.load(chunk_rows(G, row0, n, col, Tp, H, K, C, BK)).to(tl.float32)
    k_CK = tl.load(chunk_rows(k, row0, n, col, Tp, H, K, C, BK)).to(tl.float32)
    right_CK = tl.exp(tl.where(seen_C[:, None], anchor_K[None, :] - G_CK, 0.0))
    kr_CK = tl.where(seen_C[:, None], k_CK * right_CK, 0.0)
    A_LC = tl.dot(kl_LK, tl.trans(kr_CK), acc=A_LC, input_precision=PREC)
    Aqk_LC = tl.dot(ql_LK, tl.trans(kr_CK), acc=Aqk_LC, input_precision=PREC)
  seg_L = tl.load(seg + b * Tp + r * L + i_L)
  seg_C = tl.load(seg + b * Tp + n * C + i_C)
  same = seg_L[:, None] == seg_C[None, :]
  i_LC = a * L + i_L[:, None]
  tl.store(chunk_rows(A, row0, r, 0, Tp, H, C, L, C),
           tl.where(same & (i_LC > i_C[None, :]), A_LC, 0.0))
  tl.store(chunk_rows(Aqk, row0, r, 0, Tp, H, C, L, C),
           tl.where(same & (i_LC >= i_C[None, :]), Aqk_LC * SCALE, 0.0)
           .to(Aqk.dtype.element_ty))


@triton.jit
def _kda_tiles_blocks_triton(q, k, G, seg, A, Aqk,
                             Tp: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                             C: tl.constexpr, SCALE: tl.constexpr, PREC: tl.constexpr,
                             NUM_STAGES: tl.constexpr):
  """_kda_tiles_triton's rows of A and Aqk for sub-chunk a, computed [16, 16] tile by tile
  over the sub-chunks c ≤ a only (the tiles right of the diagonal are stored as zeros, not
  computed), each tile one dot over all of K: a's decayed rows are computed once, each
  column sub-chunk's rows once per tile."""
  L: tl.constexpr = 16
  S: tl.constexpr = C // L
  r, n, a, b, row0 = _subchunk_program(0, Tp, H, C)
  i_L = tl.arange(0, L)
  anchor_K = tl.load(G + (row0 + (r * L + L // 2) * H) * K + tl.arange(0, K))
  left_LK = tl.exp(tl.load(chunk_rows(G, row0, r, 0, Tp, H, K, L, K)) - anchor_K[None, :])
  kl_LK = tl.load(chunk_rows(k, row0, r, 0, Tp, H, K, L, K)).to(tl.float32) * left_LK
  ql_LK = tl.load(chunk_rows(q, row0, r, 0, Tp, H, K, L, K)).to(tl.float32) * left_LK
  seg_L = tl.load(seg + b * Tp + r * L + i_L)
  for c in tl.range(0, a + 1, num_stages=NUM_STAGES):
    rc = n * S + c
    G_LK = tl.load(chunk_rows(G, row0, rc, 0, Tp, H, K, L, K))
    kr_LK = tl.load(chunk_rows(k, row0, rc, 0, Tp, H, K, L, K)).to(tl.float32) * tl.exp(
        anchor_K[None, :] - G_LK)
    A_LL = tl.dot(kl_LK, tl.trans(kr_LK), input_precision=PREC)
    Aqk_LL = tl.dot(ql_LK, tl.trans(kr_LK), input_precision=PREC)
    same = seg_L[:, None] == tl.load(seg + b * Tp + rc * L + i_L)[None, :]
    j_L = c * L + i_L
    i_LL = a * L + i_L[:, None]
    tl.store(chunk_rows(A, row0, r, c * L, Tp, H, C, L, L),
             tl.where(same & (i_LL > j_L[None, :]), A_LL, 0.0))
    tl.store(chunk_rows(Aqk, row0, r, c * L, Tp, H, C, L, L),
             tl.where(same & (i_LL >= j_L[None, :]), Aqk_LL * SCALE, 0.0)
             .to(Aqk.dtype.element_ty))
  for c in tl.range(a + 1, S):
    tl.store(chunk_rows(A, row0, r, c * L, Tp, H, C, L, L), tl.full((L, L), 0.0, tl.float32))
    tl.store(chunk_rows(Aqk, row0, r, c * L, Tp, H, C, L, L),
             tl.full((L, L), 0.0, tl.float32).to(Aqk.dtype.element_ty))


@triton.jit
def _chunk_program(T, beta, seg, Tp: tl.constexpr, H: tl.constexpr, C: tl.constexpr):
  """What a one-chunk W/U program (grid (N, B·H)) reads first: its chunk n, b, h, row0,
  T [C, C], β [C] in fp32, the chunk's segment ids [C] and its last row's."""
  n = tl.program_id(0)
  bh = tl.program_id(1).to(tl.int64)
  b, h = bh // H, bh % H
  row0 = b * Tp * H + h
  i_C = tl.arange(0, C)
  T_CC = tl.load(chunk_rows(T, row0, n, 0, Tp, H, C, C, C))
  beta_C = tl.load(beta + (b * Tp + n * C + i_C) * H + h).to(tl.float32)
  seg_C = tl.load(seg + b * Tp + n * C + i_C)
  seg_end = tl.load(seg + b * Tp + n * C + C - 1)
  return n, b, h, row0, T_CC, beta_C, seg_C, seg_end


@triton.jit
def _kda_wu_triton(T, q, k, v, G, beta, seg, W, U0, Qg, Kd, decay,
                   Tp: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   C: tl.constexpr, BK: tl.constexpr, SCALE: tl.constexpr,
                   PREC: tl.constexpr, LOW_DOTS: tl.constexpr, NUM_STAGES: tl.constexpr):
  """pallas_gpu._wu_kernel for one chunk: W = T·Diag(β)(K⊙Γ), U0 = T·Diag(β)V, and the
  decayed Qg, Kd and the chunk's decay, in BK-wide column blocks. LOW_DOTS: the two dots'
  operands rounded to q's dtype first (bf16: as fla's recompute_w_u)."""
  N: tl.constexpr = Tp // C
  n, b, h, row0, T_CC, beta_C, seg_C, seg_end = _chunk_program(T, beta, seg, Tp, H, C)
  dot_dt = q.dtype.element_ty if LOW_DOTS else tl.float32
  T_CC = T_CC.to(dot_dt)
  for ik in tl.range(0, K // BK, num_stages=NUM_STAGES):
    col = ik * BK
    gamma_CK, to_end_CK, decay_K = _chunk_gates(G, seg_C, seg_end, row0, n, col, Tp, H, K,
                                                C, BK)
    k_CK = tl.load(chunk_rows(k, row0, n, col, Tp, H, K, C, BK)).to(tl.float32)
    q_CK = tl.load(chunk_rows(q, row0, n, col, Tp, H, K, C, BK)).to(tl.float32)
    W_CK = tl.dot(T_CC, (beta_C[:, None] * k_CK * gamma_CK).to(dot_dt), input_precision=PREC)
    tl.store(chunk_rows(W, row0, n, col, Tp, H, K, C, BK), W_CK.to(W.dtype.element_ty))
    tl.store(chunk_rows(Qg, row0, n, col, Tp, H, K, C, BK),
             (q_CK * gamma_CK * SCALE).to(Qg.dtype.element_ty))
    tl.store(chunk_rows(Kd, row0, n, col, Tp, H, K, C, BK),
             (k_CK * to_end_CK).to(Kd.dtype.element_ty))
    tl.store(decay + ((b * N + n) * H + h) * K + col + tl.arange(0, BK), decay_K)
  for iv in tl.range(0, V // BK, num_stages=NUM_STAGES):
    v_CV = tl.load(chunk_rows(v, row0, n, iv * BK, Tp, H, V, C, BK)).to(tl.float32)
    U0_CV = tl.dot(T_CC, (beta_C[:, None] * v_CV).to(dot_dt), input_precision=PREC)
    tl.store(chunk_rows(U0, row0, n, iv * BK, Tp, H, V, C, BK), U0_CV.to(U0.dtype.element_ty))


@triton.jit
def fp32_sum(x, axis: tl.constexpr):
  """tl.sum of fp32 (its own reduction): tl.sum is a @triton.jit library function, which
  Triton's interpreter runs only in a process started with TRITON_INTERPRET=1, where
  nothing could be compiled for the GPU; this reduction it runs with numpy."""
  return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def _chunk_gates(G, seg_C, seg_end, row0, n, col, Tp: tl.constexpr, H: tl.constexpr,
                 K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr):
  """pallas_gpu._chunk_gates on columns col … col + BK of chunk n: Γ = e^G [C, BK] on rows
  S0 reaches, e^{G_end - G} on rows that reach the chunk's end, decay = Γ_end [BK]."""
  G_CK = tl.load(chunk_rows(G, row0, n, col, Tp, H, K, C, BK)).to(tl.float32)
  G_end_K = tl.load(G + (row0 + (n * C + C - 1) * H) * K + col + tl.arange(0, BK))
  gamma_CK = tl.where((seg_C == 0)[:, None], tl.exp(G_CK), 0.0)
  to_end_CK = tl.where((seg_C == seg_end)[:, None], tl.exp(G_end_K[None, :] - G_CK), 0.0)
  decay_K = tl.where(seg_end == 0, tl.exp(G_end_K), 0.0)
  return gamma_CK, to_end_CK, decay_K


@triton.jit
def _kda_wu_bwd_triton(T, A, q, k, v, G, beta, seg, dW, dU0, dQg, dKd, ddecay,
                       dA, dq0, dk0, dv, dbeta, dG0,
                       Tp: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                       V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                       SCALE: tl.constexpr, PREC: tl.constexpr, NUM_STAGES: tl.constexpr):
  """pallas_gpu._wu_bwd_kernel for one chunk: dT = dW Xᵀ + dU0 Yᵀ (X = β K⊙Γ, Y = β V) over
  BK-wide column blocks, d(βA) = -Tᵀ dT Tᵀ on A's support (dA, for the tiles backward),
  then per block dX = Tᵀ dW, dY = Tᵀ dU0 and the elementwise Qg / Kd / decay terms.
  T, A, dA [B, Tp, H, C] fp32; beta, dbeta [B, Tp, H]; decay rows [B, N, H, K]."""
  N: tl.constexpr = Tp // C
  n, b, h, row0, T_CC, beta_C, seg_C, seg_end = _chunk_program(T, beta, seg, Tp, H, C)
  i_C = tl.arange(0, C)
  dT_CC = tl.full((C, C), 0.0, tl.float32)
  for ik in tl.range(0, K // BK, num_stages=NUM_STAGES):
    gamma_CK, _, _ = _chunk_gates(G, seg_C, seg_end, row0, n, ik * BK, Tp, H, K, C, BK)
    k_CK = tl.load(chunk_rows(k, row0, n, ik * BK, Tp, H, K, C, BK)).to(tl.float32)
    dW_CK = tl.load(chunk_rows(dW, row0, n, ik * BK, Tp, H, K, C, BK)).to(tl.float32)
    X_CK = beta_C[:, None] * k_CK * gamma_CK
    dT_CC = tl.dot(dW_CK, tl.trans(X_CK), acc=dT_CC, input_precision=PREC)
  for iv in tl.range(0, V // BK, num_stages=NUM_STAGES):
    v_CV = tl.load(chunk_rows(v, row0, n, iv * BK, Tp, H, V, C, BK)).to(tl.float32)
    dU0_CV = tl.load(chunk_rows(dU0, row0, n, iv * BK, Tp, H, V, C, BK)).to(tl.float32)
    dT_CC = tl.dot(dU0_CV, tl.trans(beta_C[:, None] * v_CV), acc=dT_CC, input_precision=PREC)
  # cotangent of L = I + Diag(β)A
  dL_CC = -tl.dot(tl.trans(T_CC), tl.dot(dT_CC, tl.trans(T_CC), input_precision=PREC),
                  input_precision=PREC)
  support = (seg_C[:, None] == seg_C[None, :]) & (i_C[:, None] > i_C[None, :])
  tl.store(chunk_rows(dA, row0, n, 0, Tp, H, C, C, C),
           tl.where(support, beta_C[:, None] * dL_CC, 0.0))
  dbeta_C = fp32_sum(dL_CC * tl.load(chunk_rows(A, row0, n, 0, Tp, H, C, C, C)), 1)
  last_C = i_C == C - 1
  for ik in tl.range(0, K // BK, num_stages=NUM_STAGES):
    col = ik * BK
    gamma_CK, to_end_CK, decay_K = _chunk_gates(G, seg_C, seg_end, row0, n, col, Tp, H, K,
                                                C, BK)
    q_CK = tl.load(chunk_rows(q, row0, n, col, Tp, H, K, C, BK)).to(tl.float32)
    k_CK = tl.load(chunk_rows(k, row0, n, col, Tp, H, K, C, BK)).to(tl.float32)
    dQg_CK = tl.load(chunk_rows(dQg, row0, n, col, Tp, H, K, C, BK)).to(tl.float32)
    dKd_CK = tl.load(chunk_rows(dKd, row0, n, col, Tp, H, K, C, BK)).to(tl.float32)
    dW_CK = tl.load(chunk_rows(dW, row0, n, col, Tp, H, K, C, BK)).to(tl.float32)
    dX_CK = tl.dot(tl.trans(T_CC), dW_CK, input_precision=PREC)
    tl.store(chunk_rows(dq0, row0, n, col, Tp, H, K, C, BK), dQg_CK * SCALE * gamma_CK)
    tl.store(chunk_rows(dk0, row0, n, col, Tp, H, K, C, BK),
             dX_CK * beta_C[:, None] * gamma_CK + dKd_CK * to_end_CK)
    P_CK = dKd_CK * k_CK * to_end_CK                    # d/dG of Kd = k e^{G_end - G}
    ddecay_K = tl.load(ddecay + ((b * N + n) * H + h) * K + col + tl.arange(0, BK))
    dG_end_K = fp32_sum(P_CK, 0) + ddecay_K * decay_K
    dG_CK = ((dX_CK * beta_C[:, None] * k_CK + dQg_CK * SCALE * q_CK) * gamma_CK - P_CK
             + tl.where(last_C[:, None], dG_end_K[None, :], 0.0))
    tl.store(chunk_rows(dG0, row0, n, col, Tp, H, K, C, BK), dG_CK)
    dbeta_C += fp32_sum(dX_CK * k_CK * gamma_CK, 1)
  for iv in tl.range(0, V // BK, num_stages=NUM_STAGES):
    v_CV = tl.load(chunk_rows(v, row0, n, iv * BK, Tp, H, V, C, BK)).to(tl.float32)
    dU0_CV = tl.load(chunk_rows(dU0, row0, n, iv * BK, Tp, H, V, C, BK)).to(tl.float32)
    dY_CV = tl.dot(tl.trans(T_CC), dU0_CV, input_precision=PREC)
    tl.store(chunk_rows(dv, row0, n, iv * BK, Tp, H, V, C, BK),
             (beta_C[:, None] * dY_CV).to(dv.dtype.element_ty))
    dbeta_C += fp32_sum(dY_CV * v_CV, 1)
  tl.store(dbeta + (b * Tp + n * C + i_C) * H + h, dbeta_C)


@triton.jit
def _kda_tiles_bwd_triton(q, k, G, seg, dA, dAqk, dq0, dk0, dG0, dq, dk, dG,
                          Tp: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                          C: tl.constexpr, BK: tl.constexpr, SCALE: tl.constexpr,
                          PREC: tl.constexpr, NUM_STAGES: tl.constexpr):
  """Stage 1's tiles backward (pallas_gpu._tiles_bwd_kernel) for one 16-row sub-chunk a and
  BK columns, added to wu_bwd's parts dq0, dk0, dG0 and stored in the outputs' dtypes.
  q, k, G, dq0, dk0, dG0 [B, Tp, H, K]; seg [B, Tp]; dA (masked), dAqk (raw) [B, Tp, H, C].
  Sub-chunk a is the row block of the tiles (a, j ≤ a) and the column block of the tiles
  (c ≥ a, a): one program owns all of a's cotangent rows, so nothing is added across
  programs, and it holds [16, BK] tiles only (the Pallas kernel, a chunk a program, held
  ten tiles and spilled). Anchors are pallas_gpu._anchor_row's: both factors ≤ 1 off the
  diagonal, ≤ e^40 on it."""
  L: tl.constexpr = 16
  S: tl.constexpr = C // L
  ik = tl.program_id(0)
  r, n, a, b, row0 = _subchunk_program(1, Tp, H, C)
  n0 = n * S                               # the chunk's first sub-chunk
  col = ik * BK
  c_BK = col + tl.arange(0, BK)
  i_L = tl.arange(0, L)
  q_LK = tl.load(chunk_rows(q, row0, r, col, Tp, H, K, L, BK)).to(tl.float32)
  k_LK = tl.load(chunk_rows(k, row0, r, col, Tp, H, K, L, BK)).to(tl.float32)
  G_LK = tl.load(chunk_rows(G, row0, r, col, Tp, H, K, L, BK)).to(tl.float32)
  seg_L = tl.load(seg + b * Tp + r * L + i_L)
  dq_LK = tl.load(chunk_rows(dq0, row0, r, col, Tp, H, K, L, BK)).to(tl.float32)
  dk_LK = tl.load(chunk_rows(dk0, row0, r, col, Tp, H, K, L, BK)).to(tl.float32)
  dG_LK = tl.load(chunk_rows(dG0, row0, r, col, Tp, H, K, L, BK)).to(tl.float32)
  # a as the row block: d(k_a·left) = dA_aj (k_j·right), likewise q_a with dAqk.
  for j in tl.range(n0, r + 1, num_stages=NUM_STAGES):
    t = tl.where(j == r, r * L + L // 2, j * L + L - 1)
    anchor_K = tl.load(G + (row0 + t * H) * K + c_BK).to(tl.float32)
    Gj_LK = tl.load(chunk_rows(G, row0, j, col, Tp, H, K, L, BK)).to(tl.float32)
    kj_LK = tl.load(chunk_rows(k, row0, j, col, Tp, H, K, L, BK)).to(tl.float32)
    kr_LK = kj_LK * tl.exp(anchor_K[None, :] - Gj_LK)
    dA_LL = tl.load(chunk_rows(dA, row0, r, (j - n0) * L, Tp, H, C, L, L)).to(tl.float32)
    dAqk_LL = tl.load(chunk_rows(dAqk, row0, r, (j - n0) * L, Tp, H, C, L, L)).to(tl.float32)
    seg_j = tl.load(seg + b * Tp + j * L + i_L)
    keep = (seg_L[:, None] == seg_j[None, :]) & ((j < r) | (i_L[:, None] >= i_L[None, :]))
    dAqk_LL = tl.where(keep, dAqk_LL, 0.0) * SCALE
    left_LK = tl.exp(G_LK - anchor_K[None, :])
    dkl_LK = tl.dot(dA_LL, kr_LK, input_precision=PREC)
    dql_LK = tl.dot(dAqk_LL, kr_LK, input_precision=PREC)
    dk_LK += dkl_LK * left_LK
    dq_LK += dql_LK * left_LK
    dG_LK += (dkl_LK * k_LK + dql_LK * q_LK) * left_LK
  # a as the column block: d(k_a·right) = dA_caᵀ (k_c·left) + dAqk_caᵀ (q_c·left).
  for c in tl.range(r, n0 + S, num_stages=NUM_STAGES):
    t = tl.where(c == r, r * L + L // 2, r * L + L - 1)
    anchor_K = tl.load(G + (row0 + t * H) * K + c_BK).to(tl.float32)
    Gc_LK = tl.load(chunk_rows(G, row0, c, col, Tp, H, K, L, BK)).to(tl.float32)
    left_LK = tl.exp(Gc_LK - anchor_K[None, :])
    kl_LK = tl.load(chunk_rows(k, row0, c, col, Tp, H, K, L, BK)).to(tl.float32) * left_LK
    ql_LK = tl.load(chunk_rows(q, row0, c, col, Tp, H, K, L, BK)).to(tl.float32) * left_LK
    dA_LL = tl.load(chunk_rows(dA, row0, c, (r - n0) * L, Tp, H, C, L, L)).to(tl.float32)
    dAqk_LL = tl.load(chunk_rows(dAqk, row0, c, (r - n0) * L, Tp, H, C, L, L)).to(tl.float32)
    seg_c = tl.load(seg + b * Tp + c * L + i_L)
    keep = (seg_c[:, None] == seg_L[None, :]) & ((c > r) | (i_L[:, None] >= i_L[None, :]))
    dAqk_LL = tl.where(keep, dAqk_LL, 0.0) * SCALE
    dkr_LK = tl.dot(tl.trans(dA_LL), kl_LK, input_precision=PREC)
    dkr_LK = tl.dot(tl.trans(dAqk_LL), ql_LK, acc=dkr_LK, input_precision=PREC)
    right_LK = tl.exp(anchor_K[None, :] - G_LK)
    dk_LK += dkr_LK * right_LK
    dG_LK -= dkr_LK * k_LK * right_LK
  tl.store(chunk_rows(dq, row0, r, col, Tp, H, K, L, BK), dq_LK.to(dq.dtype.element_ty))
  tl.store(chunk_rows(dk, row0, r, col, Tp, H, K, L, BK), dk_LK.to(dk.dtype.element_ty))
  tl.store(chunk_rows(dG, row0, r, col, Tp, H, K, L, BK), dG_LK.to(dG.dtype.element_ty))


def _launch(kernel, grid, args, out_type, meta, *, name, interpret, warps=None, stages=None):
  """triton_launch.launch at this module's knobs: `warps` (WARPS) and `stages`, or without
  `stages` the deepest pipeline up to STAGES that fits (the recurrences: a stage holds whole
  [C, K] and [C, V] rows, so its size grows with the head dims; the stage-1 kernels' stages
  hold fixed-width column blocks and fit at any K and V, which tests/test_kda_triton.py
  checks, so they skip the extra compile: seconds of every start)."""
  return triton_launch.launch(kernel, grid, args, out_type, meta, name=name,
                              interpret=interpret, warps=WARPS if warps is None else warps,
                              max_stages=STAGES, stages=stages)


def _recurrence_call(st, S0, *, chunk_size, with_states, interpret):
  B, Tp, H, K = st["W"].shape
  V = st["U0"].shape[-1]
  C, N, BV = chunk_size, Tp // chunk_size, min(V, BLOCK_V)
  out_type = [jax.ShapeDtypeStruct((B, Tp, H, V), st["U0"].dtype),
              jax.ShapeDtypeStruct((B, H, K, V), F32),
              # unwritten without states: the kernel's pointer needs an argument
              jax.ShapeDtypeStruct((B, H, N, K, V) if with_states else (1,), F32)]
  prec = triton_launch.fp32_dots() if st["W"].dtype == F32 else "tf32"   # (bf16: ignored)
  meta = dict(Tp=Tp, H=H, K=K, V=V, C=C, BV=BV, WITH_STATES=with_states, PREC=prec)
  args = (st["W"], st["U0"], st["Qg"], st["Kd"], st["Aqk"], st["decay"], S0)
  O, SN, states = _launch(_kda_recurrence_triton, (V // BV, B * H), args, out_type, meta,
                          name="kda_recurrence_triton", interpret=interpret)
  return (O, SN, states) if with_states else (O, SN)


def _recurrence_bwd_call(st, states, dO, dSN, *, chunk_size, interpret):
  """The sequential backward, then the per-chunk gradient kernel."""
  B, Tp, H, K = st["W"].shape
  V = st["U0"].shape[-1]
  C, N, BV, dt = chunk_size, Tp // chunk_size, min(V, BLOCK_V), st["W"].dtype
  out_type = [jax.ShapeDtypeStruct((B, Tp, H, V), dt),        # dU0
              jax.ShapeDtypeStruct((B, Tp, H, V), dt),        # U, for the grads kernel
              jax.ShapeDtypeStruct((B, H, N, K, V), F32),     # dS at each chunk's end
              jax.ShapeDtypeStruct((B, H, K, V), F32)]        # dS0
  meta = dict(Tp=Tp, H=H, K=K, V=V, C=C, BV=BV,
              PREC=triton_launch.fp32_dots() if dt == F32 else "tf32")
  args = (st["W"], st["U0"], st["Qg"], st["Kd"], st["Aqk"], st["decay"], states, dO, dSN)
  dU0, U, dstates, dS0 = _launch(_kda_recurrence_bwd_triton, (V // BV, B * H), args, out_type,
                                 meta, name="kda_recurrence_bwd_triton", interpret=interpret)
  return _recurrence_grads_call(states, dstates, dO, U, dU0, dS0, chunk_size=C,
                                interpret=interpret)


def _recurrence_grads_call(states, dstates, dO, U, dU0, dS0, *, chunk_size, interpret):
  """pallas_gpu._recurrence_grads_call's contract: the per-chunk cotangents from the
  sequential kernel's outputs, as the stage-2 backward's (d_st, dS0). Grid (K/BK, N, B·H)."""
  B, H, N, K, V = states.shape
  Tp, C, dt = U.shape[1], chunk_size, U.dtype
  BK, BV = min(K, GRADS_BLOCK_K), min(V, GRADS_BLOCK_V)
  rows = lambda D: jax.ShapeDtypeStruct((B, Tp, H, D), dt)
  out_type = [rows(K), rows(K), rows(K), rows(C), jax.ShapeDtypeStruct((B, N, H, K), F32)]
  meta = dict(Tp=Tp, H=H, K=K, V=V, C=C, BK=BK, BV=BV,
              PREC=triton_launch.fp32_dots() if dt == F32 else "tf32")
  dW, dQg, dKd, dAqk, ddecay = _launch(
      _kda_recurrence_grads_triton, (K // BK, N, B * H), (states, dstates, dO, U, dU0),
      out_type, meta, name="kda_recurrence_grads_triton", interpret=interpret,
      warps=GRADS_WARPS, stages=GRADS_STAGES)
  return {"W": dW, "U0": dU0, "Qg": dQg, "Kd": dKd, "Aqk": dAqk, "decay": ddecay}, dS0


# Stage 2 in Triton: the sequential kernels forward and backward, the per-chunk gradient
# kernel.
recurrence = recurrence_with_vjp(_recurrence_call, _recurrence_bwd_call)


def tiles_call(q, k, G, seg, *, scale, chunk_size, interpret):
  """pallas_gpu.tiles_call's (A fp32, Aqk in q's dtype). Grid (Tp/16, B·H)."""
  B, Tp, H, K = q.shape
  C = chunk_size
  out_type = [jax.ShapeDtypeStruct((B, Tp, H, C), F32), jax.ShapeDtypeStruct((B, Tp, H, C),
                                                                            q.dtype)]
  meta = dict(Tp=Tp, H=H, K=K, C=C, SCALE=float(scale), PREC=triton_launch.fp32_dots())
  by_tile = K >= 128 if TILES_BY_TILE is None else TILES_BY_TILE
  kernel = _kda_tiles_blocks_triton if by_tile else _kda_tiles_triton
  if not by_tile:
    meta["BK"] = min(K, TILES_BLOCK_K)
  return _launch(kernel, (Tp // pallas_gpu.SUB, B * H),
                 (q, k, G, seg.astype(jnp.int32)), out_type, meta, name="kda_tiles_triton",
                 interpret=interpret, warps=TILES_WARPS, stages=TILES_STAGES)


def wu_call(T, q, k, v, G, beta, seg, *, scale, chunk_size, interpret):
  """pallas_gpu.wu_call's (W, U0, Qg, Kd in q's dtype, decay fp32). Grid (N, B·H)."""
  B, Tp, H, K = q.shape
  V = v.shape[-1]
  C, N, dt = chunk_size, Tp // chunk_size, q.dtype
  rows = lambda D: jax.ShapeDtypeStruct((B, Tp, H, D), dt)
  out_type = [rows(K), rows(V), rows(K), rows(K), jax.ShapeDtypeStruct((B, N, H, K), F32)]
  meta = dict(Tp=Tp, H=H, K=K, V=V, C=C, BK=min(K, V, WU_BLOCK), SCALE=float(scale),
              PREC=triton_launch.fp32_dots(), LOW_DOTS=bool(WU_LOW_DOTS and dt != F32))
  return _launch(_kda_wu_triton, (N, B * H), (T, q, k, v, G, beta, seg.astype(jnp.int32)),
                 out_type, meta, name="kda_wu_triton", interpret=interpret, warps=WU_WARPS,
                 stages=WU_STAGES)


def intra_triton(q, k, v, G, beta, seg, *, scale, chunk_size, interpret, residuals=True):
  """Stage 1's forward as three kernels: (stage-1 outputs, A, T) as pallas_gpu.intra_pallas
  returns them (A and T whatever `residuals` says: the solve and W/U read them).
  triton_gpu_stage1 fuses the three at chunk 64."""
  A, Aqk = tiles_call(q, k, G, seg, scale=scale, chunk_size=chunk_size, interpret=interpret)
  T = pallas_gpu.solve_call(A, beta, chunk_size=chunk_size, interpret=interpret)
  W, U0, Qg, Kd, decay = wu_call(T, q, k, v, G, beta, seg, scale=scale, chunk_size=chunk_size,
                                 interpret=interpret)
  return {"W": W, "U0": U0, "Qg": Qg, "Kd": Kd, "Aqk": Aqk, "decay": decay}, A, T


def wu_bwd_call(T, A, q, k, v, G, beta, seg, d_st, *, scale, chunk_size, interpret):
  """pallas_gpu.wu_bwd_call's outputs and contract: (dA, the W/U0/Qg/Kd/decay parts of dq,
  dk, dG, fp32; dv in v's dtype, dβ fp32). Grid (N, B·H)."""
  B, Tp, H, K = q.shape
  V = v.shape[-1]
  C = chunk_size
  rows = lambda D, dt=F32: jax.ShapeDtypeStruct((B, Tp, H, D), dt)
  out_type = [rows(C), rows(K), rows(K), rows(V, v.dtype), jax.ShapeDtypeStruct((B, Tp, H), F32),
              rows(K)]
  meta = dict(Tp=Tp, H=H, K=K, V=V, C=C, BK=min(K, V, WU_BWD_BLOCK), SCALE=float(scale),
              PREC=triton_launch.fp32_dots())
  args = (T, A, q, k, v, G, beta, seg.astype(jnp.int32), d_st["W"], d_st["U0"], d_st["Qg"],
          d_st["Kd"], d_st["decay"])
  return _launch(_kda_wu_bwd_triton, (Tp // C, B * H), args, out_type, meta,
                 name="kda_wu_bwd_triton", interpret=interpret, warps=WU_BWD_WARPS,
                 stages=WU_BWD_STAGES)


def tiles_bwd_call(q, k, G, seg, dA, dAqk, dq0, dk0, dG0, *, scale, chunk_size, interpret):
  """pallas_gpu.tiles_bwd_call's tile cotangents added to wu_bwd's parts (dq0, dk0, dG0,
  fp32): (dq, dk) in q's and k's dtype, dG fp32. Grid (K/BK, Tp/16, B·H)."""
  B, Tp, H, K = q.shape
  BK = min(K, TILES_BWD_BLOCK_K)
  out_type = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
              jax.ShapeDtypeStruct(G.shape, F32)]
  meta = dict(Tp=Tp, H=H, K=K, C=chunk_size, BK=BK, SCALE=float(scale),
              PREC=triton_launch.fp32_dots())
  args = (q, k, G, seg.astype(jnp.int32), dA, dAqk, dq0, dk0, dG0)
  return _launch(_kda_tiles_bwd_triton, (K // BK, Tp // pallas_gpu.SUB, B * H), args,
                 out_type, meta, name="kda_tiles_bwd_triton", interpret=interpret,
                 warps=TILES_BWD_WARPS, stages=TILES_BWD_STAGES)


def intra_bwd_triton(q, k, v, G, beta, seg, A, T, d_st, *, scale, chunk_size, interpret):
  """Stage 1's backward: the W/U backward, then the tiles backward, which adds the W/U
  parts and writes dq and dk in their final dtypes (no XLA add and cast)."""
  dA, dq0, dk0, dv, dbeta, dG0 = wu_bwd_call(T, A, q, k, v, G, beta, seg, d_st, scale=scale,
                                             chunk_size=chunk_size, interpret=interpret)
  dq, dk, dG = tiles_bwd_call(q, k, G, seg, dA, d_st["Aqk"], dq0, dk0, dG0, scale=scale,
                              chunk_size=chunk_size, interpret=interpret)
  return dq, dk, dv, dG, dbeta

