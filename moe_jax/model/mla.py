"""Gated multi-head latent attention (MLA), NoPE, causal, segment-masked.

Keys and values are expanded from a compressed latent of rank kv_lora_rank
(what an inference cache stores); queries go through their own low-rank
bottleneck (or one full-rank projection). No positional encoding. A sigmoid gate
per head channel scales the attention output before o_proj (model.mla_output_gate).

With model.mla_qk_rope_dim = Dr > 0 (DeepSeek's and Kimi Linear's layout) each head's
query has Dr more dims, and kv_a emits Dr more features that join every head's key
unchanged: one key part shared by all heads. Kimi Linear is NoPE, so these dims are
never rotated; they are plain learned features, kept so its checkpoints map exactly.
The scores are scaled by (Dqk + Dr)^-1/2. With model.mla_rope_theta > 0 those Dr dims,
the shared key's and each query's, turn by RoPE (model/rope.py: DeepSeek's decoupled
RoPE), at each token's position in its document, or, with a cache, its index in the
row; the cache stores the turned key dims.

With a cache ({"ckv": [B, S, R + Dr] latents, "length": [B] filled positions}) the new
tokens' latents (with their shared key dims) are written at each row's length and
attention runs in the latent space: k_b is absorbed into the queries and v_b applied
after the weighted sum, so the cache is never expanded to per-head keys and values.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from moe_jax.model import remat, rope
from moe_jax.model.layers import dense, dtype_of, out_scale, rms_norm
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
    R, Dr = cfg.mla_kv_lora_rank, cfg.get("mla_qk_rope_dim", 0)
    Dq = Dqk + Dr   # per-head query (and key) width
    # The latents' RMSNorm epsilon (DeepSeek's and Kimi Linear's are 1e-6 whatever the
    # model's norm_eps); 0 = model.norm_eps.
    latent_eps = cfg.get("mla_latent_norm_eps", 0.0) or cfg.norm_eps

    if cfg.mla_q_lora_rank:
      cq_BxTxR = dense(cfg, cfg.mla_q_lora_rank, ("embed", "q_lora"), "q_a")(x_BxTxD)
      cq_BxTxR = rms_norm(cfg, "q_a_norm", "q_lora", eps=latent_eps)(cq_BxTxR)
      q_BxTxHxDq = dense(cfg, (H, Dq), ("q_lora", "heads", "kv"), "q_b")(cq_BxTxR)
    else:
      q_BxTxHxDq = dense(cfg, (H, Dq), ("embed", "heads", "kv"), "q_proj")(x_BxTxD)

    kv_BxTxW = dense(cfg, R + Dr, ("embed", "kv_lora"), "kv_a")(x_BxTxD)
    ckv_BxTxR = rms_norm(cfg, "kv_a_norm", "kv_lora", eps=latent_eps)(kv_BxTxW[..., :R])
    kr_BxTxDr = kv_BxTxW[..., R:]   # the shared key dims: not normed; rotated only by RoPE
    theta = cfg.get("mla_rope_theta", 0.0)
    if theta:
      T = x_BxTxD.shape[1]
      pos_BxT = (rope.document_positions(segment_ids_BxT) if cache is None
                 else cache["length"][:, None] + jnp.arange(T, dtype=jnp.int32))
      q_BxTxHxDq = jnp.concatenate(
          [q_BxTxHxDq[..., :Dqk], rope.rotate(q_BxTxHxDq[..., Dqk:], pos_BxT, theta)], -1)
      kr_BxTxDr = rope.rotate(kr_BxTxDr, pos_BxT, theta)
    # Kept only when asked (apply(..., mutable=["intermediates"])): attention-entropy evals.
    self.sow("intermediates", "q", q_BxTxHxDq)
    k_b = dense(cfg, (H, Dqk), ("kv_lora", "heads", "kv"), "k_b")
    v_b = dense(cfg, (H, Dv), ("kv_lora", "heads", "kv"), "v_b")

    if cache is None:
      k_BxTxHxDq, v_BxTxHxDv = with_shared_key(k_b(ckv_BxTxR), kr_BxTxDr), v_b(ckv_BxTxR)
      impl = mla_implementation(cfg)
      if axis_size("sequence") > 1:  # time sharded: K/V blocks go round the ring
        shard_len = x_BxTxD.shape[1] // axis_size("sequence")
        o_BxTxHxDv = ring_attention(
            q_BxTxHxDq, k_BxTxHxDq, v_BxTxHxDv, segment_ids_BxT,
            implementation=attention_ops.ring_step_implementation(impl, shard_len))
      else:
        o_BxTxHxDv = per_device(functools.partial(attention_ops.causal_attention,
                                                  implementation=impl),
                                q_BxTxHxDq, k_BxTxHxDq, v_BxTxHxDv, segment_ids_BxT)
      new_cache = None
    else:
      ckv_BxTxW = jnp.concatenate([ckv_BxTxR, kr_BxTxDr], -1) if Dr else ckv_BxTxR
      if self.is_initializing():   # k_b and v_b make their parameters
        eye_RxR = jnp.eye(R, dtype=ckv_BxTxW.dtype)
        w_kb_RxHxDqk, w_vb_RxHxDv = k_b(eye_RxR), v_b(eye_RxR)
      else:   # their kernels as the projections use them (k_b(I) = k_b's kernel, exactly)
        p = nn.meta.unbox(self.variables["params"])
        w_kb_RxHxDqk, w_vb_RxHxDv = (p[n]["kernel"].astype(dtype_of(cfg)) for n in ("k_b", "v_b"))
      o_BxTxHxDv, new_cache = _attend_latent_cache(q_BxTxHxDq, ckv_BxTxW, segment_ids_BxT,
                                                   cache, w_kb_RxHxDqk, w_vb_RxHxDv, Dr,
                                                   mla_implementation(cfg))

    o_BxTxHxDv = remat.tag(o_BxTxHxDv, "mla_out")
    if cfg.get("mla_output_gate", True):
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


def with_shared_key(k_BxTxHxDqk, kr_BxTxDr):
  """Each head's key: its own Dqk dims, then the Dr dims all heads share."""
  if not kr_BxTxDr.shape[-1]:
    return k_BxTxHxDqk
  H = k_BxTxHxDqk.shape[2]
  kr_BxTxHxDr = jnp.broadcast_to(kr_BxTxDr[:, :, None], (*kr_BxTxDr.shape[:2], H,
                                                          kr_BxTxDr.shape[-1]))
  return jnp.concatenate([k_BxTxHxDqk, kr_BxTxHxDr.astype(k_BxTxHxDqk.dtype)], -1)


