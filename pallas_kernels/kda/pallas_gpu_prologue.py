"""KDA's input prologue as Pallas GPU kernels, forward and backward: the q/k L2 norm, the
gate, the chunk cumsum and the padding masks, one program per (batch, head, chunk) [C, K]
block (fla's `use_gate_in_kernel` and `use_qk_l2norm_in_kernel`).

In XLA these are element-wise chains with row reductions. In the scanned train step XLA GPU
merged their backward, by sibling multi-output fusion, with unrelated work of other layers
into reductions of 2-4 ms a launch (benchmarks/train.md); a kernel cannot be fused.

  forward   q̂ = live·q/‖q‖,  k̂ = live·k/‖k‖  (‖x‖ = sqrt(Σx² + eps), as l2_normalize)
            g = live·gate(f)  (gate: kda_gate's bounded or legacy form, or f itself)
            G = cumsum of g inside the chunk
  backward  dg = reverse cumsum of dG; df, dq, dk elementwise; the gate's parameter
            gradients as per-chunk column sums [B, N, H, K], summed by the caller.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import residuals

F32 = jnp.float32
L2_EPS = 1e-6   # reference.l2_normalize's
GATES = ("none", "bounded", "unbounded")
WARPS = 4


def _sigmoid(x):
  return 1.0 / (1.0 + jnp.exp(-x))


def _softplus(x):
  return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


def _gate(f, a_1K, bias_1K, gate, lower_bound):
  """(g, dg/df, dg/da) of kda_gate with a = exp(A_log), or of g = f for gate "none"."""
  if gate == "none":
    return f, None, None
  u = f + bias_1K
  if gate == "bounded":
    s = _sigmoid(a_1K * u)
    ds = lower_bound * s * (1.0 - s)
    return lower_bound * s, ds * a_1K, ds * u
  sp = _softplus(u)
  return -a_1K * sp, -a_1K * _sigmoid(u), -sp


def _l2(x):
  """(x / ‖x‖ per row, 1 / ‖x‖ [C, 1])."""
  r = jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + L2_EPS)
  return x * r, r


def _reverse_cumsum(x_CK):
  """Σ_{j ≥ i} x_j as an fp32 (IEEE, not TF32) dot with an upper-triangular matrix of ones:
  exact products, as XLA's transpose of the forward cumsum. Total minus the running sum
  cancelled to 1.2e-4 of the gate's gradient with every gate at the bound (H200)."""
  C = x_CK.shape[0]
  i_CC = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
  j_CC = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
  upper_CC = (j_CC >= i_CC).astype(F32)
  return jax.lax.dot_general(upper_CC, x_CK, (((1,), (0,)), ((), ())),
                             precision=jax.lax.Precision.HIGHEST, preferred_element_type=F32)


def _prologue_kernel(q_ref, k_ref, f_ref, a_ref, bias_ref, live_ref, qn_ref, kn_ref, G_ref,
                     *, gate, lower_bound, l2norm):
  live_C1 = (live_ref[...] != 0)[:, None]
  for x_ref, out_ref in ((q_ref, qn_ref), (k_ref, kn_ref)):
    x = x_ref[...].astype(F32)
    if l2norm:
      x, _ = _l2(x)
    out_ref[...] = jnp.where(live_C1, x, 0.0).astype(out_ref.dtype)
  a_1K, bias_1K = a_ref[...].reshape(1, -1), bias_ref[...].reshape(1, -1)
  g, _, _ = _gate(f_ref[...].astype(F32), a_1K, bias_1K, gate, lower_bound)
  G_ref[...] = jnp.cumsum(jnp.where(live_C1, g, 0.0), axis=0)


def _prologue_bwd_kernel(q_ref, k_ref, f_ref, a_ref, bias_ref, live_ref, dqn_ref, dkn_ref,
                         dG_ref, dq_ref, dk_ref, df_ref, da_ref, dbias_ref,
                         *, gate, lower_bound, l2norm):
  live_C1 = (live_ref[...] != 0)[:, None]
  for x_ref, dxn_ref, dx_ref in ((q_ref, dqn_ref, dq_ref), (k_ref, dkn_ref, dk_ref)):
    dxn = jnp.where(live_C1, dxn_ref[...].astype(F32), 0.0)
    if l2norm:    # x̂ = x·r, r = (Σx² + eps)^-1/2:  dx = r·dx̂ - r·x̂·(x̂·dx̂)
      xn, r = _l2(x_ref[...].astype(F32))
      dxn = r * (dxn - xn * jnp.sum(xn * dxn, axis=1, keepdims=True))
    dx_ref[...] = dxn.astype(dx_ref.dtype)
  dg = jnp.where(live_C1, _reverse_cumsum(dG_ref[...].astype(F32)), 0.0)
  a_1K, bias_1K = a_ref[...].reshape(1, -1), bias_ref[...].reshape(1, -1)
  _, dg_df, dg_da = _gate(f_ref[...].astype(F32), a_1K, bias_1K, gate, lower_bound)
  if gate == "none":
    df_ref[...] = dg.astype(df_ref.dtype)
    da_ref[...] = jnp.zeros(da_ref.shape, F32)
    dbias_ref[...] = jnp.zeros(dbias_ref.shape, F32)
    return
  df = dg * dg_df
  df_ref[...] = df.astype(df_ref.dtype)
  da_ref[...] = jnp.sum(dg * dg_da, axis=0)
  dbias_ref[...] = jnp.sum(df, axis=0)


