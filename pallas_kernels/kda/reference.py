"""Pure-JAX KDA: the recurrent spec and the chunked (WY / UT) form. Any backend, differentiable.

  S_t = (I - β_t k_t k_tᵀ) Diag(exp g_t) S_{t-1} + β_t k_t v_tᵀ,   o_t = scale · S_tᵀ q_t

Segments (packed documents): the state resets to zero where the segment id
changes to a nonzero id; padding positions (id 0) leave the state untouched
and output zeros. Both forms run on `prepare`d inputs so they agree by
construction on these rules.

The chunked form has two stages, mirrored by the Pallas kernels:
  chunk_intra       per chunk of C positions (G = cumsum g inside the chunk, Γ = e^G):
                      A_ij   = Σ_c k_ic k_jc e^{G_ic - G_jc}  (j < i),   T = (I + Diag(β) A)^-1
                      Aqk_ij = scale Σ_c q_ic k_jc e^{G_ic - G_jc}  (j ≤ i)
                      W = T Diag(β)(K⊙Γ),  U0 = T Diag(β) V,  Qg = scale Q⊙Γ,
                      Kd = K⊙e^{G_C - G},  decay = Γ_C
  chunk_recurrence  across chunks, from S0:  U = U0 - W S,  O = Qg S + Aqk U,
                      S' = decay ⊙ S + Kdᵀ U
"""

import jax
import jax.numpy as jnp

SUB = 16  # sub-chunk rows: the tile on which decay factors are anchored


def compute_dtype(*xs):
  """float32 accumulation, or float64 when any input is float64 (the test spec)."""
  return jnp.result_type(jnp.float32, *(x.dtype for x in xs))


def l2_normalize(x, eps=1e-6):
  """x / sqrt(Σx² + eps) over the last axis, in fp32, returned in x's dtype (KDA's q and k)."""
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def segment_masks(segment_ids, B, T):
  """(live [B,T], reset [B,T]): non-padding positions, and where a new segment starts."""
  if segment_ids is None:
    return None, jnp.zeros((B, T), bool)
  seg_BxT = segment_ids.astype(jnp.int32)
  live_BxT = seg_BxT != 0
  prev_BxT = jnp.pad(seg_BxT, ((0, 0), (1, 0)))[:, :-1]
  reset_BxT = live_BxT & (seg_BxT != prev_BxT)
  return live_BxT, reset_BxT.at[:, 0].set(False)  # position 0 continues from initial_state


def prepare(q, k, v, g, beta, segment_ids, dtype=None):
  """Inputs cast to `dtype` (default: compute_dtype) with padding made inert, plus reset [B,T].

  g and beta are always at least fp32 (they feed exponentials and the triangular solve).
  """
  dt = compute_dtype(q, k, v, g, beta) if dtype is None else dtype
  gdt = jnp.result_type(dt, jnp.float32)
  q, k, v = (x.astype(dt) for x in (q, k, v))
  g, beta = g.astype(gdt), beta.astype(gdt)
  live_BxT, reset_BxT = segment_masks(segment_ids, *q.shape[:2])
  if live_BxT is None:
    return q, k, v, g, beta, reset_BxT
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
  if T == 1:  # decode: no loop (a while loop costs a host round trip per step on GPU)
    S_BxHxKxV, o_BxHxV = step(S_BxHxKxV, tuple(x[0] for x in xs))
    return o_BxHxV[:, None], S_BxHxKxV
  S_BxHxKxV, o_TxBxHxV = jax.lax.scan(step, S_BxHxKxV, xs)
  return jnp.moveaxis(o_TxBxHxV, 0, 1), S_BxHxKxV


