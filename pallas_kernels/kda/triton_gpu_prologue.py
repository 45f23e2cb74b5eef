"""KDA's input prologue in native Triton (implementation="triton"): pallas_gpu_prologue.py's
contract and formulas, forward and backward, one program per (chunk, batch·head) [C, K]
block.

Why not the Pallas kernels: the backward's reverse cumsum there is an IEEE fp32 dot with a
[C, C] triangular matrix of ones (Pallas has no reverse scan). That dot holds a [C, K] fp32
accumulator beside the operands: 255 registers a thread at K = 64 and about 1 KB of spills
a thread at K = 128 (H200, ptxas; benchmarks/kda.md), so a few programs fit on an SM and
the kernel ran at a third of its byte floor in the 1B train step (6.1 ms a step). Here the
cumsums are Triton scans (`tl.associative_scan`), which add the rows directly, in fp32 and
in a tree order: no running total is subtracted, so nothing cancels (the first Pallas
version's failure with every gate at the bound).

  forward   q̂ = live·q/‖q‖, k̂ = live·k/‖k‖; g = live·gate(f); G = cumsum of g in the chunk
  backward  dg = reverse cumsum of dG; df, dq, dk elementwise; the gate's parameter
            gradients as per-chunk column sums [B, N, H, K], summed by the caller.

Without the L2 norm and padding (qk=False), q̂ = q and k̂ = k: _kda_gate_triton and
_kda_gate_bwd_triton do the gate's half alone, and q, k and dq̂, dk̂ pass through unchanged.
"""

import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels import triton_launch
from pallas_kernels.kda import pallas_gpu_prologue, triton_gpu
from pallas_kernels.kda.pallas_gpu_prologue import F32, L2_EPS
from pallas_kernels.kda.triton_gpu import chunk_rows, fp32_sum

GATE_CODES = {g: i for i, g in enumerate(pallas_gpu_prologue.GATES)}   # as constexprs: none 0,
                                                                # bounded 1, unbounded 2
_EPS = tl.constexpr(L2_EPS)   # a global read inside a kernel must be a constexpr


@triton.jit
def _sigmoid(x):
  return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _gate(f, a_1K, bias_1K, GATE: tl.constexpr, LOWER: tl.constexpr):
  """(g, dg/df, dg/da) of kda_gate with a = exp(A_log) (pallas_gpu_prologue._gate); for GATE 0
  ("none") g = f and the derivatives are unused."""
  u = f + bias_1K
  if GATE == 1:
    s = _sigmoid(a_1K * u)
    ds = LOWER * s * (1.0 - s)
    return LOWER * s, ds * a_1K, ds * u
  elif GATE == 2:
    e = tl.exp(-tl.abs(u))       # softplus(u) = max(u, 0) + log1p(e^-|u|)
    sp = tl.maximum(u, 0.0) + tl.where(e < 1e-4, e - 0.5 * e * e, tl.log(1.0 + e))
    return -a_1K * sp, -a_1K * _sigmoid(u), -sp
  else:
    return f, f, f


@triton.jit
def _program(live, Tp: tl.constexpr, H: tl.constexpr, C: tl.constexpr):
  """Chunk n (program id 0), b, h (id 1 is b·H + h), row0 = b·Tp·H + h and the chunk's
  live rows as a [C, 1] mask."""
  n = tl.program_id(0)
  bh = tl.program_id(1).to(tl.int64)
  b, h = bh // H, bh % H
  live_C1 = (tl.load(live + b * Tp + n * C + tl.arange(0, C)) != 0)[:, None]
  return n, b, h, b * Tp * H + h, live_C1


@triton.jit
def _normalise(x, xn, row0, n, live_C1, Tp: tl.constexpr, H: tl.constexpr,
               K: tl.constexpr, C: tl.constexpr, L2NORM: tl.constexpr):
  """xn = live·x/‖x‖ per row (live·x without L2NORM), in xn's dtype."""
  x_CK = tl.load(chunk_rows(x, row0, n, 0, Tp, H, K, C, K)).to(tl.float32)
  if L2NORM:
    x_CK = x_CK * tl.rsqrt(fp32_sum(x_CK * x_CK, 1) + _EPS)[:, None]
  tl.store(chunk_rows(xn, row0, n, 0, Tp, H, K, C, K),
           tl.where(live_C1, x_CK, 0.0).to(xn.dtype.element_ty))


@triton.jit
def _normalise_bwd(x, dxn, dx, row0, n, live_C1, Tp: tl.constexpr, H: tl.constexpr,
                   K: tl.constexpr, C: tl.constexpr, L2NORM: tl.constexpr):
  """dx = r·dx̂ - r·x̂·(x̂·dx̂) per row, r = (Σx² + eps)^-1/2 (dx̂ with padding zeroed)."""
  dxn_CK = tl.where(live_C1, tl.load(chunk_rows(dxn, row0, n, 0, Tp, H, K, C, K))
                    .to(tl.float32), 0.0)
  if L2NORM:
    x_CK = tl.load(chunk_rows(x, row0, n, 0, Tp, H, K, C, K)).to(tl.float32)
    r_C1 = tl.rsqrt(fp32_sum(x_CK * x_CK, 1) + _EPS)[:, None]
    xn_CK = x_CK * r_C1
    dxn_CK = r_C1 * (dxn_CK - xn_CK * fp32_sum(xn_CK * dxn_CK, 1)[:, None])
  tl.store(chunk_rows(dx, row0, n, 0, Tp, H, K, C, K), dxn_CK.to(dx.dtype.element_ty))


