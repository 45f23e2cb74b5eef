"""Attention over a cache in XLA, block by block (the "xla" path of ops.py, and what decode
on TPU runs): an online softmax over blocks of the filled cache, so memory is O(T·block)
and blocks past the longest filled row are never visited."""

import jax
import jax.numpy as jnp

KEY_BLOCK = 1024          # cache positions per step of the XLA online softmax (prefill)
SCORE_BUDGET = 1 << 24    # fp32 scores per step in latent-space (decode) attention...
MAX_KEY_BLOCK = 1 << 16   # ...up to this many positions: decode cost follows the filled length
EXPAND_BLOCK = 1 << 16    # cache positions expanded to K/V per step (expand_filled)


def expand_block(c_BxSxR, w_kb_RxHxDqk, w_vb_RxHxDv):
  """Per-head K [B, S, H, Dqk] and V [B, S, H, Dv] of a block of latents, in the latents' and
  weights' common dtype."""
  dtype = jnp.result_type(c_BxSxR.dtype, w_kb_RxHxDqk.dtype)
  return (jnp.einsum("bsr,rhd->bshd", c_BxSxR, w_kb_RxHxDqk).astype(dtype),
          jnp.einsum("bsr,rhd->bshd", c_BxSxR, w_vb_RxHxDv).astype(dtype))


def expand_filled(ckv_BxSxR, w_kb_RxHxDqk, w_vb_RxHxDv, filled_B):
  """Per-head K/V [B, S, H, D] from the latents; only the blocks up to the longest filled
  row are computed (the rest stays zero and is never read)."""
  B, S, _ = ckv_BxSxR.shape
  H, Dqk, Dv = w_kb_RxHxDqk.shape[1], w_kb_RxHxDqk.shape[2], w_vb_RxHxDv.shape[2]
  Se = min(EXPAND_BLOCK, S)

  def block(i, kv):
    start = jnp.minimum(i * Se, S - Se)
    k, v = expand_block(jax.lax.dynamic_slice_in_dim(ckv_BxSxR, start, Se, axis=1),
                        w_kb_RxHxDqk, w_vb_RxHxDv)
    return (jax.lax.dynamic_update_slice_in_dim(kv[0], k, start, axis=1),
            jax.lax.dynamic_update_slice_in_dim(kv[1], v, start, axis=1))

  dtype = jnp.result_type(ckv_BxSxR.dtype, w_kb_RxHxDqk.dtype)
  kv = (jnp.zeros((B, S, H, Dqk), dtype), jnp.zeros((B, S, H, Dv), dtype))
  return jax.lax.fori_loop(0, (filled_B.max() + Se - 1) // Se, block, kv)


def online_softmax(q_BxTxHxX, ckv_BxSxR, keys, values, pos_BxT, filled_B, Sk):
  """Flash-style attention over the filled cache in blocks of Sk positions, in XLA: memory
  O(T·Sk), and only blocks below the longest filled row are visited. keys/values map a
  latent block [B, Sk, R] to what q contracts with ([B, Sk, R] or [B, Sk, H, D])."""
  B, T, H, _ = q_BxTxHxX.shape
  S = ckv_BxSxR.shape[1]

  def block(i, carry):
    m_BxTxH, l_BxTxH, acc_BxTxHxY = carry
    start = jnp.minimum(i * Sk, S - Sk)  # the last block may overlap the one before: masked
    c_BxSkxR = jax.lax.dynamic_slice_in_dim(ckv_BxSxR, start, Sk, axis=1).astype(q_BxTxHxX.dtype)
    j_Sk = start + jnp.arange(Sk)
    visible_BxTxSk = ((j_Sk >= i * Sk) & (j_Sk <= pos_BxT[..., None])
                      & (j_Sk < filled_B[:, None, None]))
    k_Bx = keys(c_BxSkxR)
    spec = "bthx,bsx->bths" if k_Bx.ndim == 3 else "bthx,bshx->bths"
    s_BxTxHxSk = jnp.einsum(spec, q_BxTxHxX, k_Bx, preferred_element_type=jnp.float32)
    s_BxTxHxSk = jnp.where(visible_BxTxSk[:, :, None], s_BxTxHxSk, -jnp.inf)
    m_new = jnp.maximum(m_BxTxH, s_BxTxHxSk.max(-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows with nothing visible yet
    p_BxTxHxSk = jnp.exp(s_BxTxHxSk - m_safe[..., None])
    corr_BxTxH = jnp.exp(m_BxTxH - m_safe)
    v_Bx = values(c_BxSkxR)
    spec = "bths,bsy->bthy" if v_Bx.ndim == 3 else "bths,bshy->bthy"
    pv_BxTxHxY = jnp.einsum(spec, p_BxTxHxSk.astype(v_Bx.dtype), v_Bx,
                            preferred_element_type=jnp.float32)
    return (m_new, l_BxTxH * corr_BxTxH + p_BxTxHxSk.sum(-1),
            acc_BxTxHxY * corr_BxTxH[..., None] + pv_BxTxHxY)

  Y = values(ckv_BxSxR[:, :1]).shape[-1]
  init = (jnp.full((B, T, H), -jnp.inf), jnp.zeros((B, T, H)), jnp.zeros((B, T, H, Y)))
  n_blocks = (filled_B.max() + Sk - 1) // Sk
  _, l_BxTxH, acc_BxTxHxY = jax.lax.fori_loop(0, n_blocks, block, init)
  return (acc_BxTxHxY / jnp.where(l_BxTxH == 0, 1.0, l_BxTxH)[..., None]).astype(q_BxTxHxX.dtype)
