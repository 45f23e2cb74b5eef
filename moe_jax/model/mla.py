"""Gated multi-head latent attention (MLA), NoPE, causal, segment-masked.

Keys and values are expanded from a compressed latent of rank kv_lora_rank
(what an inference cache stores); queries go through their own low-rank
bottleneck. No positional encoding. A sigmoid gate per head channel scales
the attention output before o_proj.
"""

import flax.linen as nn
import jax

from moe_jax.model.layers import dense, out_scale, rms_norm


class MLAMixer(nn.Module):
  cfg: object

  @nn.compact
  def __call__(self, x_BxTxD, segment_ids_BxT):
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
    k_BxTxHxDqk = dense(cfg, (H, Dqk), ("kv_lora", "heads", "kv"), "k_b")(ckv_BxTxR)
    v_BxTxHxDv = dense(cfg, (H, Dv), ("kv_lora", "heads", "kv"), "v_b")(ckv_BxTxR)

    # Attend only within a segment; padding (id 0) attends to padding, so no row is empty.
    same_BxTxT = segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]
    o_BxTxHxDv = jax.nn.dot_product_attention(
        q_BxTxHxDqk, k_BxTxHxDqk, v_BxTxHxDv, mask=same_BxTxT[:, None], is_causal=True)

    gate_BxTxHxDv = dense(cfg, (H, Dv), ("embed", "heads", "kv"), "gate", use_bias=True)(x_BxTxD)
    o_BxTxHxDv = o_BxTxHxDv * nn.sigmoid(gate_BxTxHxDv)
    return dense(cfg, D, ("heads", "kv", "embed"), "o_proj", axis=(-2, -1),
                 scale=out_scale(cfg))(o_BxTxHxDv)
