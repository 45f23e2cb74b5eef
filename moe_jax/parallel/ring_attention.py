"""Ring attention over the `sequence` mesh axis: causal softmax attention with segment ids,
forward and backward, memory per device independent of the total length.

Each of the n shards holds a contiguous slice of T/n queries, keys and values. The K/V
blocks (with their segment ids) travel around the ring by `ppermute`; at step s a shard
holds the block of shard idx − s and merges its scores into an online softmax (running
max and sum). The backward pass (custom VJP) makes the same trip again, recomputing the
probabilities from the saved log-sum-exp, with the dK/dV accumulators travelling with
their blocks and arriving home after n hops. Nothing of size T·(T/n) is ever stored.

Masking uses global positions, so a block from a later shard contributes nothing; those
steps still compute (no zig-zag load balancing yet: shard n−1 does all the useful work
at every step, shard 0 only at the first).
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

AXIS = "sequence"
F32 = jnp.float32


def _scores(q_BxTxHxD, k_BxSxHxD, seg_q_BxT, seg_k_BxS, q_block, k_block, scale):
  """Scaled scores [B, H, T, S] in fp32 with invisible pairs at -inf, and the mask."""
  T, S = q_BxTxHxD.shape[1], k_BxSxHxD.shape[1]
  s_BxHxTxS = jnp.einsum("bthd,bshd->bhts", q_BxTxHxD, k_BxSxHxD,
                         preferred_element_type=F32) * scale
  pos_q_T = q_block * T + jnp.arange(T)
  pos_k_S = k_block * S + jnp.arange(S)
  visible_BxTxS = ((pos_k_S[None, None, :] <= pos_q_T[None, :, None])
                   & (seg_q_BxT[:, :, None] == seg_k_BxS[:, None, :]))
  return jnp.where(visible_BxTxS[:, None], s_BxHxTxS, -jnp.inf), visible_BxTxS


def _ring_perm(n):
  return [(i, (i + 1) % n) for i in range(n)]


def _forward(q, k, v, seg, axis, scale):
  n, idx = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
  B, T, H, _ = q.shape
  Dv = v.shape[-1]

  def step(s, carry):
    m_BxHxT, l_BxHxT, acc_BxTxHxDv, k_blk, v_blk, seg_blk = carry
    src = (idx - s) % n
    s_BxHxTxS, _ = _scores(q, k_blk, seg, seg_blk, idx, src, scale)
    m_new = jnp.maximum(m_BxHxT, s_BxHxTxS.max(-1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p_BxHxTxS = jnp.exp(s_BxHxTxS - m_safe[..., None])
    corr_BxHxT = jnp.exp(m_BxHxT - m_safe)
    pv_BxTxHxDv = jnp.einsum("bhts,bshd->bthd", p_BxHxTxS.astype(v_blk.dtype), v_blk,
                             preferred_element_type=F32)
    acc_BxTxHxDv = acc_BxTxHxDv * jnp.swapaxes(corr_BxHxT, 1, 2)[..., None] + pv_BxTxHxDv
    l_BxHxT = l_BxHxT * corr_BxHxT + p_BxHxTxS.sum(-1)
    k_blk, v_blk, seg_blk = jax.lax.ppermute((k_blk, v_blk, seg_blk), axis, _ring_perm(n))
    return m_new, l_BxHxT, acc_BxTxHxDv, k_blk, v_blk, seg_blk

  init = (jnp.full((B, H, T), -jnp.inf, F32), jnp.zeros((B, H, T), F32),
          jnp.zeros((B, T, H, Dv), F32), k, v, seg)
  m_BxHxT, l_BxHxT, acc_BxTxHxDv, *_ = jax.lax.fori_loop(0, n, step, init)
  # Every query sees itself (same position, same segment), so l > 0.
  o_BxTxHxDv = acc_BxTxHxDv / jnp.swapaxes(l_BxHxT, 1, 2)[..., None]
  lse_BxHxT = m_BxHxT + jnp.log(l_BxHxT)
  return o_BxTxHxDv.astype(q.dtype), lse_BxHxT


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def ring_attention_shard(q_BxTxHxD, k_BxTxHxD, v_BxTxHxDv, segment_ids_BxT, axis=AXIS,
                         scale=None):
  """Per-shard body (inside shard_map over `axis`): causal attention of this shard's queries
  over every earlier position in the same segment. [B, T/n, H, Dv]."""
  scale = q_BxTxHxD.shape[-1] ** -0.5 if scale is None else scale
  return _forward(q_BxTxHxD, k_BxTxHxD, v_BxTxHxDv, segment_ids_BxT, axis, scale)[0]


def _fwd(q, k, v, seg, axis, scale):
  scale_ = q.shape[-1] ** -0.5 if scale is None else scale
  o, lse = _forward(q, k, v, seg, axis, scale_)
  return o, (q, k, v, seg, o, lse)


def _bwd(axis, scale, res, do_BxTxHxDv):
  q, k, v, seg, o, lse_BxHxT = res
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  n, idx = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
  do32 = do_BxTxHxDv.astype(F32)
  delta_BxHxT = jnp.einsum("bthd,bthd->bht", do32, o.astype(F32))

  def step(s, carry):
    dq_BxTxHxD, k_blk, v_blk, seg_blk, dk_blk, dv_blk = carry
    src = (idx - s) % n
    s_BxHxTxS, visible_BxTxS = _scores(q, k_blk, seg, seg_blk, idx, src, scale)
    p_BxHxTxS = jnp.where(visible_BxTxS[:, None], jnp.exp(s_BxHxTxS - lse_BxHxT[..., None]), 0.0)
    dv_blk = dv_blk + jnp.einsum("bhts,bthd->bshd", p_BxHxTxS, do32)
    dp_BxHxTxS = jnp.einsum("bthd,bshd->bhts", do32, v_blk.astype(F32))
    ds_BxHxTxS = p_BxHxTxS * (dp_BxHxTxS - delta_BxHxT[..., None]) * scale
    dq_BxTxHxD = dq_BxTxHxD + jnp.einsum("bhts,bshd->bthd", ds_BxHxTxS, k_blk.astype(F32))
    dk_blk = dk_blk + jnp.einsum("bhts,bthd->bshd", ds_BxHxTxS, q.astype(F32))
    # K/V move on to the next shard; their gradients travel with them.
    k_blk, v_blk, seg_blk, dk_blk, dv_blk = jax.lax.ppermute(
        (k_blk, v_blk, seg_blk, dk_blk, dv_blk), axis, _ring_perm(n))
    return dq_BxTxHxD, k_blk, v_blk, seg_blk, dk_blk, dv_blk

  init = (jnp.zeros(q.shape, F32), k, v, seg, jnp.zeros(k.shape, F32), jnp.zeros(v.shape, F32))
  dq, _, _, _, dk, dv = jax.lax.fori_loop(0, n, step, init)  # n hops: dK/dV are home
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


ring_attention_shard.defvjp(_fwd, _bwd)


def ring_attention(q_BxTxHxD, k_BxTxHxD, v_BxTxHxDv, segment_ids_BxT, *, mesh=None,
                   batch_axes=("data", "fsdp", "expert"), head_axis="tensor", axis=AXIS,
                   scale=None):
  """Causal, segment-masked attention on [B, T, H, ·] arrays sharded over `axis` along T
  (shard_map over the mesh set with jax.set_mesh, or `mesh`)."""
  mesh = mesh or jax.sharding.get_abstract_mesh()
  names = set(mesh.axis_names)
  bax = tuple(a for a in batch_axes if a in names) or None
  hax = head_axis if head_axis in names else None
  x4 = P(bax, axis, hax, None)
  body = lambda q, k, v, seg: ring_attention_shard(q, k, v, seg, axis, scale)
  return jax.shard_map(body, mesh=mesh, in_specs=(x4, x4, x4, P(bax, axis)), out_specs=x4,
                       check_vma=False)(q_BxTxHxD, k_BxTxHxD, v_BxTxHxDv, segment_ids_BxT)
