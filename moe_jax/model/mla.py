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


def _attend_latent_cache(q_BxTxHxDqk, ckv_BxTxR, segment_ids_BxT, cache, k_b, v_b):
  """Writes the new latents at each row's length, then attends over the filled cache."""
  B, T, _, Dqk = q_BxTxHxDqk.shape
  ckv_BxSxR = cache["ckv"]
  S, R = ckv_BxSxR.shape[1:]
  len_B = cache["length"]
  pos_BxT = len_B[:, None] + jnp.arange(T)
  ckv_BxSxR = ckv_BxSxR.at[jnp.arange(B)[:, None], pos_BxT].set(
      ckv_BxTxR.astype(ckv_BxSxR.dtype), mode="drop")
  filled_B = len_B + (segment_ids_BxT != 0).sum(-1)
  # k_b / v_b kernels [R, H, D]: the projections applied to the identity (exact).
  eye_RxR = jnp.eye(R, dtype=ckv_BxTxR.dtype)
  w_kb_RxHxDqk, w_vb_RxHxDv = k_b(eye_RxR), v_b(eye_RxR)
  ckv_c = ckv_BxSxR.astype(q_BxTxHxDqk.dtype)
  q_lat_BxTxHxR = jnp.einsum("bthd,rhd->bthr", q_BxTxHxDqk, w_kb_RxHxDqk)
  s_BxHxTxS = jnp.einsum("bthr,bsr->bhts", q_lat_BxTxHxR, ckv_c,
                         preferred_element_type=jnp.float32) * Dqk ** -0.5
  j_S = jnp.arange(S)
  visible_BxTxS = (j_S <= pos_BxT[:, :, None]) & (j_S < filled_B[:, None, None])
  p_BxHxTxS = jax.nn.softmax(jnp.where(visible_BxTxS[:, None], s_BxHxTxS, -jnp.inf), axis=-1)
  o_lat_BxTxHxR = jnp.einsum("bhts,bsr->bthr", p_BxHxTxS.astype(ckv_c.dtype), ckv_c)
  o_BxTxHxDv = jnp.einsum("bthr,rhd->bthd", o_lat_BxTxHxR, w_vb_RxHxDv)
  return o_BxTxHxDv, {"ckv": ckv_BxSxR}