@triton.jit
def _gate_cumsum(f, a, bias, live_C1, G, row0, n, h, Tp: tl.constexpr, H: tl.constexpr,
                 K: tl.constexpr, C: tl.constexpr, GATE: tl.constexpr, LOWER: tl.constexpr):
  """G = cumsum over the chunk of live·gate(f), fp32."""
  i_K = tl.arange(0, K)
  a_1K = tl.load(a + h * K + i_K)[None, :]
  bias_1K = tl.load(bias + h * K + i_K)[None, :]
  f_CK = tl.load(chunk_rows(f, row0, n, 0, Tp, H, K, C, K)).to(tl.float32)
  g_CK, _, _ = _gate(f_CK, a_1K, bias_1K, GATE, LOWER)
  G_CK = tl.associative_scan(tl.where(live_C1, g_CK, 0.0), 0, tl.standard._sum_combine)
  tl.store(chunk_rows(G, row0, n, 0, Tp, H, K, C, K), G_CK)


@triton.jit
def _kda_prologue_triton(q, k, f, a, bias, live, qn, kn, G,
                         Tp: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                         C: tl.constexpr, GATE: tl.constexpr, LOWER: tl.constexpr,
                         L2NORM: tl.constexpr, NUM_STAGES: tl.constexpr):
  """q, k, f [B, Tp, H, K]; a, bias [H, K] fp32; live [B, Tp] int32 -> q̂, k̂ (their dtype),
  G fp32: one chunk of one (b, h)."""
  n, b, h, row0, live_C1 = _program(live, Tp, H, C)
  _normalise(q, qn, row0, n, live_C1, Tp, H, K, C, L2NORM)
  _normalise(k, kn, row0, n, live_C1, Tp, H, K, C, L2NORM)
  _gate_cumsum(f, a, bias, live_C1, G, row0, n, h, Tp, H, K, C, GATE, LOWER)


@triton.jit
def _kda_gate_triton(f, a, bias, live, G, Tp: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                     C: tl.constexpr, GATE: tl.constexpr, LOWER: tl.constexpr,
                     L2NORM: tl.constexpr, NUM_STAGES: tl.constexpr):
  """_kda_prologue_triton's G alone, where q̂ = q and k̂ = k (qk=False): a copy of q and k
  is half of the prologue's bytes."""
  n, b, h, row0, live_C1 = _program(live, Tp, H, C)
  _gate_cumsum(f, a, bias, live_C1, G, row0, n, h, Tp, H, K, C, GATE, LOWER)


@triton.jit
def _gate_bwd(f, a, bias, live_C1, dG, df, da, dbias, row0, n, b, h, Tp: tl.constexpr,
              H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, GATE: tl.constexpr,
              LOWER: tl.constexpr):
  """dg = reverse cumsum of dG; df in f's dtype; this chunk's column sums of dg·dg/da and df
  into da and dbias."""
  N: tl.constexpr = Tp // C
  i_K = tl.arange(0, K)
  dG_CK = tl.load(chunk_rows(dG, row0, n, 0, Tp, H, K, C, K)).to(tl.float32)
  dg_CK = tl.associative_scan(dG_CK, 0, tl.standard._sum_combine, reverse=True)
  dg_CK = tl.where(live_C1, dg_CK, 0.0)
  part = ((b * N + n) * H + h) * K + i_K
  if GATE == 0:
    tl.store(chunk_rows(df, row0, n, 0, Tp, H, K, C, K), dg_CK.to(df.dtype.element_ty))
    tl.store(da + part, tl.full((K,), 0.0, tl.float32))
    tl.store(dbias + part, tl.full((K,), 0.0, tl.float32))
  else:
    a_1K = tl.load(a + h * K + i_K)[None, :]
    bias_1K = tl.load(bias + h * K + i_K)[None, :]
    f_CK = tl.load(chunk_rows(f, row0, n, 0, Tp, H, K, C, K)).to(tl.float32)
    _, dg_df, dg_da = _gate(f_CK, a_1K, bias_1K, GATE, LOWER)
    df_CK = dg_CK * dg_df
    tl.store(chunk_rows(df, row0, n, 0, Tp, H, K, C, K), df_CK.to(df.dtype.element_ty))
    tl.store(da + part, fp32_sum(dg_CK * dg_da, 0))
    tl.store(dbias + part, fp32_sum(df_CK, 0))


