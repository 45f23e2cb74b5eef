"""KDA's bounded-gate forward at a 16-row step, as two kernels (implementation="triton",
FWD16 below): a parallel prepare kernel and a lean recurrence, FlashKDA's split
(benchmarks/kda.md).

triton_gpu's forward runs four kernels after the prologue at chunk C (tiles, solve, W/U,
recurrence). Here each 16-row tile t (inside a chunk of C, G its chunk cumsum) is prepared
by one program, with every exponential and the tile's solve:

  Γ_i = e^{G_i - G_base} (0 past a reset)   Kd_i = k_i e^{G_end - G_i}   decay = e^{G_end - G_base}
  A = strictly lower (k_i · k_j e^{G_i - G_j}), Aqk = scale · lower (q_i · k_j e^{G_i - G_j})
  Tβ = (I + Diag(β) A)^-1 Diag(β)     M = Aqk Tβ     Kt = Tβᵀ Kd

(G_base: the row before the tile, or the chunk start; every pair of rows in one segment,
each [16, 16] block anchored at the tile's middle row: factors ≤ e^{40} at the bound 5),
stored as Kg = K⊙Γ, Qg = scale·Q⊙Γ, Kt (q's dtype), decay (fp32) and M. The chunked delta
rule at chunk 16 (U = Tβ (V - Kg S), O = Qg S + Aqk U, S <- decay ⊙ S + Kdᵀ U) with U
folded into M and Kt leaves the recurrence program of one (V block, batch·head) per tile

  X = V - Kg S     O = Qg S + M X     S <- decay ⊙ S + Ktᵀ X

two dependent dots on the state's chain (Kg S, then Ktᵀ X) and two beside it. The op's
forward without a backward takes this path (core's primal); the training forward is
triton_gpu's, whose residuals the backward kernels read (core's VJP)."""

import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels import residuals, triton_launch
from pallas_kernels.kda import triton_gpu, triton_gpu_stage1
# (_state_block: Triton's interpreter looks _state's callee up in this module)
from pallas_kernels.kda.triton_gpu import _state, _state_block, chunk_rows  # noqa: F401
from pallas_kernels.kda.triton_gpu_stage1 import _inverse

F32 = jnp.float32
ROWS = 16                # rows a step
L = tl.constexpr(ROWS)   # (the kernels' copy)

FWD16 = False              # bounded gates' forward without a backward at a 16-row step; not
                           # yet timed against triton_gpu's
FWD16_PREPARE_WARPS = 4    # sm_90a, bf16: 166 / 248 registers at K = 64 / 128, no spills (2
                           # warps spill 144 bytes at 128)
FWD16_WARPS = 4            # the recurrence: 89 / 123 registers at K = V = 64 / 128, 3 stages
                           # (BV 64: 120 / 178)
FWD16_BLOCK_V = 32         # V columns a recurrence program (triton_gpu.BLOCK_V's reason)


