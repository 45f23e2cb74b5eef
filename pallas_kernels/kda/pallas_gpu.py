"""KDA chunked kernels in Pallas (Triton lowering on GPU, `interpret=True` on CPU).

Three kernels, each named after the tile it computes (math in reference.py):
  _intra_kernel        grid (B, H, N): one chunk of C rows as C/16 sub-chunks. Decays
                       anchored per sub-chunk (reference._sub_chunk_decays) so every tile
                       is a matmul; (I + Diag(β)A)^-1
                       by forward substitution on the 16×16 diagonal blocks (registers
                       only) and block substitution off the diagonal. Emits W, U0, Qg, Kd,
                       Aqk, decay.
  _recurrence_kernel   grid (B, H, V/BV): the state S [K, BV] stays in registers across
                       all chunks (one launch for the whole sequence); emits O, the final
                       state, and, for the backward pass only, each chunk's start state.
  _recurrence_bwd_kernel  grid (B, H, V/BV): the same loop in reverse carrying dS; emits
                       the cotangents of the stage-1 tensors (V-block partial sums for
                       those that contract over V) and of S0.

Gradients: the recurrence has its own VJP (the two recurrence kernels; chunk states are
recomputed, not stored by the forward). Stage 1's VJP is the XLA VJP of
`reference.chunk_intra`, recomputed in the backward pass.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.kda import reference

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


def _intra_kernel(q_ref, k_ref, v_ref, G_ref, beta_ref, seg_ref,
                  W_ref, U0_ref, Qg_ref, Kd_ref, Aqk_ref, decay_ref, *, scale):
  C = q_ref.shape[0]
  L, S = SUB, C // SUB
  rows = lambda ref, a: ref[pl.ds(a * L, L), :].astype(F32)
  q = [rows(q_ref, a) for a in range(S)]
  k = [rows(k_ref, a) for a in range(S)]
  G = [rows(G_ref, a) for a in range(S)]
  beta = [beta_ref[pl.ds(a * L, L)].astype(F32) for a in range(S)]
  seg = [seg_ref[pl.ds(a * L, L)] for a in range(S)]
  G_last = [G_ref[pl.ds(a * L + L - 1, 1), :].astype(F32) for a in range(S)]   # [1, K]
  G_mid = [G_ref[pl.ds(a * L + L // 2, 1), :].astype(F32) for a in range(S)]
  seg_end = seg_ref[pl.ds(C - 1, 1)]                      # [1]

  i_LL = jax.lax.broadcasted_iota(jnp.int32, (L, L), 0)
  j_LL = jax.lax.broadcasted_iota(jnp.int32, (L, L), 1)
  A, T = {}, {}
  for a in range(S):
    for b in range(a + 1):
      anchor = G_mid[a] if a == b else G_last[b]
      # Bounded gate: factors within e^±40 on the diagonal (anchor: middle row), ≤ 1 off it.
      k_left = k[a] * jnp.exp(G[a] - anchor)
      q_left = q[a] * jnp.exp(G[a] - anchor)
      k_right = k[b] * jnp.exp(anchor - G[b])
      same = seg[a][:, None] == seg[b][None, :]
      causal_strict = (i_LL > j_LL) if a == b else (i_LL >= 0)
      causal_incl = (i_LL >= j_LL) if a == b else (i_LL >= 0)
      A[a, b] = jnp.where(same & causal_strict, _dot_t(k_left, k_right), 0.0)
      Aqk = jnp.where(same & causal_incl, _dot_t(q_left, k_right), 0.0) * scale
      Aqk_ref[pl.ds(a * L, L), pl.ds(b * L, L)] = Aqk.astype(Aqk_ref.dtype)
    for b in range(a + 1, S):
      Aqk_ref[pl.ds(a * L, L), pl.ds(b * L, L)] = jnp.zeros((L, L), Aqk_ref.dtype)

  # T = (I + Diag(β) A)^-1 by blocks: diagonal by substitution, then
  # T_ab = -T_aa Σ_{b≤c<a} β_a A_ac T_cb.
  for a in range(S):
    T[a, a] = _inv_unit_lower(beta[a][:, None] * A[a, a])
    for b in range(a):
      acc = sum(_dot(beta[a][:, None] * A[a, c], T[c, b]) for c in range(b, a))
      T[a, b] = -_dot(T[a, a], acc)

  from_start = [(s == 0)[:, None] for s in seg]
  to_end = [(s == seg_end)[:, None] for s in seg]
  G_end = G_last[S - 1]
  X = [beta[b][:, None] * k[b] * jnp.where(from_start[b], jnp.exp(G[b]), 0.0) for b in range(S)]
  Y = [beta[b][:, None] * v_ref[pl.ds(b * L, L), :].astype(F32) for b in range(S)]
  for a in range(S):
    W = sum(_dot(T[a, b], X[b]) for b in range(a + 1))
    U0 = sum(_dot(T[a, b], Y[b]) for b in range(a + 1))
    W_ref[pl.ds(a * L, L), :] = W.astype(W_ref.dtype)
    U0_ref[pl.ds(a * L, L), :] = U0.astype(U0_ref.dtype)
    Qg = q[a] * jnp.where(from_start[a], jnp.exp(G[a]), 0.0) * scale
    Qg_ref[pl.ds(a * L, L), :] = Qg.astype(Qg_ref.dtype)
    Kd = k[a] * jnp.where(to_end[a], jnp.exp(G_end - G[a]), 0.0)
    Kd_ref[pl.ds(a * L, L), :] = Kd.astype(Kd_ref.dtype)
  decay_ref[...] = jnp.where(seg_end == 0, jnp.exp(G_end), 0.0).reshape(-1).astype(decay_ref.dtype)


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
                           dO_ref, dSN_ref,
                           dW_ref, dU0_ref, dQg_ref, dKd_ref, dAqk_ref, ddecay_ref, dS0_ref,
                           *, chunk_size):
  C = chunk_size
  N = W_ref.shape[0] // C
  dot_dtype = W_ref.dtype
  S_KV_shape = dSN_ref.shape

  def body(i, dS_KV):
    n = N - 1 - i
    t = pl.ds(pl.multiple_of(n * C, C), C)
    S_KV = states_ref[pl.ds(n, 1), :, :].reshape(S_KV_shape)
    W, Qg, Kd, Aqk = W_ref[t, :], Qg_ref[t, :], Kd_ref[t, :], Aqk_ref[t, :]
    dO = dO_ref[t, :].astype(dot_dtype)
    S_d, dS_d = S_KV.astype(dot_dtype), dS_KV.astype(dot_dtype)
    U_CV = U0_ref[t, :].astype(F32) - _dot(W, S_d)
    dU_CV = _t_dot(Aqk, dO) + _dot(Kd, dS_d)
    dU_d = dU_CV.astype(dot_dtype)
    dAqk_ref[t, :] = _dot_t(dO, U_CV.astype(dot_dtype)).astype(dAqk_ref.dtype)
    dQg_ref[t, :] = _dot_t(dO, S_d).astype(dQg_ref.dtype)
    dKd_ref[t, :] = _dot_t(U_CV.astype(dot_dtype), dS_d).astype(dKd_ref.dtype)
    dW_ref[t, :] = (-_dot_t(dU_d, S_d)).astype(dW_ref.dtype)
    dU0_ref[t, :] = dU_CV.astype(dU0_ref.dtype)
    ddecay_ref[pl.ds(n, 1), :] = jnp.sum(S_KV * dS_KV, axis=1)[None, :].astype(ddecay_ref.dtype)
    decay_K1 = decay_ref[pl.ds(n, 1), :].reshape(-1, 1)
    return decay_K1 * dS_KV + _t_dot(Qg, dO) - _t_dot(W, dU_d)

  dS0_ref[...] = jax.lax.fori_loop(0, N, body, dSN_ref[...].astype(F32)).astype(dS0_ref.dtype)


def _params(num_warps, num_stages, interpret):
  return None if interpret else pltriton.CompilerParams(num_warps=num_warps,
                                                        num_stages=num_stages)


# Launch knobs (tuned by scripts/profile_kda_stages.py on the H200).
INTRA_WARPS = 4
RECURRENCE_WARPS = 4
BLOCK_V = 32


def intra_pallas(q, k, v, G, beta, seg, *, scale, chunk_size, interpret):
  """Stage 1 as one Pallas kernel; same outputs as reference.chunk_intra(bounded=True)."""
  B, Tp, H, K = q.shape
  V = v.shape[-1]
  C, N = chunk_size, Tp // chunk_size
  dt = q.dtype

  def rows(D):
    return pl.BlockSpec((None, C, None, D), lambda b, h, n: (b, n, h, 0))

  out_shape = (jax.ShapeDtypeStruct((B, Tp, H, K), dt),    # W
               jax.ShapeDtypeStruct((B, Tp, H, V), dt),    # U0
               jax.ShapeDtypeStruct((B, Tp, H, K), dt),    # Qg
               jax.ShapeDtypeStruct((B, Tp, H, K), dt),    # Kd
               jax.ShapeDtypeStruct((B, Tp, H, C), dt),    # Aqk
               jax.ShapeDtypeStruct((B, N, H, K), F32))    # decay
  W, U0, Qg, Kd, Aqk, decay = pl.pallas_call(
      functools.partial(_intra_kernel, scale=scale),
      grid=(B, H, N),
      in_specs=[rows(K), rows(K), rows(V), rows(K),
                pl.BlockSpec((None, C, None), lambda b, h, n: (b, n, h)),
                pl.BlockSpec((None, C), lambda b, h, n: (b, n))],
      out_specs=[rows(K), rows(V), rows(K), rows(K), rows(C),
                 pl.BlockSpec((None, None, None, K), lambda b, h, n: (b, n, h, 0))],
      out_shape=out_shape, interpret=interpret, name="kda_intra",
      compiler_params=_params(INTRA_WARPS, 1, interpret),
  )(q, k, v, G, beta, seg)
  return {"W": W, "U0": U0, "Qg": Qg, "Kd": Kd, "Aqk": Aqk, "decay": decay}


def _block_v(V):
  return min(V, BLOCK_V)


def _recurrence_call(st, S0, *, chunk_size, with_states, interpret):
  B, Tp, H, K = st["W"].shape
  V = st["U0"].shape[-1]
  C, N, BV = chunk_size, Tp // chunk_size, _block_v(V)
  full = lambda D: pl.BlockSpec((None, Tp, None, D), lambda b, h, j: (b, 0, h, 0))
  vblk = pl.BlockSpec((None, Tp, None, BV), lambda b, h, j: (b, 0, h, j))
  state = pl.BlockSpec((None, None, K, BV), lambda b, h, j: (b, h, 0, j))
  out_shape = [jax.ShapeDtypeStruct((B, Tp, H, V), F32), jax.ShapeDtypeStruct((B, H, K, V), F32)]
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
  C, N, BV = chunk_size, Tp // chunk_size, _block_v(V)
  J = V // BV
  full = lambda D: pl.BlockSpec((None, Tp, None, D), lambda b, h, j: (b, 0, h, 0))
  vblk = pl.BlockSpec((None, Tp, None, BV), lambda b, h, j: (b, 0, h, j))
  part = lambda D: pl.BlockSpec((None, None, Tp, None, D), lambda b, h, j: (j, b, 0, h, 0))
  state = pl.BlockSpec((None, None, K, BV), lambda b, h, j: (b, h, 0, j))
  decay_spec = pl.BlockSpec((None, N, None, K), lambda b, h, j: (b, 0, h, 0))
  out_shape = (jax.ShapeDtypeStruct((J, B, Tp, H, K), F32),   # dW (partial over V blocks)
               jax.ShapeDtypeStruct((B, Tp, H, V), F32),      # dU0
               jax.ShapeDtypeStruct((J, B, Tp, H, K), F32),   # dQg
               jax.ShapeDtypeStruct((J, B, Tp, H, K), F32),   # dKd
               jax.ShapeDtypeStruct((J, B, Tp, H, C), F32),   # dAqk
               jax.ShapeDtypeStruct((J, B, N, H, K), F32),    # ddecay
               jax.ShapeDtypeStruct((B, H, K, V), F32))       # dS0
  outs = pl.pallas_call(
      functools.partial(_recurrence_bwd_kernel, chunk_size=C),
      grid=(B, H, J),
      in_specs=[full(K), vblk, full(K), full(K), full(C), decay_spec,
                pl.BlockSpec((None, None, N, K, BV), lambda b, h, j: (b, h, 0, 0, j)),
                vblk, state],
      out_specs=[part(K), vblk, part(K), part(K), part(C),
                 pl.BlockSpec((None, None, N, None, K), lambda b, h, j: (j, b, 0, h, 0)), state],
      out_shape=out_shape, interpret=interpret, name="kda_recurrence_bwd",
      compiler_params=_params(RECURRENCE_WARPS, 2, interpret),
  )(st["W"], st["U0"], st["Qg"], st["Kd"], st["Aqk"], st["decay"], states, dO, dSN)
  dW, dU0, dQg, dKd, dAqk, ddecay, dS0 = outs
  return ({"W": dW.sum(0), "U0": dU0, "Qg": dQg.sum(0), "Kd": dKd.sum(0), "Aqk": dAqk.sum(0),
           "decay": ddecay.sum(0)}, dS0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def recurrence(st, S0, chunk_size, interpret):
  """Stage 2 with a Pallas forward and backward. Returns (o fp32 [B,Tp,H,V], S fp32)."""
  O, S = _recurrence_call(st, S0, chunk_size=chunk_size, with_states=False, interpret=interpret)
  return O, S


def _recurrence_fwd(st, S0, chunk_size, interpret):
  return recurrence(st, S0, chunk_size, interpret), (st, S0)


def _recurrence_bwd(chunk_size, interpret, res, cts):
  st, S0 = res
  dO, dSN = cts
  _, _, states = _recurrence_call(st, S0, chunk_size=chunk_size, with_states=True,
                                  interpret=interpret)   # recomputed chunk-start states
  d_st, dS0 = _recurrence_bwd_call(st, states, dO, dSN, chunk_size=chunk_size,
                                   interpret=interpret)
  d_st = {n: d_st[n].astype(st[n].dtype) for n in st}
  return d_st, dS0.astype(S0.dtype)


recurrence.defvjp(_recurrence_fwd, _recurrence_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def intra(q, k, v, G, beta, seg, scale, chunk_size, interpret):
  """Stage 1: Pallas forward; backward is the VJP of the XLA stage (recomputed)."""
  return intra_pallas(q, k, v, G, beta, seg, scale=scale, chunk_size=chunk_size,
                      interpret=interpret)


def _intra_xla(q, k, v, G, beta, seg, scale, chunk_size, bounded=True):
  """reference.chunk_intra in fp32, outputs stored like the kernel's (input dtype)."""
  out = reference.chunk_intra(q.astype(F32), k.astype(F32), v.astype(F32), G, beta, seg,
                              scale=scale, chunk_size=chunk_size, bounded=bounded)
  return {n: x.astype(q.dtype) if n != "decay" else x for n, x in out.items()}


