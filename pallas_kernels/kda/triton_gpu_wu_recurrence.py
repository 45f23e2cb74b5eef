"""KDA's bounded-gate forward with W/U inside the recurrence (implementation="triton",
WU_IN_RECURRENCE below): the tiles kernel, the solve, then one sequential kernel.

triton_gpu's forward writes W, U0, Qg and Kd ([T, K] or [T, V] rows each) in the W/U kernel
and reads them back in the recurrence. At 8×4096×32 (K = V = 128, H200) the W/U kernel
took 0.88 of a 2.84 ms forward (benchmarks/kda.md). Here the recurrence program of one
(V block, batch·head) makes its chunk's operands itself before the chunk's dots:

  W = T·Diag(β)(K⊙Γ)   U0 = T·Diag(β)V[:, block]   Qg = scale·Q⊙Γ   Kd = K⊙e^{G_end - G}

from T (the solve's output), q, k, v, G and β, the same formulas and roundings as
triton_gpu._kda_wu_triton (bf16 inputs: dots on bf16 operands, W and U0 rounded to bf16
before use). Every V block computes the chunk's W, Qg and Kd again: [C, C]·[C, K] of extra
tensor-core work a block, none of it on HBM. The forward without a backward writes none of
the four; the training forward writes them once (V block 0 the K-wide ones) as the
backward's residuals, which then runs triton_gpu's kernels unchanged.

  core(q, k, v, G, beta, seg, S0, scale, chunk_size, interpret) -> (O, S_final)

replaces stage 1 + stage 2 of pallas_gpu._kda_jit for bounded gates: a custom VJP whose
backward is the unfused one's (stage 2's recomputed chunk states, its backward kernels,
then stage 1's)."""

import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels import residuals, triton_launch
from pallas_kernels.kda import pallas_gpu, triton_gpu
# (_state_block: Triton's interpreter looks _state's callee up in this module)
from pallas_kernels.kda.triton_gpu import (_chunk_gates, _state, _state_block,  # noqa: F401
                                           chunk_rows)

F32 = jnp.float32

WU_IN_RECURRENCE = False   # bounded gates: the forward as tiles, solve, this kernel; not
                           # yet timed against triton_gpu's four kernels
WU_REC_STAGES = None       # pipeline stages; None: the most that fit (up to triton_gpu.STAGES)
WU_REC_WARPS = 8           # the chunk's [C, K] operands beside the [K, BV] state
WU_REC_BLOCK_V = 32        # V columns a program (triton_gpu.BLOCK_V's reason: programs)


def fits(K) -> bool:
  """The kernel holds K as two halves of at least 16 columns (Triton's smallest dot)."""
  return K >= 32