def _specs(C, K):
  rows = pl.BlockSpec((None, C, None, K), lambda b, h, n: (b, n, h, 0))
  per_head = pl.BlockSpec((None, K), lambda b, h, n: (h, 0))
  live = pl.BlockSpec((None, C), lambda b, h, n: (b, n))
  per_chunk = pl.BlockSpec((None, None, None, K), lambda b, h, n: (b, n, h, 0))
  return rows, per_head, live, per_chunk


def _params(interpret):
  return None if interpret else pltriton.CompilerParams(num_warps=WARPS, num_stages=1)


def _prologue_call(q, k, f, a_HK, bias_HK, live, *, dtype, gate, lower_bound, l2norm,
                   chunk_size, interpret, qk=True):
  del qk   # these kernels always write q̂ and k̂ (equal to q and k where qk is False)
  if gate not in GATES:
    raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
  B, Tp, H, K = q.shape
  C = chunk_size
  rows, per_head, live_spec, _ = _specs(C, K)
  out = jax.ShapeDtypeStruct((B, Tp, H, K), dtype)
  return pl.pallas_call(
      functools.partial(_prologue_kernel, gate=gate, lower_bound=lower_bound, l2norm=l2norm),
      grid=(B, H, Tp // C), in_specs=[rows, rows, rows, per_head, per_head, live_spec],
      out_specs=[rows] * 3, out_shape=[out, out, jax.ShapeDtypeStruct((B, Tp, H, K), F32)],
      interpret=interpret, name="kda_prologue", compiler_params=_params(interpret),
  )(q, k, f, a_HK, bias_HK, live)


def _prologue_bwd_call(q, k, f, a_HK, bias_HK, live, dqn, dkn, dG, *, gate, lower_bound,
                       l2norm, chunk_size, interpret, qk=True):
  del qk
  B, Tp, H, K = q.shape
  C, N = chunk_size, Tp // chunk_size
  rows, per_head, live_spec, per_chunk = _specs(C, K)
  like = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  partial = jax.ShapeDtypeStruct((B, N, H, K), F32)
  return pl.pallas_call(
      functools.partial(_prologue_bwd_kernel, gate=gate, lower_bound=lower_bound,
                        l2norm=l2norm),
      grid=(B, H, N),
      in_specs=[rows, rows, rows, per_head, per_head, live_spec, rows, rows, rows],
      out_specs=[rows, rows, rows, per_chunk, per_chunk],
      out_shape=[like(q), like(k), like(f), partial, partial],
      interpret=interpret, name="kda_prologue_bwd", compiler_params=_params(interpret),
  )(q, k, f, a_HK, bias_HK, live, dqn, dkn, dG)


def prologue_with_vjp(call, bwd_call):
  """The prologue as a custom VJP over these launchers (this module's Pallas kernels, or
  prologue_triton's): call(q, k, f, a_HK, bias_HK, live, dtype=, gate=, lower_bound=,
  l2norm=, chunk_size=, interpret=, qk=) -> (q̂, k̂, G); bwd_call(..., dqn, dkn, dG, gate=,
  ...) -> (dq, dk, df, per-chunk da and dbias [B, N, H, K] fp32). qk=False promises q̂ = q
  and k̂ = k (no L2 norm, no padding, q and k already in `dtype`): a launcher may then return
  them and dq̂, dk̂ as they are instead of copying them through its kernel."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11, 12))
  def prologue(q, k, f, a_HK, bias_HK, live, dtype, gate, lower_bound, l2norm, chunk_size,
               interpret, qk=True):
    """(q̂, k̂ in `dtype`, G fp32), each [B, Tp, H, K]; Tp a multiple of chunk_size.

    f is the gate input (the log-decay g itself for gate "none"); a_HK = exp(A_log) and
    bias_HK = dt_bias as [H, K] fp32 (ignored for "none"); live [B, Tp] int, 0 = padding.
    """
    return call(q, k, f, a_HK, bias_HK, live, dtype=dtype, gate=gate,
                lower_bound=lower_bound, l2norm=l2norm, chunk_size=chunk_size,
                interpret=interpret, qk=qk)

  def fwd(q, k, f, a_HK, bias_HK, live, dtype, gate, lower_bound, l2norm, chunk_size,
          interpret, qk=True):
    out = prologue(q, k, f, a_HK, bias_HK, live, dtype, gate, lower_bound, l2norm,
                   chunk_size, interpret, qk)
    return out, residuals.tag((q, k, f, a_HK, bias_HK, live))

  def bwd(dtype, gate, lower_bound, l2norm, chunk_size, interpret, qk, res, cts):
    q, k, f, a_HK, bias_HK, live = res
    dqn, dkn, dG = cts
    dq, dk, df, da_BNHK, dbias_BNHK = bwd_call(
        q, k, f, a_HK, bias_HK, live, dqn, dkn, dG.astype(F32), gate=gate,
        lower_bound=lower_bound, l2norm=l2norm, chunk_size=chunk_size, interpret=interpret,
        qk=qk)
    da_HK = jnp.sum(da_BNHK, axis=(0, 1)).astype(a_HK.dtype)
    dbias_HK = jnp.sum(dbias_BNHK, axis=(0, 1)).astype(bias_HK.dtype)
    return dq, dk, df, da_HK, dbias_HK, None

  prologue.defvjp(fwd, bwd)
  return prologue


# The prologue with the Pallas kernels forward and backward.
prologue = prologue_with_vjp(_prologue_call, _prologue_bwd_call)