def _intra_fwd(q, k, v, G, beta, seg, scale, chunk_size, interpret):
  return intra(q, k, v, G, beta, seg, scale, chunk_size, interpret), (q, k, v, G, beta, seg)


def _intra_bwd(scale, chunk_size, interpret, res, d_st):
  q, k, v, G, beta, seg = res
  _, vjp = jax.vjp(lambda *a: _intra_xla(*a, seg, scale, chunk_size), q, k, v, G, beta)
  return (*vjp(d_st), None)


intra.defvjp(_intra_fwd, _intra_bwd)


def kda_pallas_gpu(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None,
                   chunk_size=64, bounded=True, interpret=None):
  """Chunked KDA on the Pallas kernels. Unbounded gates take the safe XLA stage 1."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  scale = K ** -0.5 if scale is None else scale
  dt = q.dtype if q.dtype in (jnp.bfloat16, jnp.float16) else F32
  q, k, v, g, beta, reset = reference.prepare(q, k, v, g, beta, segment_ids, dtype=dt)
  q, k, v, beta, G, seg = reference.chunk_layout(q, k, v, g, beta, reset, chunk_size)
  if bounded:
    st = intra(q, k, v, G, beta, seg, scale, chunk_size, interpret)
  else:  # unbounded gates: diagonal tiles elementwise in fp32 (the safe path)
    st = _intra_xla(q, k, v, G, beta, seg, scale, chunk_size, bounded=False)
  S0 = jnp.zeros((B, H, K, V), F32) if initial_state is None else initial_state.astype(F32)
  O, S = recurrence(st, S0, chunk_size, interpret)
  return O[:, :T], S
