"""The attention ops and their dispatch: which kernel runs for an implementation ("gpu":
the Pallas kernels in this folder, Triton lowering; "cudnn": "gpu" with cuDNN's fused
attention for training (cudnn_packed.py); "tpu": jax's Mosaic flash attention and the
Mosaic TPU cache kernel; "xla": reference.py's attention and xla_cached.py's blocks).

* causal_attention: training and full-sequence forwards on one device.
* ring_step_implementation: which step kernels ring attention
  (moe_jax/parallel/ring_attention.py) runs when the sequence is sharded.
* latent_cache_attention: MLA over its latent cache (prefill chunks and decode).
"""

import jax
import jax.numpy as jnp

from pallas_kernels import platform
from pallas_kernels.attention import (cudnn_packed, pallas_gpu_cached, pallas_gpu_causal,
                                      pallas_gpu_latent_decode, pallas_tpu_cached,
                                      pallas_tpu_flash, reference, xla_cached)

IMPLEMENTATIONS = ("gpu", "cudnn", "tpu", "xla")
DECODE_ROWS = 64          # (new tokens × heads) up to which "gpu" decode uses the split kernel


def implementation(requested: str = "") -> str:
  """`requested` (one of IMPLEMENTATIONS), or with "" the target platform's ("xla" on CPU)."""
  if requested and requested not in IMPLEMENTATIONS:
    raise ValueError(f"attention implementation must be '' or one of {IMPLEMENTATIONS}, got "
                     f"{requested!r}")
  return requested or {"gpu": "gpu", "tpu": "tpu"}.get(platform.target(), "xla")


def causal_attention(q_BxTxHxDqk, k_BxTxHxDqk, v_BxTxHxDv, segment_ids_BxT, *, implementation):
  """Causal attention within each segment on one device (reference.causal_attention's
  contract): "gpu" the Pallas flash kernels (pallas_gpu_causal.py), "cudnn" cuDNN's fused
  attention in its packed layout on a GPU where it takes the dtype and head dims
  (cudnn_packed.py; else as "gpu"),
  "tpu" jax's Mosaic flash kernels where T is whole 128-position tiles
  (pallas_tpu_flash.py), else XLA."""
  args = (q_BxTxHxDqk, k_BxTxHxDqk, v_BxTxHxDv, segment_ids_BxT)
  if (implementation == "cudnn" and platform.target() == "gpu"
      and cudnn_packed.fits(q_BxTxHxDqk, v_BxTxHxDv)):
    return cudnn_packed.causal_attention(*args)
  if implementation in ("gpu", "cudnn"):
    return pallas_gpu_causal.causal_attention(*args)
  if implementation == "tpu" and pallas_tpu_flash.fits(q_BxTxHxDqk.shape[1]):
    return pallas_tpu_flash.causal_attention(*args)
  return reference.causal_attention(*args)


def ring_step_implementation(implementation: str, shard_len: int) -> str:
  """Ring attention's step kernels for an attention implementation: "pallas" on GPU
  (pallas_gpu_ring_step.py), "tpu" on TPU where the shard is whole 128-position tiles
  (pallas_tpu_ring_step.py), else "xla"."""
  if implementation in ("gpu", "cudnn"):
    return "pallas"
  return "tpu" if implementation == "tpu" and pallas_tpu_flash.fits(shard_len) else "xla"