@triton.jit
def _kda_prologue_bwd_triton(q, k, f, a, bias, live, dqn, dkn, dG, dq, dk, df, da, dbias,
                             Tp: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                             C: tl.constexpr, GATE: tl.constexpr, LOWER: tl.constexpr,
                             L2NORM: tl.constexpr, NUM_STAGES: tl.constexpr):
  """The prologue's cotangents for one chunk: dq, dk, df in their inputs' dtypes; da and
  dbias (fp32 [B, N, H, K]) this chunk's column sums of dg·dg/da and df."""
  n, b, h, row0, live_C1 = _program(live, Tp, H, C)
  _normalise_bwd(q, dqn, dq, row0, n, live_C1, Tp, H, K, C, L2NORM)
  _normalise_bwd(k, dkn, dk, row0, n, live_C1, Tp, H, K, C, L2NORM)
  _gate_bwd(f, a, bias, live_C1, dG, df, da, dbias, row0, n, b, h, Tp, H, K, C, GATE, LOWER)


@triton.jit
def _kda_gate_bwd_triton(f, a, bias, live, dG, df, da, dbias, Tp: tl.constexpr,
                         H: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
                         GATE: tl.constexpr, LOWER: tl.constexpr, L2NORM: tl.constexpr,
                         NUM_STAGES: tl.constexpr):
  """_kda_prologue_bwd_triton's df, da and dbias alone (qk=False: dq = dq̂, dk = dk̂)."""
  n, b, h, row0, live_C1 = _program(live, Tp, H, C)
  _gate_bwd(f, a, bias, live_C1, dG, df, da, dbias, row0, n, b, h, Tp, H, K, C, GATE, LOWER)


def _meta(q, gate, lower_bound, l2norm, chunk_size):
  if gate not in GATE_CODES:
    raise ValueError(f"gate must be one of {tuple(GATE_CODES)}, got {gate!r}")
  B, Tp, H, K = q.shape
  return dict(Tp=Tp, H=H, K=K, C=chunk_size, GATE=GATE_CODES[gate],
              LOWER=float(lower_bound or 0.0), L2NORM=bool(l2norm))


def _launch(shape, meta, warps, interpret, kernel, args, out_type):
  """One program per (chunk, b·h), no loop to pipeline; named after the kernel."""
  B, Tp, H, _ = shape
  return triton_launch.launch(kernel, (Tp // meta["C"], B * H), args, out_type, meta,
                              name=kernel.__name__[1:], interpret=interpret, warps=warps,
                              max_stages=1, stages=1)


def prologue_call(q, k, f, a_HK, bias_HK, live, *, dtype, gate, lower_bound, l2norm,
                  chunk_size, interpret, qk=True):
  """pallas_gpu_prologue._prologue_call's (q̂, k̂ in `dtype`, G fp32). Grid (N, B·H). qk=False: q̂
  and k̂ are q and k, returned as they are, and only G is computed (_kda_gate_triton)."""
  meta = _meta(q, gate, lower_bound, l2norm, chunk_size)
  B, Tp, H, K = q.shape
  out = jax.ShapeDtypeStruct((B, Tp, H, K), dtype)
  G_type = jax.ShapeDtypeStruct((B, Tp, H, K), F32)
  launch = functools.partial(_launch, q.shape, meta, triton_gpu.PROLOGUE_WARPS, interpret)
  if not qk and triton_gpu.GATE_ONLY_PROLOGUE:
    G, = launch(_kda_gate_triton, (f, a_HK, bias_HK, live.astype(jnp.int32)), [G_type])
    return q.astype(dtype), k.astype(dtype), G
  return launch(_kda_prologue_triton, (q, k, f, a_HK, bias_HK, live.astype(jnp.int32)),
                [out, out, G_type])


def prologue_bwd_call(q, k, f, a_HK, bias_HK, live, dqn, dkn, dG, *, gate, lower_bound,
                      l2norm, chunk_size, interpret, qk=True):
  """pallas_gpu_prologue._prologue_bwd_call's (dq, dk, df, per-chunk da and dbias); qk=False: dq and
  dk are dq̂ and dk̂ in q's and k's dtypes (_kda_gate_bwd_triton for the rest)."""
  meta = _meta(q, gate, lower_bound, l2norm, chunk_size)
  B, Tp, H, K = q.shape
  like = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  partial = jax.ShapeDtypeStruct((B, Tp // chunk_size, H, K), F32)
  launch = functools.partial(_launch, q.shape, meta, triton_gpu.PROLOGUE_BWD_WARPS, interpret)
  live = live.astype(jnp.int32)
  if not qk and triton_gpu.GATE_ONLY_PROLOGUE:
    df, da, dbias = launch(_kda_gate_bwd_triton, (f, a_HK, bias_HK, live, dG),
                           [like(f), partial, partial])
    return dqn.astype(q.dtype), dkn.astype(k.dtype), df, da, dbias
  return launch(_kda_prologue_bwd_triton, (q, k, f, a_HK, bias_HK, live, dqn, dkn, dG),
                [like(q), like(k), like(f), partial, partial])


# The prologue with these kernels forward and backward (pallas_gpu_prologue.prologue's contract).
prologue = pallas_gpu_prologue.prologue_with_vjp(prologue_call, prologue_bwd_call)