def chunk_layout(q, k, v, g, beta, reset_BxT, chunk_size):
  """Pad T to a multiple of C (inert positions) and compute the per-chunk quantities.

  Returns padded (q, k, v, beta) [B,Tp,...], chunk-local cumulative gates G [B,Tp,H,K]
  and chunk-local segment index seg [B,Tp] (0 until the first reset inside the chunk).
  """
  C = chunk_size
  q, k, v, g, beta, reset_BxT = pad_to_chunks(C, q, k, v, g, beta, reset_BxT)
  return q, k, v, beta, chunk_cumsum(g, C), chunk_segments(reset_BxT, C)


def pad_to_chunks(C, *xs_BxT):
  """Each [B, T, ...] array zero-padded along T to a multiple of C. Trailing zeros are
  inert: no decay, no write, no output (and not live, not a reset)."""
  pad = -xs_BxT[0].shape[1] % C
  if not pad:
    return xs_BxT
  return tuple(jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)) for x in xs_BxT)


def chunk_segments(reset_BxTp, C):
  """Chunk-local segment index [B,Tp]: 0 until the first reset inside the chunk, then 1, ..."""
  B, Tp = reset_BxTp.shape
  return jnp.cumsum(reset_BxTp.reshape(B, Tp // C, C).astype(jnp.int32), axis=2).reshape(B, Tp)


def chunk_cumsum(g_BxTxHxK, C):
  """Inclusive cumsum of g inside each chunk of C positions, as one batched matmul with a
  lower-triangular matrix of ones in g's precision (the products are exact; only the
  summation order differs from a running sum). XLA GPU lowers jnp.cumsum to a windowed
  reduce-window and fuses its transpose into the backward's multi-output row reductions
  (the l2 norms, the gate): in the scanned train step on the H200 each such fusion took
  3-4 ms (benchmarks/train.md). A matmul is never fused into them."""
  B, T, H, K = g_BxTxHxK.shape
  M = B * (T // C)
  ones_MxCxC = jnp.broadcast_to(jnp.tril(jnp.ones((C, C), g_BxTxHxK.dtype)), (M, C, C))
  G_MxCxHK = jax.lax.dot_general(ones_MxCxC, g_BxTxHxK.reshape(M, C, H * K),
                                 (((2,), (1,)), ((0,), (0,))),
                                 precision=jax.lax.Precision.HIGHEST,
                                 preferred_element_type=g_BxTxHxK.dtype)
  return G_MxCxHK.reshape(B, T, H, K)


def _sub_chunk_decays(G_BNHSLK, bounded):
  """e^{G_i - G_j} factors for i, j in one chunk, anchored per 16-row sub-chunk.

  Returns (left, right) so that the (a, b) block of the decayed product X Yᵀ is
  (X_a ⊙ left[a, b]) (Y_b ⊙ right[a, b])ᵀ. Off the diagonal (a > b) the anchor
  is the last row r of sub-chunk b: e^{G_i - G_r} ≤ 1 and e^{G_r - G_j} ≤ 1 for any
  gate. On the diagonal the anchor is the sub-chunk's middle row m: both factors lie
  in [e^-40, e^40] for gates bounded by -5 (8 rows either side), finite in fp32 and
  clear of subnormals, which XLA flushes to zero (an anchor at the sub-chunk start
  reaches e^-80 and loses the g-gradient to 2e-4). Unbounded gates return factors
  for the off-diagonal blocks only and take the elementwise diagonal in chunk_intra.
  """
  S = G_BNHSLK.shape[-3]
  Gr_BNHSK = G_BNHSLK[..., -1, :]                                   # last row of each sub-chunk
  Gm_BNHSK = G_BNHSLK[..., G_BNHSLK.shape[-2] // 2, :]              # middle row of each sub-chunk
  a_SS = jnp.arange(S)[:, None]
  b_SS = jnp.arange(S)[None, :]
  anchor_BNHSSK = jnp.where((a_SS == b_SS)[..., None], Gm_BNHSK[..., :, None, :],
                            Gr_BNHSK[..., None, :, :])
  # The product e^{G_i - anchor}·e^{anchor - G_j} does not depend on the anchor: without
  # stop_gradient its two gradient paths would cancel in fp32 (at magnitudes up to e^40).
  anchor_BNHSSK = jax.lax.stop_gradient(anchor_BNHSSK)
  expo_l = G_BNHSLK[..., :, None, :, :] - anchor_BNHSSK[..., None, :]     # [..,a,b,16,K]
  expo_r = anchor_BNHSSK[..., None, :] - G_BNHSLK[..., None, :, :, :]
  keep = (a_SS > b_SS) if not bounded else (a_SS >= b_SS)
  keep = keep[:, :, None, None]
  left = jnp.exp(jnp.where(keep, expo_l, -jnp.inf))
  right = jnp.exp(jnp.where(keep, expo_r, -jnp.inf))
  return left, right


def _blocks_to_matrix(x_BNHSSLL):
  *lead, S, _, L, _ = x_BNHSSLL.shape
  return jnp.swapaxes(x_BNHSSLL, -3, -2).reshape(*lead, S * L, S * L)


def chunk_intra(q, k, v, G, beta, seg, *, scale, chunk_size, bounded):
  """Stage 1 (all chunks in parallel). Inputs [B,Tp,H,·] from `chunk_layout`.

  Returns dict of W, Qg, Kd [B,Tp,H,K]; U0 [B,Tp,H,V]; Aqk [B,Tp,H,C]; decay [B,N,H,K].
  """
  B, Tp, H, K = q.shape
  C, L = chunk_size, min(SUB, chunk_size)
  N, S = Tp // C, C // L

  def sub(x):  # [B, Tp, H, D] -> [B, N, H, S, L, D]
    return jnp.moveaxis(x.reshape(B, N, S, L, H, -1), 4, 2)

  q_, k_, G_ = sub(q), sub(k), sub(G)
  left, right = _sub_chunk_decays(G_, bounded)
  kl = k_[..., :, None, :, :] * left                                  # rows of sub-chunk a
  ql = q_[..., :, None, :, :] * left
  kr = k_[..., None, :, :, :] * right                                 # rows of sub-chunk b
  A_blk = jnp.einsum("...abik,...abjk->...abij", kl, kr)
  Aqk_blk = jnp.einsum("...abik,...abjk->...abij", ql, kr)
  if not bounded:  # diagonal blocks elementwise: e^{G_i - G_j} with j ≤ i is ≤ 1 for any gate
    i_LL = jnp.arange(L)[:, None] >= jnp.arange(L)[None, :]
    d = G_[..., :, None, :] - G_[..., None, :, :]                     # [..,S,L,L,K]
    decay_d = jnp.exp(jnp.where(i_LL[..., None], d, -jnp.inf))
    A_d = jnp.einsum("...ik,...jk,...ijk->...ij", k_, k_, decay_d)
    Aqk_d = jnp.einsum("...ik,...jk,...ijk->...ij", q_, k_, decay_d)
    diag = jnp.eye(S, dtype=bool)[:, :, None, None]
    A_blk = jnp.where(diag, A_d[..., :, None, :, :], A_blk)
    Aqk_blk = jnp.where(diag, Aqk_d[..., :, None, :, :], Aqk_blk)
  A_BNHCC, Aqk_BNHCC = _blocks_to_matrix(A_blk), _blocks_to_matrix(Aqk_blk)

  seg_BNC = seg.reshape(B, N, C)
  same_BN1CC = (seg_BNC[..., :, None] == seg_BNC[..., None, :])[:, :, None]
  i_CC, j_CC = jnp.arange(C)[:, None], jnp.arange(C)[None, :]
  A_BNHCC = jnp.where(same_BN1CC & (i_CC > j_CC), A_BNHCC, 0.0)
  Aqk_BNHCC = jnp.where(same_BN1CC & (i_CC >= j_CC), Aqk_BNHCC, 0.0) * scale

  def chunks(x):  # [B, Tp, H, D] -> [B, N, H, C, D]
    return jnp.moveaxis(x.reshape(B, N, C, H, -1), 3, 2)

  k_c, v_c, G_c, q_c = chunks(k), chunks(v), chunks(G), chunks(q)
  beta_c = chunks(beta[..., None])                                    # [B,N,H,C,1]
  from_start = (seg_BNC == 0)[:, :, None, :, None]                    # S0 reaches these rows
  to_end = (seg_BNC == seg_BNC[..., -1:])[:, :, None, :, None]        # rows that reach S'
  Gam = jnp.exp(G_c) * from_start
  L_BNHCC = jnp.eye(C, dtype=q.dtype) + beta_c * A_BNHCC
  solve = lambda rhs: jax.scipy.linalg.solve_triangular(L_BNHCC, rhs, lower=True,
                                                        unit_diagonal=True)
  G_end = G_c[..., -1:, :]
  out = {
      "W": solve(beta_c * k_c * Gam),
      "U0": solve(beta_c * v_c),
      "Qg": q_c * Gam * scale,
      "Kd": k_c * jnp.exp(jnp.where(to_end, G_end - G_c, -jnp.inf)),
      "Aqk": Aqk_BNHCC,
  }
  out = {n: jnp.moveaxis(x, 2, 3).reshape(B, Tp, H, -1) for n, x in out.items()}
  out["decay"] = Gam[..., -1, :]                                      # [B,N,H,K]
  return out


def chunk_recurrence(W, U0, Qg, Kd, Aqk, decay, S0, *, chunk_size):
  """Stage 2: scan the state across chunks. Returns (o [B,Tp,H,V], final state [B,H,K,V])."""
  B, Tp, H, K = W.shape
  V = U0.shape[-1]
  C = chunk_size
  N = Tp // C

  def chunks(x):  # [B, Tp, H, D] -> [N, B, H, C, D]
    return jnp.moveaxis(x.reshape(B, N, C, H, -1), (1, 3), (0, 2))

  def step(S_BHKV, xs):
    W_, U0_, Qg_, Kd_, Aqk_, dec_BHK = xs
    U_BHCV = U0_ - jnp.einsum("bhck,bhkv->bhcv", W_, S_BHKV)
    o_BHCV = jnp.einsum("bhck,bhkv->bhcv", Qg_, S_BHKV) + jnp.einsum("bhij,bhjv->bhiv", Aqk_,
                                                                    U_BHCV)
    S_BHKV = dec_BHK[..., None] * S_BHKV + jnp.einsum("bhck,bhcv->bhkv", Kd_, U_BHCV)
    return S_BHKV, o_BHCV

  xs = tuple(chunks(x) for x in (W, U0, Qg, Kd, Aqk)) + (jnp.moveaxis(decay, 1, 0),)
  S_BHKV, o_NBHCV = jax.lax.scan(step, S0, xs)
  return jnp.moveaxis(o_NBHCV, (0, 2), (1, 3)).reshape(B, Tp, H, V), S_BHKV


def kda_chunked(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None,
                chunk_size=64, bounded=False):
  """Chunked form (stage 1 in parallel, stage 2 scanned). `bounded=True` promises every
  g ≥ -5 and takes the all-matmul diagonal tiles; False is safe for any gate."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  scale = K ** -0.5 if scale is None else scale
  q, k, v, g, beta, reset_BxT = prepare(q, k, v, g, beta, segment_ids)
  q, k, v, beta, G, seg = chunk_layout(q, k, v, g, beta, reset_BxT, chunk_size)
  st = chunk_intra(q, k, v, G, beta, seg, scale=scale, chunk_size=chunk_size, bounded=bounded)
  S0 = jnp.zeros((B, H, K, V), q.dtype) if initial_state is None else initial_state.astype(q.dtype)
  o, S = chunk_recurrence(st["W"], st["U0"], st["Qg"], st["Kd"], st["Aqk"], st["decay"], S0,
                          chunk_size=chunk_size)
  return o[:, :T], S