def latent_cache_attention(q_BxTxHxDqk, ckv_BxSxR, w_kb_RxHxDqk, w_vb_RxHxDv, length_B,
                           filled_B, *, implementation):
  """MLA's attention over a latent cache ckv [B, S, R] that already holds the new tokens:
  query t of row b sits at length[b] + t and sees positions up to it below filled[b]; k_b
  and v_b are the [R, H, D] up-projections; q is pre-scaled. Returns [B, T, H, Dv].

  Few queries (decode, T < R) attend in the latent space: k_b is absorbed into q and v_b
  applied after, so the cache is never expanded; with "gpu" and few rows the split-cache
  kernel (pallas_gpu_latent_decode.py), else xla_cached's block loop. Many queries (prefill chunks,
  T ≥ R) expand the filled latents to per-head K/V, which is cheaper then, and run a flash
  kernel ("gpu": pallas_gpu_cached.py, "tpu": pallas_tpu_cached.py) or the block loop; on
  "gpu" a cache longer than xla_cached.EXPAND_BLOCK goes window by window
  (_gpu_windowed_prefill), so memory does not grow with the cache. "cudnn" is "gpu" here."""
  implementation = "gpu" if implementation == "cudnn" else implementation
  B, T, H, _ = q_BxTxHxDqk.shape
  S, R = ckv_BxSxR.shape[1:]
  pos_BxT = length_B[:, None] + jnp.arange(T)
  if T < R:
    q_BxTxHxR = jnp.einsum("bthd,rhd->bthr", q_BxTxHxDqk, w_kb_RxHxDqk)
    if implementation == "gpu" and T * H <= DECODE_ROWS and pallas_gpu_latent_decode.fits(R):
      pos_BxTH = jnp.repeat(pos_BxT, H, axis=1)
      o_BxTxHxR = pallas_gpu_latent_decode.latent_decode_attention(
          q_BxTxHxR.reshape(B, T * H, R), ckv_BxSxR, pos_BxTH, filled_B).reshape(B, T, H, R)
    else:
      key_block = min(S, max(xla_cached.KEY_BLOCK, min(xla_cached.MAX_KEY_BLOCK,
                                                       xla_cached.SCORE_BUDGET // (B * T * H))))
      o_BxTxHxR = xla_cached.online_softmax(q_BxTxHxR, ckv_BxSxR, lambda c: c, lambda c: c,
                                            pos_BxT, filled_B, key_block)
    return jnp.einsum("bthr,rhd->bthd", o_BxTxHxR.astype(q_BxTxHxR.dtype), w_vb_RxHxDv)
  if implementation == "gpu" and S > xla_cached.EXPAND_BLOCK:
    return _gpu_windowed_prefill(q_BxTxHxDqk, ckv_BxSxR, w_kb_RxHxDqk, w_vb_RxHxDv, length_B,
                                 filled_B, xla_cached.EXPAND_BLOCK)
  if implementation in ("gpu", "tpu"):
    k_BxSxHxD, v_BxSxHxDv = xla_cached.expand_filled(ckv_BxSxR, w_kb_RxHxDqk, w_vb_RxHxDv,
                                                     filled_B)
    kernel = (pallas_gpu_cached.cached_attention if implementation == "gpu"
              else pallas_tpu_cached.cached_attention)
    return kernel(q_BxTxHxDqk, k_BxSxHxD, v_BxSxHxDv, length_B, filled_B, scale=1.0)
  return xla_cached.online_softmax(
      q_BxTxHxDqk, ckv_BxSxR, lambda c: jnp.einsum("bsr,rhd->bshd", c, w_kb_RxHxDqk),
      lambda c: jnp.einsum("bsr,rhd->bshd", c, w_vb_RxHxDv), pos_BxT, filled_B,
      min(xla_cached.KEY_BLOCK, S))


def _gpu_windowed_prefill(q_BxTxHxDqk, ckv_BxSxR, w_kb_RxHxDqk, w_vb_RxHxDv, length_B,
                          filled_B, window):
  """Prefill attention over a long latent cache, `window` positions at a time: each window's
  latents expand to per-head K/V [B, window, H, D] and the flash kernel attends over them,
  giving each query's output and log-sum-exp; the windows merge by their log-sum-exps.

  Why: expanding the whole cache at once holds [B, S, H, Dqk + Dv] (plus the kernel's padded
  copy), which at Kimi-48B's MLA (32 heads, 192 + 128) and a 1M cache is 20 GiB a layer
  before copies. Windowed, memory is one window's K/V whatever S is, and windows past the
  longest filled row are never expanded."""
  B, T, H, _ = q_BxTxHxDqk.shape
  S = ckv_BxSxR.shape[1]
  Dv = w_vb_RxHxDv.shape[-1]
  n_windows = -(-S // window)
  # Whole windows: positions past S are past every filled length, so never visible. The
  # pad copies the latents once a step (none when window divides S): about 1/18 of the K/V
  # bytes the windows write at Kimi-48B's widths (H·(Dqk + Dv) = 10240 against R = 576).
  ckv_BxSpxR = jnp.pad(ckv_BxSxR, ((0, 0), (0, n_windows * window - S), (0, 0)))

  def one_window(i, carry):
    start = i * window
    k_BxWxHxD, v_BxWxHxDv = xla_cached.expand_block(
        jax.lax.dynamic_slice_in_dim(ckv_BxSpxR, start, window, axis=1), w_kb_RxHxDqk,
        w_vb_RxHxDv)
    o_w, lse_w = pallas_gpu_cached.cached_attention(
        q_BxTxHxDqk, k_BxWxHxD, v_BxWxHxDv, length_B - start,
        jnp.clip(filled_B - start, 0, window), scale=1.0, return_lse=True)
    return merge_by_lse(*carry, o_w.astype(jnp.float32), lse_w)

  carry = (jnp.zeros((B, T, H, Dv), jnp.float32), jnp.full((B, T, H), -jnp.inf, jnp.float32))
  n_filled = (filled_B.max() + window - 1) // window
  o_BxTxHxDv, _ = jax.lax.fori_loop(0, n_filled, one_window, carry)
  return o_BxTxHxDv.astype(q_BxTxHxDqk.dtype)


def merge_by_lse(o_a, lse_a, o_b, lse_b):
  """Attention of the same queries over two disjoint sets of keys, each normalised over its
  own set (o [..., Dv], fp32) with its log-sum-exp (lse [...], -inf where a query saw no
  key), merged into attention over the union: (o, lse). Ring attention's steps and the
  windowed prefill merge this way."""
  m = jnp.maximum(lse_a, lse_b)
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)
  w_a, w_b = jnp.exp(lse_a - m_safe), jnp.exp(lse_b - m_safe)
  total = w_a + w_b
  safe = jnp.where(total > 0, total, 1.0)
  o = (o_a * w_a[..., None] + o_b * w_b[..., None]) / safe[..., None]
  return o, jnp.where(total > 0, m_safe + jnp.log(safe), -jnp.inf)
