"""KDA's bounded-gate forward at a 16-row step, as two kernels (implementation="triton",
FWD16 below): a parallel prepare kernel and a lean recurrence, FlashKDA's split
(benchmarks/kda.md).

triton_gpu's forward runs five kernels: the prologue (L2 norm, gate, chunk cumsum), then at
chunk C the tiles, solve, W/U and recurrence kernels. Here one program prepares each 16-row
tile from the op's inputs, the prologue's work included: q̂, k̂ (live, L2-normalised), the
gate g and its cumsum G over the tile's rows, and

  Γ_i = e^{G_i} (0 past a reset)    Kd_i = k̂_i e^{G_end - G_i}    decay = e^{G_end}
  A = strictly lower (k̂_i · k̂_j e^{G_i - G_j}), Aqk = scale · lower (q̂_i · k̂_j e^{G_i - G_j})
  Tβ = (I + Diag(β) A)^-1 Diag(β)     M = Aqk Tβ     Kt = Tβᵀ Kd

(every pair of rows in one segment, each [16, 16] block anchored at the tile's middle row:
factors ≤ e^{40} at the bound 5), stored as Kg = K̂⊙Γ, Qg = scale·Q̂⊙Γ, Kt (q's dtype),
decay (fp32) and M. The chunked delta rule at chunk 16 (U = Tβ (V - Kg S), O = Qg S + Aqk U,
S <- decay ⊙ S + Kdᵀ U) with U folded into M and Kt leaves the recurrence program of one
(V block, batch·head) per tile

  X = V - Kg S     O = Qg S + M X     S <- decay ⊙ S + Ktᵀ X

two dependent dots on the state's chain (Kg S, then Ktᵀ X) and two beside it. The op's
forward without a backward takes this path (core's primal); with a backward, the forward is
the prologue and triton_gpu's stages, whose residuals the backward kernels read (core's
VJP)."""

import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels import triton_launch
from pallas_kernels.kda import triton_gpu, triton_gpu_prologue, triton_gpu_stage1
# (_state_block: Triton's interpreter looks _state's callee up in this module)
from pallas_kernels.kda.triton_gpu import (_state, _state_block,  # noqa: F401
                                           chunk_rows, fp32_sum)
from pallas_kernels.kda.triton_gpu_prologue import _EPS, _gate, _sigmoid  # noqa: F401
from pallas_kernels.kda.triton_gpu_stage1 import _inverse

F32 = jnp.float32
ROWS = 16                # rows a step
L = tl.constexpr(ROWS)   # (the kernels' copy)

FWD16 = False              # bounded gates' forward without a backward at a 16-row step: 15%
                           # faster at 256 (b, h) pairs, 23-42% slower at 16 (kda.md)
FWD16_PREPARE_WARPS = 4    # sm_90a, bf16, the gate and L2 norm inside: 128 / 217 registers
                           # at K = 64 / 128, no spills
FWD16_WARPS = 4            # the recurrence: 89 / 123 registers at K = V = 64 / 128, 3 stages
                           # (BV 64: 120 / 178)
FWD16_BLOCK_V = 32         # V columns a recurrence program (triton_gpu.BLOCK_V's reason)


