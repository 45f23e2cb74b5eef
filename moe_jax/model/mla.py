"""Gated multi-head latent attention (MLA), NoPE, causal, segment-masked.

Keys and values are expanded from a compressed latent of rank kv_lora_rank
(what an inference cache stores); queries go through their own low-rank
bottleneck. No positional encoding. A sigmoid gate per head channel scales
the attention output before o_proj.

With a cache ({"ckv": [B, S, R] latents, "length": [B] filled positions}) the new
tokens' latents are written at each row's length and attention runs in the latent
space: k_b is absorbed into the queries and v_b applied after the weighted sum, so
the cache is never expanded to per-head keys and values.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from moe_jax.model.layers import dense, out_scale, rms_norm


class MLAMixer(nn.Module):
  cfg: object

  @nn.compact
  def __call__(self, x_BxTxD, segment_ids_BxT, cache=None):
    cfg = self.cfg
    D = x_BxTxD.shape[-1]
    H, Dqk, Dv = cfg.n_heads, cfg.mla_qk_head_dim, cfg.mla_v_head_dim

    if cfg.mla_q_lora_rank:
      cq_BxTxR = dense(cfg, cfg.mla_q_lora_rank, ("embed", "q_lora"), "q_a")(x_BxTxD)
      cq_BxTxR = rms_norm(cfg, "q_a_norm", "q_lora")(cq_BxTxR)
      q_BxTxHxDqk = dense(cfg, (H, Dqk), ("q_lora", "heads", "kv"), "q_b")(cq_BxTxR)
    else:
      q_BxTxHxDqk = dense(cfg, (H, Dqk), ("embed", "heads", "kv"), "q_proj")(x_BxTxD)

    ckv_BxTxR = dense(cfg, cfg.mla_kv_lora_rank, ("embed", "kv_lora"), "kv_a")(x_BxTxD)
    ckv_BxTxR = rms_norm(cfg, "kv_a_norm", "kv_lora")(ckv_BxTxR)
    k_b = dense(cfg, (H, Dqk), ("kv_lora", "heads", "kv"), "k_b")
    v_b = dense(cfg, (H, Dv), ("kv_lora", "heads", "kv"), "v_b")

    if cache is None:
      k_BxTxHxDqk, v_BxTxHxDv = k_b(ckv_BxTxR), v_b(ckv_BxTxR)
      # Attend only within a segment; padding (id 0) attends to padding: no row is empty.
      same_BxTxT = segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]
      o_BxTxHxDv = jax.nn.dot_product_attention(
          q_BxTxHxDqk, k_BxTxHxDqk, v_BxTxHxDv, mask=same_BxTxT[:, None], is_causal=True)
      new_cache = None
    else:
      o_BxTxHxDv, new_cache = _attend_latent_cache(q_BxTxHxDqk, ckv_BxTxR, segment_ids_BxT,
                                                   cache, k_b, v_b)

    gate_BxTxHxDv = dense(cfg, (H, Dv), ("embed", "heads", "kv"), "gate", use_bias=True)(x_BxTxD)
    o_BxTxHxDv = o_BxTxHxDv * nn.sigmoid(gate_BxTxHxDv)
    out_BxTxD = dense(cfg, D, ("heads", "kv", "embed"), "o_proj", axis=(-2, -1),
                      scale=out_scale(cfg))(o_BxTxHxDv)
    return out_BxTxD if cache is None else (out_BxTxD, new_cache)


KEY_BLOCK = 1024  # cache positions per step of the online softmax


def _attend_latent_cache(q_BxTxHxDqk, ckv_BxTxR, segment_ids_BxT, cache, k_b, v_b):
  """Writes the new latents at each row's length, then attends over the filled cache.

  Flash-style: an online softmax over blocks of `key_block` cache positions, looping only
  over the blocks filled so far, so memory is O(T·key_block) and decode cost grows with the
  filled length, not the preallocated one. Few queries (decode) attend in the latent space
  (k_b absorbed into q, v_b applied after); many (prefill chunks of T ≥ R) expand each key
  block to per-head keys and values, which is cheaper then.
  """
  B, T, H, Dqk = q_BxTxHxDqk.shape
  ckv_BxSxR = cache["ckv"]
  S, R = ckv_BxSxR.shape[1:]
  pos_BxT = cache["length"][:, None] + jnp.arange(T)
  ckv_BxSxR = ckv_BxSxR.at[jnp.arange(B)[:, None], pos_BxT].set(
      ckv_BxTxR.astype(ckv_BxSxR.dtype), mode="drop")
  filled_B = cache["length"] + (segment_ids_BxT != 0).sum(-1)
  # k_b / v_b kernels [R, H, D]: the projections applied to the identity (exact).
  eye_RxR = jnp.eye(R, dtype=ckv_BxTxR.dtype)
  w_kb_RxHxDqk, w_vb_RxHxDv = k_b(eye_RxR), v_b(eye_RxR)
  absorbed = T < R
  q_BxTxHxDqk = q_BxTxHxDqk * jnp.asarray(Dqk ** -0.5, q_BxTxHxDqk.dtype)
  if absorbed:
    q_BxTxHxX = jnp.einsum("bthd,rhd->bthr", q_BxTxHxDqk, w_kb_RxHxDqk)
    X = R
  else:
    q_BxTxHxX, X = q_BxTxHxDqk, w_vb_RxHxDv.shape[-1]
  Sk = min(KEY_BLOCK, S)

  def block(i, carry):
    m_BxTxH, l_BxTxH, acc_BxTxHxX = carry
    start = jnp.minimum(i * Sk, S - Sk)  # the last block may overlap the one before: masked
    c_BxSkxR = jax.lax.dynamic_slice_in_dim(ckv_BxSxR, start, Sk, axis=1).astype(q_BxTxHxX.dtype)
    j_Sk = start + jnp.arange(Sk)
    visible_BxTxSk = ((j_Sk >= i * Sk) & (j_Sk <= pos_BxT[..., None])
                      & (j_Sk < filled_B[:, None, None]))
    if absorbed:
      s_BxTxHxSk = jnp.einsum("bthr,bsr->bths", q_BxTxHxX, c_BxSkxR,
                              preferred_element_type=jnp.float32)
    else:
      k_BxSkxHxD = jnp.einsum("bsr,rhd->bshd", c_BxSkxR, w_kb_RxHxDqk)
      s_BxTxHxSk = jnp.einsum("bthd,bshd->bths", q_BxTxHxX, k_BxSkxHxD,
                              preferred_element_type=jnp.float32)
    s_BxTxHxSk = jnp.where(visible_BxTxSk[:, :, None], s_BxTxHxSk, -jnp.inf)
    m_new = jnp.maximum(m_BxTxH, s_BxTxHxSk.max(-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows with nothing visible yet
    p_BxTxHxSk = jnp.exp(s_BxTxHxSk - m_safe[..., None])
    corr_BxTxH = jnp.exp(m_BxTxH - m_safe)
    if absorbed:
      pv_BxTxHxX = jnp.einsum("bths,bsr->bthr", p_BxTxHxSk, c_BxSkxR.astype(jnp.float32))
    else:
      v_BxSkxHxD = jnp.einsum("bsr,rhd->bshd", c_BxSkxR, w_vb_RxHxDv)
      pv_BxTxHxX = jnp.einsum("bths,bshd->bthd", p_BxTxHxSk, v_BxSkxHxD.astype(jnp.float32))
    return (m_new, l_BxTxH * corr_BxTxH + p_BxTxHxSk.sum(-1),
            acc_BxTxHxX * corr_BxTxH[..., None] + pv_BxTxHxX)

  init = (jnp.full((B, T, H), -jnp.inf), jnp.zeros((B, T, H)), jnp.zeros((B, T, H, X)))
  n_blocks = (filled_B.max() + Sk - 1) // Sk
  _, l_BxTxH, acc_BxTxHxX = jax.lax.fori_loop(0, n_blocks, block, init)
  o_BxTxHxX = (acc_BxTxHxX / l_BxTxH[..., None]).astype(q_BxTxHxDqk.dtype)
  if absorbed:
    o_BxTxHxX = jnp.einsum("bthr,rhd->bthd", o_BxTxHxX, w_vb_RxHxDv)
  return o_BxTxHxX, {"ckv": ckv_BxSxR}
