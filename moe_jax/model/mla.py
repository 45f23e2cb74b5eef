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

from moe_jax.model import remat
from moe_jax.model.layers import dense, out_scale, rms_norm
from moe_jax.parallel.mesh import axis_size, per_device
from moe_jax.parallel.ring_attention import implementation_for as ring_implementation_for
from moe_jax.parallel.ring_attention import ring_attention
from pallas_kernels.attention.cached_attention import cached_attention
from pallas_kernels import platform
from pallas_kernels.attention.causal import causal_attention
from pallas_kernels.attention import latent_decode, tpu_cached_attention, tpu_flash


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
      if axis_size("sequence") > 1:  # time sharded: K/V blocks go round the ring
        o_BxTxHxDv = ring_attention(q_BxTxHxDqk, k_BxTxHxDqk, v_BxTxHxDv, segment_ids_BxT,
                                    implementation=ring_implementation_for(
                                        mla_implementation(cfg),
                                        x_BxTxD.shape[1] // axis_size("sequence")))
      elif mla_implementation(cfg) == "gpu":
        o_BxTxHxDv = per_device(causal_attention, q_BxTxHxDqk, k_BxTxHxDqk, v_BxTxHxDv,
                                segment_ids_BxT)
      elif mla_implementation(cfg) == "tpu" and tpu_flash.fits(x_BxTxD.shape[1]):
        o_BxTxHxDv = per_device(tpu_flash.causal_attention, q_BxTxHxDqk, k_BxTxHxDqk,
                                v_BxTxHxDv, segment_ids_BxT)
      else:
        o_BxTxHxDv = _dense_attention(q_BxTxHxDqk, k_BxTxHxDqk, v_BxTxHxDv, segment_ids_BxT)
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
  """"gpu" (Pallas kernels: training attention (pallas_kernels/attention/causal.py), prefill
  and decode over the cache), "tpu" (jax's Mosaic flash attention for training and
  full-sequence forwards, pallas_kernels/attention/tpu_flash.py, and for ring steps,
  tpu_ring_step.py, where T fits; prefill over the cache, tpu_cached_attention.py; decode
  stays on XLA) or "xla"; "" picks by the target platform."""
  if cfg.mla_implementation:
    return cfg.mla_implementation
  return {"gpu": "gpu", "tpu": "tpu"}.get(platform.target(), "xla")


def _dense_attention(q_BxTxHxDqk, k_BxTxHxDqk, v_BxTxHxDv, segment_ids_BxT):
  """The XLA path, written out ([B, H, T, T] scores, fp32 softmax): Dqk may differ from Dv,
  which jax.nn.dot_product_attention refuses. Attends only within a segment; padding (id 0)
  attends to padding, so no row is empty."""
  T = q_BxTxHxDqk.shape[1]
  s_BxHxTxT = jnp.einsum("bthd,bshd->bhts", q_BxTxHxDqk, k_BxTxHxDqk,
                         preferred_element_type=jnp.float32) * q_BxTxHxDqk.shape[-1] ** -0.5
  visible_BxTxT = (jnp.tril(jnp.ones((T, T), bool))[None]
                   & (segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]))
  s_BxHxTxT = jnp.where(visible_BxTxT[:, None], s_BxHxTxT, -jnp.inf)
  p_BxHxTxT = jax.nn.softmax(s_BxHxTxT, axis=-1).astype(v_BxTxHxDv.dtype)
  return jnp.einsum("bhts,bshd->bthd", p_BxHxTxT, v_BxTxHxDv)


KEY_BLOCK = 1024          # cache positions per step of the XLA online softmax (prefill)
SCORE_BUDGET = 1 << 24    # fp32 scores per step in latent-space (decode) attention...
MAX_KEY_BLOCK = 1 << 16   # ...up to this many positions: decode cost follows the filled length
EXPAND_BLOCK = 1 << 16    # cache positions expanded to K/V per step for the Pallas kernel
DECODE_ROWS = 64          # (new tokens × heads) up to which "gpu" decode uses the split kernel


def _attend_latent_cache(q_BxTxHxDqk, ckv_BxTxR, segment_ids_BxT, cache, k_b, v_b, impl):
  """Writes the new latents at each row's length, then attends over the filled cache.

  Few queries (decode, T < R) attend in the latent space: k_b is absorbed into q and v_b
  applied after; with impl "gpu" and few rows a Pallas kernel split over the cache
  (flash-decoding), else an online softmax over blocks of the filled cache in XLA. Many
  queries (prefill chunks, T ≥ R) expand the filled latents to per-head K/V, which is
  cheaper then, and run a flash kernel (impl "gpu": cached_attention.py, "tpu":
  tpu_cached_attention.py) or the same block loop in XLA. Decode on TPU stays in XLA.
  """
  B, T, H, Dqk = q_BxTxHxDqk.shape
  ckv_BxSxR = cache["ckv"]
  S, R = ckv_BxSxR.shape[1:]
  length_B = cache["length"]
  pos_BxT = length_B[:, None] + jnp.arange(T)
  ckv_BxSxR = ckv_BxSxR.at[jnp.arange(B)[:, None], pos_BxT].set(
      ckv_BxTxR.astype(ckv_BxSxR.dtype), mode="drop")
  filled_B = length_B + (segment_ids_BxT != 0).sum(-1)
  # k_b / v_b kernels [R, H, D]: the projections applied to the identity (exact).
  eye_RxR = jnp.eye(R, dtype=ckv_BxTxR.dtype)
  w_kb_RxHxDqk, w_vb_RxHxDv = k_b(eye_RxR), v_b(eye_RxR)
  q_BxTxHxDqk = q_BxTxHxDqk * jnp.asarray(Dqk ** -0.5, q_BxTxHxDqk.dtype)
  if T < R:
    q_BxTxHxR = jnp.einsum("bthd,rhd->bthr", q_BxTxHxDqk, w_kb_RxHxDqk)
    if impl == "gpu" and T * H <= DECODE_ROWS and latent_decode.fits(R):
      pos_BxTH = jnp.repeat(pos_BxT, H, axis=1)
      o_BxTxHxR = latent_decode.latent_decode_attention(
          q_BxTxHxR.reshape(B, T * H, R), ckv_BxSxR, pos_BxTH, filled_B).reshape(B, T, H, R)
    else:
      key_block = min(S, max(KEY_BLOCK, min(MAX_KEY_BLOCK, SCORE_BUDGET // (B * T * H))))
      o_BxTxHxR = _online_softmax(q_BxTxHxR, ckv_BxSxR, lambda c: c, lambda c: c, pos_BxT,
                                  filled_B, key_block)
    o_BxTxHxDv = jnp.einsum("bthr,rhd->bthd", o_BxTxHxR.astype(q_BxTxHxR.dtype), w_vb_RxHxDv)
  elif impl in ("gpu", "tpu"):
    k_BxSxHxD, v_BxSxHxDv = _expand_filled(ckv_BxSxR, w_kb_RxHxDqk, w_vb_RxHxDv, filled_B)
    kernel = cached_attention if impl == "gpu" else tpu_cached_attention.cached_attention
    o_BxTxHxDv = kernel(q_BxTxHxDqk, k_BxSxHxD, v_BxSxHxDv, length_B, filled_B, scale=1.0)
  else:
    o_BxTxHxDv = _online_softmax(
        q_BxTxHxDqk, ckv_BxSxR, lambda c: jnp.einsum("bsr,rhd->bshd", c, w_kb_RxHxDqk),
        lambda c: jnp.einsum("bsr,rhd->bshd", c, w_vb_RxHxDv), pos_BxT, filled_B,
        min(KEY_BLOCK, S))
  return o_BxTxHxDv, {"ckv": ckv_BxSxR}


def _expand_filled(ckv_BxSxR, w_kb_RxHxDqk, w_vb_RxHxDv, filled_B):
  """Per-head K/V [B, S, H, D] from the latents; only the blocks up to the longest filled
  row are computed (the rest stays zero and is never read)."""
  B, S, _ = ckv_BxSxR.shape
  H, Dqk, Dv = w_kb_RxHxDqk.shape[1], w_kb_RxHxDqk.shape[2], w_vb_RxHxDv.shape[2]
  Se = min(EXPAND_BLOCK, S)

  def block(i, kv):
    start = jnp.minimum(i * Se, S - Se)
    c_BxSexR = jax.lax.dynamic_slice_in_dim(ckv_BxSxR, start, Se, axis=1)
    k = jnp.einsum("bsr,rhd->bshd", c_BxSexR, w_kb_RxHxDqk).astype(kv[0].dtype)
    v = jnp.einsum("bsr,rhd->bshd", c_BxSexR, w_vb_RxHxDv).astype(kv[1].dtype)
    return (jax.lax.dynamic_update_slice_in_dim(kv[0], k, start, axis=1),
            jax.lax.dynamic_update_slice_in_dim(kv[1], v, start, axis=1))

  dtype = jnp.result_type(ckv_BxSxR.dtype, w_kb_RxHxDqk.dtype)
  kv = (jnp.zeros((B, S, H, Dqk), dtype), jnp.zeros((B, S, H, Dv), dtype))
  return jax.lax.fori_loop(0, (filled_B.max() + Se - 1) // Se, block, kv)


def _online_softmax(q_BxTxHxX, ckv_BxSxR, keys, values, pos_BxT, filled_B, Sk):
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