def _attend_latent_cache(q_BxTxHxDq, ckv_BxTxW, segment_ids_BxT, cache, w_kb_RxHxDqk,
                         w_vb_RxHxDv, Dr, impl):
  """Writes the new latents at each row's length, then attends over the filled cache
  (attention_ops.latent_cache_attention) with k_b and v_b's kernels ([R, H, D], in the
  model's dtype) extended to [W, H, D] weights.

  A latent row is W = R + Dr wide: the normed latent, then the shared key dims. Extending
  k_b by an identity on those dims (and v_b by zeros) makes the absorbed score
  q·[k_b(c), k_r] = (k_bᵀq_nope)·c + q_rope·k_r exactly, so the kernels see one latent."""
  B, T, H, Dq = q_BxTxHxDq.shape
  ckv_BxSxW, length_B = cache["ckv"], cache["length"]
  W = ckv_BxSxW.shape[-1]
  pos_BxT = length_B[:, None] + jnp.arange(T)
  ckv_BxSxW = ckv_BxSxW.at[jnp.arange(B)[:, None], pos_BxT].set(
      ckv_BxTxW.astype(ckv_BxSxW.dtype), mode="drop")
  filled_B = length_B + (segment_ids_BxT != 0).sum(-1)
  w_kb_WxHxDq, w_vb_WxHxDv = w_kb_RxHxDqk, w_vb_RxHxDv
  if Dr:
    eye_DrxHxDr = jnp.broadcast_to(jnp.eye(Dr, dtype=w_kb_WxHxDq.dtype)[:, None], (Dr, H, Dr))
    w_kb_WxHxDq = jnp.concatenate([
        jnp.pad(w_kb_WxHxDq, ((0, 0), (0, 0), (0, Dr))),
        jnp.pad(eye_DrxHxDr, ((0, 0), (0, 0), (Dq - Dr, 0)))], 0)
    w_vb_WxHxDv = jnp.pad(w_vb_WxHxDv, ((0, Dr), (0, 0), (0, 0)))
  q_BxTxHxDq = q_BxTxHxDq * jnp.asarray(Dq ** -0.5, q_BxTxHxDq.dtype)
  o_BxTxHxDv = attention_ops.latent_cache_attention(
      q_BxTxHxDq, ckv_BxSxW, w_kb_WxHxDq, w_vb_WxHxDv, length_B, filled_B,
      implementation=impl)
  return o_BxTxHxDv, {"ckv": ckv_BxSxW}
