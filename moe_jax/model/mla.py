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

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from moe_jax.model import remat
from moe_jax.model.layers import dense, out_scale, rms_norm
from moe_jax.parallel.mesh import axis_size, per_device
from moe_jax.parallel.ring_attention import ring_attention
from pallas_kernels.attention import ops as attention_ops


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

    # Kept only when asked (apply(..., mutable=["intermediates"])): attention-entropy evals.
    self.sow("intermediates", "q", q_BxTxHxDqk)
    ckv_BxTxR = dense(cfg, cfg.mla_kv_lora_rank, ("embed", "kv_lora"), "kv_a")(x_BxTxD)
    ckv_BxTxR = rms_norm(cfg, "kv_a_norm", "kv_lora")(ckv_BxTxR)
    k_b = dense(cfg, (H, Dqk), ("kv_lora", "heads", "kv"), "k_b")
    v_b = dense(cfg, (H, Dv), ("kv_lora", "heads", "kv"), "v_b")

    if cache is None:
      k_BxTxHxDqk, v_BxTxHxDv = k_b(ckv_BxTxR), v_b(ckv_BxTxR)
      impl = mla_implementation(cfg)
      if axis_size("sequence") > 1:  # time sharded: K/V blocks go round the ring
        shard_len = x_BxTxD.shape[1] // axis_size("sequence")
        o_BxTxHxDv = ring_attention(
            q_BxTxHxDqk, k_BxTxHxDqk, v_BxTxHxDv, segment_ids_BxT,
            implementation=attention_ops.ring_step_implementation(impl, shard_len))
      else:
        o_BxTxHxDv = per_device(functools.partial(attention_ops.causal_attention,
                                                  implementation=impl),
                                q_BxTxHxDqk, k_BxTxHxDqk, v_BxTxHxDv, segment_ids_BxT)
      new_cache = None
    else:
      o_BxTxHxDv, new_cache = _attend_latent_cache(q_BxTxHxDqk, ckv_BxTxR, segment_ids_BxT,
                                                   cache, k_b, v_b, mla_implementation(cfg))

    o_BxTxHxDv = remat.tag(o_BxTxHxDv, "mla_out")
    gate_BxTxHxDv = dense(cfg, (H, Dv), ("embed", "heads", "kv"), "gate", use_bias=True)(x_BxTxD)
    o_BxTxHxDv = o_BxTxHxDv * nn.sigmoid(gate_BxTxHxDv)
    out_BxTxD = dense(cfg, D, ("heads", "kv", "embed"), "o_proj", axis=(-2, -1),
                      scale=out_scale(cfg))(o_BxTxHxDv)
    return out_BxTxD if cache is None else (out_BxTxD, new_cache)


def mla_implementation(cfg) -> str:
  """model.mla_implementation, or with "" the target platform's (attention/ops.py): "gpu"
  Pallas kernels for training attention, prefill and decode over the cache; "tpu" jax's
  Mosaic flash attention (training, full-sequence forwards, ring steps, where T fits) and
  the Mosaic cache kernel for prefill, decode in XLA; "xla"."""
  return attention_ops.implementation(cfg.mla_implementation)


def _attend_latent_cache(q_BxTxHxDqk, ckv_BxTxR, segment_ids_BxT, cache, k_b, v_b, impl):
  """Writes the new latents at each row's length, then attends over the filled cache
  (attention_ops.latent_cache_attention) with k_b and v_b as [R, H, D] weights."""
  B, T, H, Dqk = q_BxTxHxDqk.shape
  ckv_BxSxR, length_B = cache["ckv"], cache["length"]
  R = ckv_BxSxR.shape[-1]
  pos_BxT = length_B[:, None] + jnp.arange(T)
  ckv_BxSxR = ckv_BxSxR.at[jnp.arange(B)[:, None], pos_BxT].set(
      ckv_BxTxR.astype(ckv_BxSxR.dtype), mode="drop")
  filled_B = length_B + (segment_ids_BxT != 0).sum(-1)
  # k_b / v_b kernels [R, H, D]: the projections applied to the identity (exact).
  eye_RxR = jnp.eye(R, dtype=ckv_BxTxR.dtype)
  w_kb_RxHxDqk, w_vb_RxHxDv = k_b(eye_RxR), v_b(eye_RxR)
  q_BxTxHxDqk = q_BxTxHxDqk * jnp.asarray(Dqk ** -0.5, q_BxTxHxDqk.dtype)
  o_BxTxHxDv = attention_ops.latent_cache_attention(
      q_BxTxHxDqk, ckv_BxSxR, w_kb_RxHxDqk, w_vb_RxHxDv, length_B, filled_B,
      implementation=impl)
  return o_BxTxHxDv, {"ckv": ckv_BxSxR}