@triton.jit
def _half(T_CC, beta_C, seg_C, seg_end, q, k, G, row0, n, col, W, Qg, Kd, decay, b, h,
          Tp: tl.constexpr, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
          HK: tl.constexpr, SCALE: tl.constexpr, PREC: tl.constexpr, dot_dt: tl.constexpr,
          STORE: tl.constexpr, first):
  """Columns col … col + HK of the chunk's W, Qg, Kd (q's dtype) and decay (fp32), as
  triton_gpu._kda_wu_triton computes them; stored where STORE, by the first V block."""
  dt = q.dtype.element_ty
  gamma_CK, to_end_CK, decay_K = _chunk_gates(G, seg_C, seg_end, row0, n, col, Tp, H, K, C, HK)
  k_CK = tl.load(chunk_rows(k, row0, n, col, Tp, H, K, C, HK)).to(tl.float32)
  Kd_CK = (k_CK * to_end_CK).to(dt)
  W_CK = tl.dot(T_CC, (beta_C[:, None] * k_CK * gamma_CK).to(dot_dt),
                input_precision=PREC).to(dt)
  q_CK = tl.load(chunk_rows(q, row0, n, col, Tp, H, K, C, HK)).to(tl.float32)
  Qg_CK = (q_CK * gamma_CK * SCALE).to(dt)
  if STORE and first:
    tl.store(chunk_rows(W, row0, n, col, Tp, H, K, C, HK), W_CK)
    tl.store(chunk_rows(Qg, row0, n, col, Tp, H, K, C, HK), Qg_CK)
    tl.store(chunk_rows(Kd, row0, n, col, Tp, H, K, C, HK), Kd_CK)
    tl.store(decay + ((b * (Tp // C) + n) * H + h) * K + col + tl.arange(0, HK), decay_K)
  return W_CK, Qg_CK, Kd_CK


@triton.jit
def _decay(G, seg_end, row0, n, col, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
           HK: tl.constexpr):
  """The chunk's decay Γ_end on columns col … col + HK, loaded where the state update uses
  it: a [HK] vector is held in every thread, and two of them live across the step spilled."""
  G_end_K = tl.load(G + (row0 + (n * C + C - 1) * H) * K + col + tl.arange(0, HK))
  return tl.where(seg_end == 0, tl.exp(G_end_K), 0.0)


@triton.jit
def _kda_wu_recurrence_triton(T, q, k, v, G, beta, seg, Aqk, S0, O, SN, W, U0, Qg, Kd, decay,
                              Tp: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                              V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
                              SCALE: tl.constexpr, PREC: tl.constexpr,
                              LOW_DOTS: tl.constexpr, RESIDUALS: tl.constexpr,
                              NUM_STAGES: tl.constexpr):
  """T [B, Tp, H, C] (the solve's); q, k, G [B, Tp, H, K]; v, O [B, Tp, H, V]; β [B, Tp, H]
  fp32; seg [B, Tp] int32 (the chunk-local segment ids); Aqk [B, Tp, H, C]; S0, SN
  [B, H, K, V] fp32. RESIDUALS: W, Qg, Kd [B, Tp, H, K], U0 [B, Tp, H, V] in q's dtype and
  decay [B, N, H, K] fp32 as triton_gpu.wu_call writes them. The state and the chunk's
  K-wide operands are held as two column halves: one [C, K] fp32 operand is 32 registers a
  thread at 8 warps and K = 128, and the whole-width form spilled (sm_90a)."""
  iv = tl.program_id(0)
  bh = tl.program_id(1).to(tl.int64)
  b, h = bh // H, bh % H
  N: tl.constexpr = Tp // C
  HK: tl.constexpr = K // 2
  dt = q.dtype.element_ty
  dot_dt = dt if LOW_DOTS else tl.float32
  row0 = b * Tp * H + h
  i_C = tl.arange(0, C)
  S0_KV = tl.load(_state_block(S0, bh, 0, iv, K, V, HK, BV)).to(tl.float32)
  S1_KV = tl.load(_state_block(S0, bh, 1, iv, K, V, HK, BV)).to(tl.float32)
  for n in tl.range(0, N, num_stages=NUM_STAGES):
    T_CC = tl.load(chunk_rows(T, row0, n, 0, Tp, H, C, C, C)).to(dot_dt)
    beta_C = tl.load(beta + (b * Tp + n * C + i_C) * H + h).to(tl.float32)
    seg_C = tl.load(seg + b * Tp + n * C + i_C)
    seg_end = tl.load(seg + b * Tp + n * C + C - 1)
    W0, Qg0, Kd0 = _half(T_CC, beta_C, seg_C, seg_end, q, k, G, row0, n, 0, W, Qg,
                          Kd, decay, b, h, Tp, H, K, C, HK, SCALE, PREC, dot_dt, RESIDUALS,
                          iv == 0)
    v_CV = tl.load(chunk_rows(v, row0, n, iv * BV, Tp, H, V, C, BV)).to(tl.float32)
    U0_CV = tl.dot(T_CC, (beta_C[:, None] * v_CV).to(dot_dt), input_precision=PREC).to(dt)
    if RESIDUALS:
      tl.store(chunk_rows(U0, row0, n, iv * BV, Tp, H, V, C, BV), U0_CV)
    # triton_gpu._kda_recurrence_triton's chunk step on these operands, K in two halves
    S0_d, S1_d = S0_KV.to(dt), S1_KV.to(dt)
    U_CV = U0_CV.to(tl.float32) - tl.dot(W0, S0_d, input_precision=PREC)
    O_CV = tl.dot(Qg0, S0_d, input_precision=PREC)
    W1, Qg1, Kd1 = _half(T_CC, beta_C, seg_C, seg_end, q, k, G, row0, n, HK, W, Qg,
                          Kd, decay, b, h, Tp, H, K, C, HK, SCALE, PREC, dot_dt, RESIDUALS,
                          iv == 0)
    U_d = (U_CV - tl.dot(W1, S1_d, input_precision=PREC)).to(dt)
    O_CV = tl.dot(Qg1, S1_d, acc=O_CV, input_precision=PREC)
    A_CC = tl.load(chunk_rows(Aqk, row0, n, 0, Tp, H, C, C, C))
    O_CV = tl.dot(A_CC, U_d, acc=O_CV, input_precision=PREC)
    tl.store(chunk_rows(O, row0, n, iv * BV, Tp, H, V, C, BV), O_CV.to(O.dtype.element_ty))
    d0_K = _decay(G, seg_end, row0, n, 0, H, K, C, HK)
    S0_KV = tl.dot(tl.trans(Kd0), U_d, acc=S0_KV * d0_K[:, None], input_precision=PREC)
    d1_K = _decay(G, seg_end, row0, n, HK, H, K, C, HK)
    S1_KV = tl.dot(tl.trans(Kd1), U_d, acc=S1_KV * d1_K[:, None], input_precision=PREC)
  tl.store(_state_block(SN, bh, 0, iv, K, V, HK, BV), S0_KV)
  tl.store(_state_block(SN, bh, 1, iv, K, V, HK, BV), S1_KV)


def call(T, Aqk, q, k, v, G, beta, seg, S0, *, scale, chunk_size, residuals, interpret):
  """(O in q's dtype, S_final fp32, and with `residuals` the stage-1 outputs dict that
  triton_gpu.intra_triton returns, else None). Grid (V/BV, B·H)."""
  B, Tp, H, K = q.shape
  V = v.shape[-1]
  C, N, BV, dt = chunk_size, Tp // chunk_size, min(V, WU_REC_BLOCK_V), q.dtype
  rows = lambda D: jax.ShapeDtypeStruct((B, Tp, H, D) if residuals else (1,), dt)
  out_type = [jax.ShapeDtypeStruct((B, Tp, H, V), dt), jax.ShapeDtypeStruct((B, H, K, V), F32),
              rows(K), rows(V), rows(K), rows(K),   # unwritten without residuals: (1,)
              jax.ShapeDtypeStruct((B, N, H, K) if residuals else (1,), F32)]
  meta = dict(Tp=Tp, H=H, K=K, V=V, C=C, BV=BV, SCALE=float(scale),
              PREC=triton_launch.fp32_dots(),
              LOW_DOTS=bool(triton_gpu.WU_LOW_DOTS and dt != F32), RESIDUALS=residuals)
  args = (T, q, k, v, G, beta, seg.astype(jnp.int32), Aqk, S0)
  O, SN, W, U0, Qg, Kd, decay = triton_launch.launch(
      _kda_wu_recurrence_triton, (V // BV, B * H), args, out_type, meta,
      name="kda_wu_recurrence_triton", interpret=interpret, warps=WU_REC_WARPS,
      max_stages=triton_gpu.STAGES, stages=WU_REC_STAGES)
  st = ({"W": W, "U0": U0, "Qg": Qg, "Kd": Kd, "Aqk": Aqk, "decay": decay} if residuals
        else None)
  return O, SN, st


def _tiles_and_solve(q, k, G, beta, seg, scale, chunk_size, interpret):
  """triton_gpu's tiles kernel, then pallas_gpu's solve: (A fp32, Aqk, T fp32)."""
  A, Aqk = triton_gpu.tiles_call(q, k, G, seg, scale=scale, chunk_size=chunk_size,
                                 interpret=interpret)
  return A, Aqk, pallas_gpu.solve_call(A, beta, chunk_size=chunk_size, interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def core(q, k, v, G, beta, seg, S0, scale, chunk_size, interpret):
  """Stages 1 and 2 of bounded gates: (O in q's dtype, S_final fp32)."""
  _, Aqk, T = _tiles_and_solve(q, k, G, beta, seg, scale, chunk_size, interpret)
  O, SN, _ = call(T, Aqk, q, k, v, G, beta, seg, S0, scale=scale, chunk_size=chunk_size,
                  residuals=False, interpret=interpret)
  return O, SN


def _core_fwd(q, k, v, G, beta, seg, S0, scale, chunk_size, interpret):
  A, Aqk, T = _tiles_and_solve(q, k, G, beta, seg, scale, chunk_size, interpret)
  O, SN, st = call(T, Aqk, q, k, v, G, beta, seg, S0, scale=scale, chunk_size=chunk_size,
                   residuals=True, interpret=interpret)
  # the residuals of the two custom VJPs this replaces, under the same names
  q, k, G = residuals.tag((q, k, G), residuals.CHEAP)
  v, beta, seg, A, T, st, S0 = residuals.tag((v, beta, seg, A, T, st, S0))
  return (O, SN), (q, k, v, G, beta, seg, A, T, st, S0)


def _core_bwd(scale, chunk_size, interpret, res, cts):
  q, k, v, G, beta, seg, A, T, st, S0 = res
  dO, dSN = cts
  _, _, states = triton_gpu._recurrence_call(st, S0, chunk_size=chunk_size, with_states=True,
                                             interpret=interpret)
  d_st, dS0 = triton_gpu._recurrence_bwd_call(st, states, dO, dSN, chunk_size=chunk_size,
                                              interpret=interpret)
  d_st = {n: d_st[n].astype(st[n].dtype) for n in st}
  grads = triton_gpu.intra_bwd_triton(q, k, v, G, beta, seg, A, T, d_st, scale=scale,
                                      chunk_size=chunk_size, interpret=interpret)
  return (*(g.astype(x.dtype) for g, x in zip(grads, (q, k, v, G, beta))), None,
          dS0.astype(S0.dtype))


core.defvjp(_core_fwd, _core_bwd)
