"""Pure-JAX KDA: the recurrent spec and the chunked (WY / UT) form. Any backend, differentiable.

  S_t = (I - β_t k_t k_tᵀ) Diag(exp g_t) S_{t-1} + β_t k_t v_tᵀ,   o_t = scale · S_tᵀ q_t

Segments (packed documents): the state resets to zero where the segment id
changes to a nonzero id; padding positions (id 0) leave the state untouched
and output zeros. Both forms run on `prepare`d inputs so they agree by
construction on these rules.
"""

import jax
import jax.numpy as jnp


def compute_dtype(*xs):
  """float32 accumulation, or float64 when any input is float64 (the test spec)."""
  return jnp.result_type(jnp.float32, *(x.dtype for x in xs))


def prepare(q, k, v, g, beta, segment_ids):
  """Inputs in fp32 (fp64 if given) with padding made inert, plus a reset flag [B,T]."""
  dt = compute_dtype(q, k, v, g, beta)
  q, k, v, g, beta = (x.astype(dt) for x in (q, k, v, g, beta))
  B, T = q.shape[:2]
  if segment_ids is None:
    return q, k, v, g, beta, jnp.zeros((B, T), bool)
  seg_BxT = segment_ids.astype(jnp.int32)
  live_BxT = seg_BxT != 0
  prev_BxT = jnp.pad(seg_BxT, ((0, 0), (1, 0)))[:, :-1]
  reset_BxT = live_BxT & (seg_BxT != prev_BxT)
  reset_BxT = reset_BxT.at[:, 0].set(False)  # position 0 continues from initial_state
  m4 = live_BxT[:, :, None, None]
  return (q * m4, k * m4, v * m4, g * m4, beta * live_BxT[:, :, None], reset_BxT)


