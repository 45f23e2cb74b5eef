"""The inference cache: per layer, what the next token needs from the past.

  KDA layer: {"state": [B,H,K,V] fp32 recurrent state,
              "q_conv" / "k_conv" / "v_conv": {"x": [B,W-1,H·K], "seg": [B,W-1]}}
  MLA layer: {"ckv": [B,S,R+Dr]} the compressed KV latents (and the Dr key dims all
             heads share, model.mla_qk_rope_dim), preallocated to S = max_len
  top level: {"length": [B] int32 positions filled per row, "layers": {"layer_i": ...}}

KDA's part is constant in the context length; MLA's grows with it (R numbers per
token per layer, not 2·H·D).
"""

import jax.numpy as jnp

from moe_jax.model.kda import kda_heads
from moe_jax.model.layers import dtype_of
from moe_jax.model.transformer import mixer_kind


def init_cache(cfg, batch_size: int, max_len: int) -> dict:
  """An empty cache for `batch_size` rows of up to `max_len` tokens (prompt + generated)."""
  B, H, K = batch_size, kda_heads(cfg), cfg.kda_head_dim
  layers = {}
  for i in range(cfg.n_layers):
    if mixer_kind(cfg, i) == "K":
      tail = lambda: {"x": jnp.zeros((B, cfg.kda_conv_size - 1, H * K), dtype_of(cfg)),
                      "seg": jnp.zeros((B, cfg.kda_conv_size - 1), jnp.int32)}
      layers[f"layer_{i}"] = {"state": jnp.zeros((B, H, K, K), jnp.float32),
                              "q_conv": tail(), "k_conv": tail(), "v_conv": tail()}
    else:
      width = cfg.mla_kv_lora_rank + cfg.get("mla_qk_rope_dim", 0)
      layers[f"layer_{i}"] = {"ckv": jnp.zeros((B, max_len, width), dtype_of(cfg))}
  return {"length": jnp.zeros((B,), jnp.int32), "layers": layers}

