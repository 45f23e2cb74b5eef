"""The exact specs the attention kernels are tested against: every score materialised,
softmax in fp32. causal_attention is also the XLA path of training attention (ops.py)."""

import jax
import jax.numpy as jnp

F32 = jnp.float32


def causal_attention(q_BxTxHxDqk, k_BxTxHxDqk, v_BxTxHxDv, segment_ids_BxT):
  """Causal attention within each segment ([B, H, T, T] scores, fp32 softmax): also the XLA
  path. Dqk may differ from Dv, which jax.nn.dot_product_attention refuses. Padding (id 0)
  attends to padding, so no row is empty."""
  T = q_BxTxHxDqk.shape[1]
  s_BxHxTxT = jnp.einsum("bthd,bshd->bhts", q_BxTxHxDqk, k_BxTxHxDqk,
                         preferred_element_type=jnp.float32) * q_BxTxHxDqk.shape[-1] ** -0.5
  visible_BxTxT = (jnp.tril(jnp.ones((T, T), bool))[None]
                   & (segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]))
  s_BxHxTxT = jnp.where(visible_BxTxT[:, None], s_BxHxTxT, -jnp.inf)
  p_BxHxTxT = jax.nn.softmax(s_BxHxTxT, axis=-1).astype(v_BxTxHxDv.dtype)
  return jnp.einsum("bhts,bshd->bthd", p_BxHxTxT, v_BxTxHxDv)


def block_attention(q_BxTxHxD, k_BxSxHxD, v_BxSxHxDv, seg_q_BxT, seg_k_BxS, q_first, k_first,
                    scale=None):
  """(o, log-sum-exp [B, H, T]) of queries at positions q_first + t against keys at
  k_first + s: one ring step (pallas_gpu_ring_step.py). Key s is visible to query t when
  k_first + s ≤ q_first + t and their segment ids are equal; a query that sees nothing
  gives o = 0 and lse = -inf."""
  T, S, D = q_BxTxHxD.shape[1], k_BxSxHxD.shape[1], q_BxTxHxD.shape[-1]
  scale = D ** -0.5 if scale is None else scale
  pos_q, pos_k = q_first + jnp.arange(T), k_first + jnp.arange(S)
  visible_BxTxS = ((pos_k[None, None, :] <= pos_q[None, :, None])
                   & (seg_q_BxT[:, :, None] == seg_k_BxS[:, None, :]))
  s_BxHxTxS = jnp.einsum("bthd,bshd->bhts", q_BxTxHxD.astype(F32), k_BxSxHxD.astype(F32))
  s_BxHxTxS = jnp.where(visible_BxTxS[:, None], s_BxHxTxS * scale, -jnp.inf)
  lse_BxHxT = jax.nn.logsumexp(s_BxHxTxS, axis=-1)
  p_BxHxTxS = jnp.where(visible_BxTxS[:, None], jnp.exp(
      s_BxHxTxS - jnp.where(jnp.isfinite(lse_BxHxT), lse_BxHxT, 0.0)[..., None]), 0.0)
  return jnp.einsum("bhts,bshd->bthd", p_BxHxTxS, v_BxSxHxDv.astype(F32)), lse_BxHxT


def cached_attention(q_BxTxHxD, k_BxSxHxD, v_BxSxHxDv, q_start_B, kv_len_B, *, scale=None):
  """Queries of row b at positions q_start[b] + t over a cache: position j is visible when
  j ≤ q_start[b] + t and j < kv_len[b]; a row that sees nothing gives zeros. fp32 scores."""
  T, S, D = q_BxTxHxD.shape[1], k_BxSxHxD.shape[1], q_BxTxHxD.shape[-1]
  scale = D ** -0.5 if scale is None else scale
  s_BxHxTxS = jnp.einsum("bthd,bshd->bhts", q_BxTxHxD.astype(F32), k_BxSxHxD.astype(F32)) * scale
  pos_BxT = q_start_B[:, None] + jnp.arange(T)
  j_S = jnp.arange(S)
  visible_BxTxS = (j_S <= pos_BxT[..., None]) & (j_S < kv_len_B[:, None, None])
  s_BxHxTxS = jnp.where(visible_BxTxS[:, None], s_BxHxTxS, -jnp.inf)
  p_BxHxTxS = jnp.exp(s_BxHxTxS - jnp.max(s_BxHxTxS, -1, keepdims=True))
  p_BxHxTxS = jnp.where(visible_BxTxS[:, None], p_BxHxTxS, 0.0)
  l_BxHxT = p_BxHxTxS.sum(-1, keepdims=True)
  p_BxHxTxS = p_BxHxTxS / jnp.where(l_BxHxT == 0, 1.0, l_BxHxT)
  o = jnp.einsum("bhts,bshd->bthd", p_BxHxTxS, v_BxSxHxDv.astype(F32))
  return o.astype(q_BxTxHxD.dtype)


def latent_attention(q_BxQxR, ckv_BxSxR, pos_BxQ, kv_len_B):
  """Decode rows over a latent cache that is both keys and values (pallas_gpu_latent_decode.py): row
  q of batch b sees cache positions j ≤ pos[b, q] with j < kv_len[b]; q is pre-scaled. A
  row that sees nothing gives zeros."""
  S = ckv_BxSxR.shape[1]
  s_BxQxS = jnp.einsum("bqr,bsr->bqs", q_BxQxR.astype(F32), ckv_BxSxR.astype(F32))
  j_S = jnp.arange(S)
  visible_BxQxS = (j_S <= pos_BxQ[..., None]) & (j_S < kv_len_B[:, None, None])
  m_BxQx1 = jnp.where(visible_BxQxS, s_BxQxS, -jnp.inf).max(-1, keepdims=True)
  p_BxQxS = jnp.where(visible_BxQxS, jnp.exp(s_BxQxS - m_BxQx1), 0.0)
  l_BxQx1 = p_BxQxS.sum(-1, keepdims=True)
  o_BxQxR = jnp.einsum("bqs,bsr->bqr", p_BxQxS / jnp.where(l_BxQx1 == 0, 1.0, l_BxQx1),
                       ckv_BxSxR.astype(F32))
  return o_BxQxR.astype(q_BxQxR.dtype)
