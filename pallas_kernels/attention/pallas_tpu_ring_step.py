"""One ring-attention step on TPU: jax's Mosaic flash kernels
(jax.experimental.pallas.ops.tpu.flash_attention) for this shard's queries against one
travelling K/V block; the same contract as pallas_gpu_ring_step.py, the GPU kernels.

The ring's blocks are T long and start at multiples of T, so a step is one of three kinds:
the shard's own block (causal, offset 0), an earlier block (every key precedes every query:
no causal mask, segment ids only) or a later one (nothing visible: no kernel runs). Those
are exactly the kernel's causal=True and causal=False, so the step calls it on whole blocks.

Two things differ from the kernel's public entry, which is why this calls its parts:
- The forward keeps the softmax statistics (l, m) so that the ring can merge steps by
  log-sum-exp. The kernel masks with a *finite* value, so a query that sees nothing in an
  earlier block (another document) gets a uniform average there, not nothing: its
  log-sum-exp is set to -inf here, which gives that step zero weight in the merge.
- The backward runs the dq and dk/dv kernels with the *final* statistics (m = lse, l = 1),
  so p = exp(s - lse) and each step yields exactly its share of the full gradient; masked
  scores stay at the finite mask value, whose exp(· - lse) is 0.

The step's gradients come out in the inputs' dtype (the kernels' output); the ring sums
them in fp32.
"""

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import flash_attention as fa

from pallas_kernels.attention import pallas_tpu_flash

F32 = jnp.float32
SKIP, EARLIER, OWN = 0, 1, 2   # kinds of step: lax.switch branch indices


def _kind(q_first, k_first):
  """Which step this is, from the blocks' first positions (equal-length ring blocks)."""
  return jnp.where(k_first == q_first, OWN, jnp.where(k_first < q_first, EARLIER, SKIP))


def _inputs(q_BxTxHxD, k_BxTxHxD, v_BxTxHxDv, seg_q_BxT, seg_k_BxT):
  B, T, H, D = q_BxTxHxD.shape
  if not pallas_tpu_flash.fits(T) or k_BxTxHxD.shape[1] != T:
    raise ValueError(f"tpu_ring_step takes equal query and key blocks of a multiple of "
                     f"{pallas_tpu_flash.BLOCK} positions; got {T} and {k_BxTxHxD.shape[1]}")
  Dp = pallas_tpu_flash.common_dim(D, v_BxTxHxDv.shape[-1])
  q, k, v = (pallas_tpu_flash.heads_first(x, Dp) for x in (q_BxTxHxD, k_BxTxHxD, v_BxTxHxDv))
  seg = fa.SegmentIds(q=seg_q_BxT.astype(jnp.int32), kv=seg_k_BxT.astype(jnp.int32))
  return q, k, v, seg


def ring_step_forward(q_BxTxHxD, k_BxTxHxD, v_BxTxHxDv, seg_q_BxT, seg_k_BxT, q_first, k_first,
                      *, scale):
  """(o [B,T,H,Dv] fp32, normalised over this block; lse [B,H,T] fp32, -inf where the block
  shows a query nothing)."""
  B, T, H, _ = q_BxTxHxD.shape
  Dv = v_BxTxHxDv.shape[-1]
  q, k, v, seg = _inputs(q_BxTxHxD, k_BxTxHxD, v_BxTxHxDv, seg_q_BxT, seg_k_BxT)
  b = pallas_tpu_flash.BLOCKS

  def attend(causal):
    def run():
      with jax.named_scope("ring_flash_fwd_" + ("own" if causal else "earlier")):  # HLO name
        o_BxHxTxD, l_BxHxT, m_BxHxT = fa._flash_attention_impl(
            q, k, v, None, seg, True, causal, scale, b.block_b, b.block_q, b.block_k_major,
            b.block_k, False)
      # m stays at the mask value only where every score was masked.
      seen_BxHxT = m_BxHxT > 0.5 * fa.DEFAULT_MASK_VALUE
      lse_BxHxT = jnp.where(seen_BxHxT, m_BxHxT + jnp.log(jnp.where(seen_BxHxT, l_BxHxT, 1.0)),
                            -jnp.inf)
      return pallas_tpu_flash.heads_last(o_BxHxTxD, Dv).astype(F32), lse_BxHxT.astype(F32)
    return run

  def skip():
    return jnp.zeros((B, T, H, Dv), F32), jnp.full((B, H, T), -jnp.inf, F32)

  return jax.lax.switch(_kind(q_first, k_first), [skip, attend(False), attend(True)])


def ring_step_backward(q_BxTxHxD, k_BxTxHxD, v_BxTxHxDv, seg_q_BxT, seg_k_BxT, q_first, k_first,
                       do_BxTxHxDv, lse_BxHxT, delta_BxHxT, *, scale):
  """This step's share of (dq, dk, dv), fp32, from the final lse and delta = rowsum(dO ⊙ O)."""
  D, Dv = q_BxTxHxD.shape[-1], v_BxTxHxDv.shape[-1]
  q, k, v, seg = _inputs(q_BxTxHxD, k_BxTxHxD, v_BxTxHxDv, seg_q_BxT, seg_k_BxT)
  do = pallas_tpu_flash.heads_first(do_BxTxHxDv.astype(q.dtype), q.shape[-1])
  m_BxHxT, l_BxHxT = lse_BxHxT.astype(F32), jnp.ones_like(lse_BxHxT, F32)
  di_BxHxT = delta_BxHxT.astype(F32)
  b = pallas_tpu_flash.BLOCKS

  def grads(causal):
    def run():
      common = dict(sm_scale=scale, causal=causal, mask_value=fa.DEFAULT_MASK_VALUE,
                    debug=False)
      dk, dv = fa._flash_attention_bwd_dkv(
          q, k, v, None, seg, l_BxHxT, m_BxHxT, do, di_BxHxT,
          block_q_major=b.block_q_major_dkv, block_q=b.block_q_dkv,
          block_k_major=b.block_k_major_dkv, block_k=b.block_k_dkv, **common)
      dq, _ = fa._flash_attention_bwd_dq(
          q, k, v, None, seg, l_BxHxT, m_BxHxT, do, di_BxHxT, block_q_major=b.block_q_dq,
          block_k_major=b.block_k_major_dq, block_k=b.block_k_dq, **common)
      return tuple(pallas_tpu_flash.heads_last(x, d).astype(F32) for x, d in ((dq, D), (dk, D),
                                                                         (dv, Dv)))
    return run

  def skip():
    return tuple(jnp.zeros(x.shape, F32) for x in (q_BxTxHxD, k_BxTxHxD, v_BxTxHxDv))

  return jax.lax.switch(_kind(q_first, k_first), [skip, grads(False), grads(True)])
