"""HybridMoE: embedding → layer stack from the pattern string → final norm → LM head."""

import flax.linen as nn
import jax.numpy as jnp

from moe_jax.model.kda import KDAMixer
from moe_jax.model.layers import SwiGLU, dtype_of, lp, rms_norm
from moe_jax.model.mla import MLAMixer

MIXERS = {"K": KDAMixer, "A": MLAMixer}


def mixer_kind(cfg, layer: int) -> str:
  """The pattern string applies cyclically: "KKKA" over 8 layers is KKKAKKKA."""
  return cfg.layer_pattern[layer % len(cfg.layer_pattern)]


def make_ffn(cfg, layer: int) -> nn.Module:
  """FFN for `layer`; the MoE layers plug in here, keyed by layer index."""
  return SwiGLU(cfg, cfg.ffn_hidden, name="ffn")


class Block(nn.Module):
  """Pre-norm residual block: x + mixer(norm(x)), then + ffn(norm(·))."""
  cfg: object
  layer: int

  @nn.compact
  def __call__(self, x_BxTxD, segment_ids_BxT):
    cfg = self.cfg
    mixer = MIXERS[mixer_kind(cfg, self.layer)](cfg, name="mixer")
    x_BxTxD = x_BxTxD + mixer(rms_norm(cfg, "mixer_norm")(x_BxTxD), segment_ids_BxT)
    ffn = make_ffn(cfg, self.layer)
    return x_BxTxD + ffn(rms_norm(cfg, "ffn_norm")(x_BxTxD))


class HybridMoE(nn.Module):
  """Decoder-only LM. `cfg` is the (frozen) model config. Returns (logits fp32, aux)."""
  cfg: object

  @nn.compact
  def __call__(self, batch):
    cfg = self.cfg
    tokens_BxT, segment_ids_BxT = batch["tokens"], batch["segment_ids"]
    embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype_of(cfg), param_dtype=jnp.float32,
                     embedding_init=lp(nn.initializers.normal(1.0), ("vocab", "embed")),
                     name="embed")
    x_BxTxD = embed(tokens_BxT)
    block = nn.remat(Block) if cfg.remat else Block
    for i in range(cfg.n_layers):
      x_BxTxD = block(cfg, i, name=f"layer_{i}")(x_BxTxD, segment_ids_BxT)
    x_BxTxD = rms_norm(cfg, "final_norm")(x_BxTxD)
    if cfg.tie_embeddings:
      logits_BxTxV = embed.attend(x_BxTxD) / jnp.sqrt(cfg.d_model).astype(x_BxTxD.dtype)
    else:
      head = nn.DenseGeneral(cfg.vocab_size, use_bias=False, dtype=dtype_of(cfg),
                             param_dtype=jnp.float32, name="lm_head",
                             kernel_init=lp(nn.initializers.variance_scaling(
                                 1.0, "fan_in", "truncated_normal"), ("embed", "vocab")))
      logits_BxTxV = head(x_BxTxD)
    return logits_BxTxV.astype(jnp.float32), {"routing": {}}