@triton.jit
def _kda16_prepare_triton(q, k, G, beta, seg, Kg, Qg, Kt, decay, M,
                          Tp: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                          C: tl.constexpr, SCALE: tl.constexpr, PREC: tl.constexpr,
                          SOLVE: tl.constexpr, NUM_STAGES: tl.constexpr):
  """Tile r (program id 0; 16 rows) of (b, h) (id 1): q, k, G [B, Tp, H, K] (G the cumsum
  in chunks of C); β [B, Tp, H] fp32; seg [B, Tp] int32 (chunk-local segment ids). Writes
  Kg, Qg, Kt [B, Tp, H, K] and M [B, Tp, H, 16] in Kg's dtype, decay [B, Tp/16, H, K]
  fp32."""
  r = tl.program_id(0)
  bh = tl.program_id(1).to(tl.int64)
  b, h = bh // H, bh % H
  row0 = b * Tp * H + h
  t0 = r * L
  i_L, k_K = tl.arange(0, L), tl.arange(0, K)
  dt = Kg.dtype.element_ty
  inside = t0 % C != 0            # the tile starts inside its chunk: G and seg go on
  G_LK = tl.load(chunk_rows(G, row0, r, 0, Tp, H, K, L, K)).to(tl.float32)
  G_base_K = tl.load(G + (row0 + (t0 - 1) * H) * K + k_K, mask=(k_K < K) & inside, other=0.0)
  G_end_K = tl.load(G + (row0 + (t0 + L - 1) * H) * K + k_K)
  mid_K = tl.load(G + (row0 + (t0 + L // 2) * H) * K + k_K)
  seg_L = tl.load(seg + b * Tp + t0 + i_L)
  seg_base = tl.load(seg + b * Tp + t0 - 1, mask=inside, other=0)
  seg_end = tl.load(seg + b * Tp + t0 + L - 1)
  beta_L = tl.load(beta + (b * Tp + t0 + i_L) * H + h).to(tl.float32)
  k_LK = tl.load(chunk_rows(k, row0, r, 0, Tp, H, K, L, K)).to(tl.float32)
  q_LK = tl.load(chunk_rows(q, row0, r, 0, Tp, H, K, L, K)).to(tl.float32)
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
  gamma = tl.where((seg_L == seg_base)[:, None], tl.exp(G_LK - G_base_K[None, :]), 0.0)
  to_end = tl.where((seg_L == seg_end)[:, None], tl.exp(G_end_K[None, :] - G_LK), 0.0)
  tl.store(chunk_rows(Kg, row0, r, 0, Tp, H, K, L, K), (k_LK * gamma).to(dt))
  tl.store(chunk_rows(Qg, row0, r, 0, Tp, H, K, L, K), (q_LK * gamma * SCALE).to(dt))
  tl.store(chunk_rows(Kt, row0, r, 0, Tp, H, K, L, K),
           tl.dot(tl.trans(Tb_LL), k_LK * to_end, input_precision=PREC).to(dt))
  tl.store(decay + ((b * (Tp // L) + r) * H + h) * K + k_K,
           tl.where(seg_end == seg_base, tl.exp(G_end_K - G_base_K), 0.0))


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


def forward_call(q, k, v, G, beta, seg, S0, *, scale, chunk_size, interpret):
  """(O in q's dtype, S_final fp32) of bounded gates: the prepare kernel, grid (Tp/16, B·H),
  then the recurrence, grid (V/BV, B·H)."""
  B, Tp, H, K = q.shape
  V = v.shape[-1]
  dt, N = q.dtype, Tp // ROWS
  rows = lambda D: jax.ShapeDtypeStruct((B, Tp, H, D), dt)
  prec = triton_launch.fp32_dots()
  meta = dict(Tp=Tp, H=H, K=K, C=chunk_size, SCALE=float(scale), PREC=prec,
              SOLVE=triton_gpu_stage1.STAGE1_SOLVE_PREC)
  Kg, Qg, Kt, decay, M = triton_launch.launch(
      _kda16_prepare_triton, (N, B * H), (q, k, G, beta, seg.astype(jnp.int32)),
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def core(q, k, v, G, beta, seg, S0, scale, chunk_size, interpret):
  """Stages 1 and 2 of bounded gates (pallas_gpu.kda_pallas_gpu's `core`): (O, S_final)."""
  return forward_call(q, k, v, G, beta, seg, S0, scale=scale, chunk_size=chunk_size,
                      interpret=interpret)


def _core_fwd(q, k, v, G, beta, seg, S0, scale, chunk_size, interpret):
  """The training forward: triton_gpu's stage 1 and recurrence, their residuals kept."""
  st, A, T = triton_gpu_stage1.intra_fused(q, k, v, G, beta, seg, scale=scale,
                                           chunk_size=chunk_size, interpret=interpret)
  O, SN = triton_gpu._recurrence_call(st, S0, chunk_size=chunk_size, with_states=False,
                                      interpret=interpret)
  q, k, G = residuals.tag((q, k, G), residuals.CHEAP)
  v, beta, seg, A, T, st, S0 = residuals.tag((v, beta, seg, A, T, st, S0))
  return (O, SN), (q, k, v, G, beta, seg, A, T, st, S0)


def _core_bwd(scale, chunk_size, interpret, res, cts):
  """Stage 2's backward from recomputed chunk states, then stage 1's (recurrence_vjp and
  pallas_gpu.intra_with_vjp's, chained)."""
  q, k, v, G, beta, seg, A, T, st, S0 = res
  dO, dSN = cts
  kw = dict(chunk_size=chunk_size, interpret=interpret)
  _, _, states = triton_gpu._recurrence_call(st, S0, with_states=True, **kw)
  d_st, dS0 = triton_gpu._recurrence_bwd_call(st, states, dO, dSN, **kw)
  d_st = {n: d_st[n].astype(st[n].dtype) for n in st}
  grads = triton_gpu.intra_bwd_triton(q, k, v, G, beta, seg, A, T, d_st, scale=scale, **kw)
  return (*(g.astype(x.dtype) for g, x in zip(grads, (q, k, v, G, beta))), None,
          dS0.astype(S0.dtype))


core.defvjp(_core_fwd, _core_bwd)