def kda_recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None):
  """One token at a time (lax.scan over T). Returns (o [B,T,H,V] float32, S [B,H,K,V])."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  scale = K ** -0.5 if scale is None else scale
  q, k, v, g, beta, reset_BxT = prepare(q, k, v, g, beta, segment_ids)
  S_BxHxKxV = (jnp.zeros((B, H, K, V), q.dtype) if initial_state is None
               else initial_state.astype(q.dtype))

  def step(S, xs):
    q_BxHxK, k_BxHxK, v_BxHxV, g_BxHxK, beta_BxH, reset_B = xs
    S = jnp.where(reset_B[:, None, None, None], 0.0, S)
    S = S * jnp.exp(g_BxHxK)[..., None]
    v_pred = jnp.einsum("bhkv,bhk->bhv", S, k_BxHxK)
    S = S + jnp.einsum("bhk,bhv->bhkv", k_BxHxK, beta_BxH[..., None] * (v_BxHxV - v_pred))
    return S, jnp.einsum("bhkv,bhk->bhv", S, q_BxHxK) * scale

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, reset_BxT))
  S_BxHxKxV, o_TxBxHxV = jax.lax.scan(step, S_BxHxKxV, xs)
  return jnp.moveaxis(o_TxBxHxV, 0, 1), S_BxHxKxV


def kda_chunked(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None,
                chunk_size=64):
  """Chunked form: per chunk a WY/UT solve, then a scan of the state across chunks.

  Within a chunk (positions i, j; G = cumsum of g; Γ_i = exp(G_i)):
    A_ij  = Σ_c k_ic k_jc e^{G_ic - G_jc}   (j < i),   T = (I + Diag(β) A)^-1
    U     = T Diag(β) (V - (K⊙Γ) S0)                    (the corrected values)
    O     = (Q⊙Γ) S0 + Tril(Qkᵀ-decay) U,  S' = Γ_C⊙S0 + (K⊙e^{G_C - G_j})ᵀ U
  The decay differences G_i - G_j (j ≤ i) are ≤ 0 and exponentiated directly,
  so this path is safe for any gate, bounded or not (memory O(C²K) per chunk).
  """
  B, T, H, K = q.shape
  V = v.shape[-1]
  C = chunk_size
  scale = K ** -0.5 if scale is None else scale
  q, k, v, g, beta, reset_BxT = prepare(q, k, v, g, beta, segment_ids)
  pad = -T % C
  if pad:  # trailing zeros are inert: no decay, no write, no output
    q, k, v, g = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v, g))
    beta, reset_BxT = jnp.pad(beta, ((0, 0), (0, pad), (0, 0))), jnp.pad(reset_BxT, ((0, 0), (0, pad)))
  N = (T + pad) // C

  def chunks(x):  # [B, N*C, H, ...] -> [B, N, H, C, ...]
    return jnp.moveaxis(x.reshape(B, N, C, *x.shape[2:]), 2, 3)

  q_BNHCK, k_BNHCK, v_BNHCV, g_BNHCK = (chunks(x) for x in (q, k, v, g))
  beta_BNHC = chunks(beta)
  # Segment index within the chunk: positions interact only inside one segment.
  reset_BNC = reset_BxT.reshape(B, N, C)
  seg_BNC = jnp.cumsum(reset_BNC, axis=-1)
  same_BNCC = seg_BNC[..., :, None] == seg_BNC[..., None, :]
  from_start_BNC = seg_BNC == 0          # no reset since the chunk began: S0 reaches it
  to_end_BNC = seg_BNC == seg_BNC[..., -1:]  # same segment as the chunk's last position

  G_BNHCK = jnp.cumsum(g_BNHCK, axis=-2)
  causal_CC = jnp.tril(jnp.ones((C, C), bool))
  mask_BN1CC = (same_BNCC & causal_CC)[:, :, None]
  diff_BNHCCK = G_BNHCK[..., :, None, :] - G_BNHCK[..., None, :, :]
  decay_BNHCCK = jnp.exp(jnp.where(mask_BN1CC[..., None], diff_BNHCCK, -jnp.inf))
  A_BNHCC = jnp.einsum("bnhik,bnhjk,bnhijk->bnhij", k_BNHCK, k_BNHCK, decay_BNHCCK)
  Aqk_BNHCC = jnp.einsum("bnhik,bnhjk,bnhijk->bnhij", q_BNHCK, k_BNHCK, decay_BNHCCK) * scale

  eye_CC = jnp.eye(C, dtype=q.dtype)
  L_BNHCC = eye_CC + beta_BNHC[..., None] * jnp.tril(A_BNHCC, -1)
  Gam_BNHCK = jnp.exp(G_BNHCK) * from_start_BNC[:, :, None, :, None]
  solve = lambda rhs: jax.scipy.linalg.solve_triangular(L_BNHCC, rhs, lower=True,
                                                        unit_diagonal=True)
  U0_BNHCV = solve(beta_BNHC[..., None] * v_BNHCV)
  W_BNHCK = solve(beta_BNHC[..., None] * k_BNHCK * Gam_BNHCK)
  Qg_BNHCK = q_BNHCK * Gam_BNHCK * scale
  to_end_BN1C1 = to_end_BNC[:, :, None, :, None]
  Kd_BNHCK = k_BNHCK * jnp.exp(jnp.where(to_end_BN1C1, G_BNHCK[..., -1:, :] - G_BNHCK, -jnp.inf))
  decay_BNHK = Gam_BNHCK[..., -1, :]

  def step(S_BHKV, xs):
    U0, W, Qg, Aqk, Kd, dec = xs
    U_BHCV = U0 - jnp.einsum("bhck,bhkv->bhcv", W, S_BHKV)
    o_BHCV = jnp.einsum("bhck,bhkv->bhcv", Qg, S_BHKV) + jnp.einsum("bhij,bhjv->bhiv", Aqk, U_BHCV)
    S_BHKV = dec[..., None] * S_BHKV + jnp.einsum("bhck,bhcv->bhkv", Kd, U_BHCV)
    return S_BHKV, o_BHCV

  S0 = jnp.zeros((B, H, K, V), q.dtype) if initial_state is None else initial_state.astype(q.dtype)
  xs = tuple(jnp.moveaxis(x, 1, 0) for x in
             (U0_BNHCV, W_BNHCK, Qg_BNHCK, Aqk_BNHCC, Kd_BNHCK, decay_BNHK))
  S_BHKV, o_NBHCV = jax.lax.scan(step, S0, xs)
  o_BxTxHxV = jnp.moveaxis(o_NBHCV, 0, 1).swapaxes(2, 3).reshape(B, N * C, H, V)
  return o_BxTxHxV[:, :T], S_BHKV