@triton.jit
def _kda16_prepare_triton(q, k, f, a, bias, live, beta, seg, Kg, Qg, Kt, decay, M,
                          Tp: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                          C: tl.constexpr, SCALE: tl.constexpr, PREC: tl.constexpr,
                          SOLVE: tl.constexpr, GATE: tl.constexpr, LOWER: tl.constexpr,
                          L2NORM: tl.constexpr, NUM_STAGES: tl.constexpr):
  """Tile r (program id 0; 16 rows) of (b, h) (id 1) from the op's raw inputs, the
  prologue's work included: q, k, f [B, Tp, H, K] (f the gate's input, or the log-decay
  with GATE 0); a = exp(A_log), bias [H, K] fp32; live [B, Tp] int32; β [B, Tp, H] fp32;
  seg [B, Tp] int32 (segment ids local to chunks of C). q̂, k̂ = live·q, live·k (L2
  normalised with L2NORM), G = the cumsum of live·gate(f) over the tile's rows. Writes Kg,
  Qg, Kt [B, Tp, H, K] and M [B, Tp, H, 16] in Kg's dtype, decay [B, Tp/16, H, K] fp32."""
  r = tl.program_id(0)
  bh = tl.program_id(1).to(tl.int64)
  b, h = bh // H, bh % H
  row0 = b * Tp * H + h
  t0 = r * L
  i_L, k_K = tl.arange(0, L), tl.arange(0, K)
  dt = Kg.dtype.element_ty
  live_L1 = (tl.load(live + b * Tp + t0 + i_L) != 0)[:, None]
  k_LK = tl.where(live_L1, tl.load(chunk_rows(k, row0, r, 0, Tp, H, K, L, K)).to(tl.float32),
                  0.0)
  q_LK = tl.where(live_L1, tl.load(chunk_rows(q, row0, r, 0, Tp, H, K, L, K)).to(tl.float32),
                  0.0)
  if L2NORM:
    k_LK = k_LK * tl.rsqrt(fp32_sum(k_LK * k_LK, 1) + _EPS)[:, None]
    q_LK = q_LK * tl.rsqrt(fp32_sum(q_LK * q_LK, 1) + _EPS)[:, None]
  f_LK = tl.load(chunk_rows(f, row0, r, 0, Tp, H, K, L, K)).to(tl.float32)
  g_LK, _, _ = _gate(f_LK, tl.load(a + h * K + k_K)[None, :],
                     tl.load(bias + h * K + k_K)[None, :], GATE, LOWER)
  G_LK = tl.associative_scan(tl.where(live_L1, g_LK, 0.0), 0, tl.standard._sum_combine)
  G_end_K = fp32_sum(tl.where((i_L == L - 1)[:, None], G_LK, 0.0), 0)
  mid_K = fp32_sum(tl.where((i_L == L // 2)[:, None], G_LK, 0.0), 0)
  inside = t0 % C != 0            # the tile starts inside its chunk: its segment ids go on
  seg_L = tl.load(seg + b * Tp + t0 + i_L)
  seg_base = tl.load(seg + b * Tp + t0 - 1, mask=inside, other=0)
  seg_end = tl.load(seg + b * Tp + t0 + L - 1)
  beta_L = tl.load(beta + (b * Tp + t0 + i_L) * H + h).to(tl.float32)
  # A and Aqk on decays anchored at the middle row
  left = tl.exp(G_LK - mid_K[None, :])
  right_t = tl.trans(k_LK * tl.exp(mid_K[None, :] - G_LK))
  A_LL = tl.dot(k_LK * left, right_t, input_precision=PREC)
  Aqk_LL = tl.dot(q_LK * left, right_t, input_precision=PREC)
  same = seg_L[:, None] == seg_L[None, :]
  A_LL = tl.where(same & (i_L[:, None] > i_L[None, :]), A_LL, 0.0)
  Aqk_LL = tl.where(same & (i_L[:, None] >= i_L[None, :]), Aqk_LL * SCALE, 0.0)
  eye = tl.where(i_L[:, None] == i_L[None, :], 1.0, 0.0)
  Tb_LL = _inverse(beta_L[:, None] * A_LL, eye, SOLVE) * beta_L[None, :]
  tl.store(chunk_rows(M, row0, r, 0, Tp, H, L, L, L),
           tl.dot(Aqk_LL, Tb_LL, input_precision=SOLVE).to(dt))
  # the state's reach: rows the tile's start state reaches, rows that reach its end
  gamma = tl.where((seg_L == seg_base)[:, None], tl.exp(G_LK), 0.0)
  to_end = tl.where((seg_L == seg_end)[:, None], tl.exp(G_end_K[None, :] - G_LK), 0.0)
  tl.store(chunk_rows(Kg, row0, r, 0, Tp, H, K, L, K), (k_LK * gamma).to(dt))
  tl.store(chunk_rows(Qg, row0, r, 0, Tp, H, K, L, K), (q_LK * gamma * SCALE).to(dt))
  tl.store(chunk_rows(Kt, row0, r, 0, Tp, H, K, L, K),
           tl.dot(tl.trans(Tb_LL), k_LK * to_end, input_precision=PREC).to(dt))
  tl.store(decay + ((b * (Tp // L) + r) * H + h) * K + k_K,
           tl.where(seg_end == seg_base, tl.exp(G_end_K), 0.0))


@triton.jit
def _kda16_recurrence_triton(Kg, Qg, Kt, decay, M, v, S0, O, SN,
                             Tp: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                             V: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
                             NUM_STAGES: tl.constexpr):
  """The state S [K, BV] of V block iv (program id 0) and (b, h) (id 1) in registers across
  all 16-row tiles: X = V - Kg S, O = Qg S + M X, S <- decay ⊙ S + Ktᵀ X. S0, SN
  [B, H, K, V] fp32; O [B, Tp, H, V] in v's dtype."""
  iv = tl.program_id(0)
  bh = tl.program_id(1).to(tl.int64)
  b, h = bh // H, bh % H
  N: tl.constexpr = Tp // L
  dt = Kg.dtype.element_ty
  row0 = b * Tp * H + h
  k_K = tl.arange(0, K)
  S_KV = tl.load(_state(S0, bh, iv, K, V, BV)).to(tl.float32)
  for r in tl.range(0, N, num_stages=NUM_STAGES):
    S_d = S_KV.to(dt)
    Kg_LK = tl.load(chunk_rows(Kg, row0, r, 0, Tp, H, K, L, K))
    v_LV = tl.load(chunk_rows(v, row0, r, iv * BV, Tp, H, V, L, BV)).to(tl.float32)
    X_d = (v_LV - tl.dot(Kg_LK, S_d, input_precision=PREC)).to(dt)
    Kt_LK = tl.load(chunk_rows(Kt, row0, r, 0, Tp, H, K, L, K))
    decay_K = tl.load(decay + ((b * N + r) * H + h) * K + k_K)
    S_next = tl.dot(tl.trans(Kt_LK), X_d, acc=S_KV * decay_K[:, None], input_precision=PREC)
    Qg_LK = tl.load(chunk_rows(Qg, row0, r, 0, Tp, H, K, L, K))
    M_LL = tl.load(chunk_rows(M, row0, r, 0, Tp, H, L, L, L))
    O_LV = tl.dot(M_LL, X_d, acc=tl.dot(Qg_LK, S_d, input_precision=PREC),
                  input_precision=PREC)
    tl.store(chunk_rows(O, row0, r, iv * BV, Tp, H, V, L, BV), O_LV.to(O.dtype.element_ty))
    S_KV = S_next
  tl.store(_state(SN, bh, iv, K, V, BV), S_KV)


def forward_call(q, k, v, g, beta, seg, S0, a_HK, bias_HK, live, *, scale, chunk_size,
                 interpret, gate, lower_bound, qk_l2norm):
  """(O in q's dtype, S_final fp32) of bounded gates from the op's chunk-padded inputs
  (pallas_gpu._stages' arguments): the prepare kernel, grid (Tp/16, B·H), then the
  recurrence, grid (V/BV, B·H)."""
  B, Tp, H, K = q.shape
  V = v.shape[-1]
  dt, N = q.dtype, Tp // ROWS
  rows = lambda D: jax.ShapeDtypeStruct((B, Tp, H, D), dt)
  prec = triton_launch.fp32_dots()
  meta = dict(Tp=Tp, H=H, K=K, C=chunk_size, SCALE=float(scale), PREC=prec,
              SOLVE=triton_gpu_stage1.STAGE1_SOLVE_PREC,
              GATE=triton_gpu_prologue.GATE_CODES[gate], LOWER=float(lower_bound),
              L2NORM=bool(qk_l2norm))
  Kg, Qg, Kt, decay, M = triton_launch.launch(
      _kda16_prepare_triton, (N, B * H),
      (q, k, g, a_HK, bias_HK, live.astype(jnp.int32), beta, seg.astype(jnp.int32)),
      [rows(K), rows(K), rows(K), jax.ShapeDtypeStruct((B, N, H, K), F32), rows(ROWS)],
      meta, name="kda16_prepare_triton", interpret=interpret, warps=FWD16_PREPARE_WARPS,
      max_stages=1, stages=1)
  BV = min(V, FWD16_BLOCK_V)
  O, SN = triton_launch.launch(
      _kda16_recurrence_triton, (V // BV, B * H), (Kg, Qg, Kt, decay, M, v, S0),
      [rows(V), jax.ShapeDtypeStruct((B, H, K, V), F32)],
      dict(Tp=Tp, H=H, K=K, V=V, BV=BV, PREC=prec), name="kda16_recurrence_triton",
      interpret=interpret, warps=FWD16_WARPS, max_stages=triton_gpu.STAGES)
  return O, SN


_STATIC = (0, 11, 12, 13, 14, 15, 16)   # staged, then scale ... qk_l2norm


@functools.partial(jax.custom_vjp, nondiff_argnums=_STATIC)
def core(staged, q, k, v, g, beta, seg, S0, a_HK, bias_HK, live, scale, chunk_size,
         interpret, gate, lower_bound, qk_l2norm):
  """pallas_gpu.kda_pallas_gpu's `core` for bounded gates: (O, S_final). Without a
  backward, the two kernels above; with one, `staged` (the prologue and triton_gpu's
  stages, whose residuals the backward kernels read) and its VJP."""
  return forward_call(q, k, v, g, beta, seg, S0, a_HK, bias_HK, live, scale=scale,
                      chunk_size=chunk_size, interpret=interpret, gate=gate,
                      lower_bound=lower_bound, qk_l2norm=qk_l2norm)


def _core_fwd(staged, q, k, v, g, beta, seg, S0, a_HK, bias_HK, live, *static):
  # the stages' own custom VJPs keep (and name) their residuals inside the pullback
  out, pullback = jax.vjp(lambda q, k, v, g, beta, S0, a_HK, bias_HK: staged(
      q, k, v, g, beta, seg, S0, a_HK, bias_HK, live), q, k, v, g, beta, S0, a_HK, bias_HK)
  return out, pullback


def _core_bwd(staged, scale, chunk_size, interpret, gate, lower_bound, qk_l2norm, pullback,
              cts):
  dq, dk, dv, dg, dbeta, dS0, da, dbias = pullback(cts)
  return dq, dk, dv, dg, dbeta, None, dS0, da, dbias, None


core.defvjp(_core_fwd, _core_bwd)
