"""Ring attention over the `sequence` mesh axis: causal softmax attention with segment ids,
forward and backward, memory per device independent of the total length.

Each of the n shards holds a contiguous slice of T/n queries, keys and values. The K/V
blocks (with their segment ids) travel around the ring by `ppermute`; at step s a shard
holds the block of shard idx − s and merges its scores into an online softmax (running
max and sum). The backward pass (custom VJP) makes the same trip again, recomputing the
probabilities from the saved log-sum-exp, with the dK/dV accumulators travelling with
their blocks and arriving home after n hops. Nothing of size T·(T/n) is ever stored.

Inside a ring step the block is processed up to SUB × SUB positions at a time (scores never
exceed [B, H, SUB, SUB]), and sub-blocks wholly in the causal future are skipped; a K/V
block from a later shard costs nothing but its transfer. There is no zig-zag load
balancing yet: the last shard does useful work at every step, shard 0 only at the first.

implementation="pallas" (the GPU default) runs each step as flash kernels instead
(pallas_kernels/attention/pallas_gpu_ring_step.py): per-step output and log-sum-exp merged across
steps, and the backward from the final log-sum-exp; no score block is ever materialised.
implementation="tpu" (the TPU default where the shard length is a multiple of 128) does the
same with jax's Mosaic flash kernels (pallas_kernels/attention/pallas_tpu_ring_step.py).
"""

import functools

import jax
import jax.numpy as jnp

from moe_jax.parallel.mesh import activation_spec
from pallas_kernels.attention import (ops as attention_ops, pallas_gpu_ring_step,
                                      pallas_tpu_flash, pallas_tpu_ring_step)

AXIS = "sequence"
F32 = jnp.float32


# Query and key positions per sub-block inside a ring step (scores [B, H, SUB, SUB] fp32).
# Larger runs faster (fewer host-driven loop iterations): on two H200s at 64K, 381 ms with
# 4096 against 547 ms with 1024 (benchmarks/sequence.md); 2048 keeps the scores at 16 MB
# per batch row and head group.
SUB = 2048
MIN_SUB = SUB // 4   # a longer shard must be a multiple of this (config.py checks it)


def _scores(q_BxCxHxD, k_BxCxHxD, seg_q_BxC, seg_k_BxC, pos_q_C, pos_k_C, scale):
  """Scaled scores [B, H, Cq, Ck] in fp32 with invisible pairs at -inf, and the mask."""
  s_BxHxCxC = jnp.einsum("bthd,bshd->bhts", q_BxCxHxD, k_BxCxHxD,
                         preferred_element_type=F32) * scale
  visible_BxCxC = ((pos_k_C[None, None, :] <= pos_q_C[None, :, None])
                   & (seg_q_BxC[:, :, None] == seg_k_BxC[:, None, :]))
  return jnp.where(visible_BxCxC[:, None], s_BxHxCxC, -jnp.inf), visible_BxCxC


def _ring_perm(n):
  return [(i, (i + 1) % n) for i in range(n)]


def _sub(T):
  """Sub-block length for a shard of T positions: the whole shard up to SUB, else the
  largest of SUB, SUB/2, SUB/4 that divides it."""
  if T <= SUB:
    return T
  for C in (SUB, SUB // 2, SUB // 4):
    if T % C == 0:
      return C
  raise ValueError(f"ring attention: the per-shard length {T} must be at most SUB={SUB} or a "
                   f"multiple of {SUB // 4}")


def _blocks(x, C):
  """[B, T, ...] → [T/C, B, C, ...] (sub-blocks first, for lax.map / scan)."""
  return jnp.moveaxis(x.reshape(x.shape[0], -1, C, *x.shape[2:]), 1, 0)


def _unblocks(x):
  """Inverse of _blocks."""
  x = jnp.moveaxis(x, 0, 1)
  return x.reshape(x.shape[0], -1, *x.shape[3:])


def _n_visible(q_first, k_first, C, n_k):
  """Key sub-blocks [0, n) that hold any position ≤ the query sub-block's last position."""
  return jnp.clip((q_first + C - 1 - k_first) // C + 1, 0, n_k)


def _attend_block(q, k_blk, v_blk, seg, seg_blk, q_first, k_first, m, l, acc, scale):
  """Merges one ring step's K/V block into the running (m [B,H,T], l, acc [B,T,H,Dv]),
  SUB × SUB scores at a time, skipping key sub-blocks past each query sub-block."""
  T = q.shape[1]
  C = _sub(T)
  n_k = T // C
  k_b, v_b, segk_b = _blocks(k_blk, C), _blocks(v_blk, C), _blocks(seg_blk, C)

  def per_q(args):
    i, q_c, segq_c, m_c, l_c, acc_c = args
    pos_q = q_first + i * C + jnp.arange(C)

    def per_k(j, carry):
      m_c, l_c, acc_c = carry
      pos_k = k_first + j * C + jnp.arange(C)
      s_BxHxCxC, _ = _scores(q_c, k_b[j], segq_c, segk_b[j], pos_q, pos_k, scale)
      m_new = jnp.maximum(m_c, s_BxHxCxC.max(-1))
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      p_BxHxCxC = jnp.exp(s_BxHxCxC - m_safe[..., None])
      corr_BxHxC = jnp.exp(m_c - m_safe)
      pv_BxCxHxDv = jnp.einsum("bhts,bshd->bthd", p_BxHxCxC.astype(v_b.dtype), v_b[j],
                               preferred_element_type=F32)
      acc_c = acc_c * jnp.swapaxes(corr_BxHxC, 1, 2)[..., None] + pv_BxCxHxDv
      return m_new, l_c * corr_BxHxC + p_BxHxCxC.sum(-1), acc_c

    return jax.lax.fori_loop(0, _n_visible(q_first + i * C, k_first, C, n_k), per_k,
                             (m_c, l_c, acc_c))

  m_b = jnp.moveaxis(m.reshape(*m.shape[:2], -1, C), 2, 0)
  l_b = jnp.moveaxis(l.reshape(*l.shape[:2], -1, C), 2, 0)
  m_b, l_b, acc_b = jax.lax.map(per_q, (jnp.arange(T // C), _blocks(q, C), _blocks(seg, C),
                                        m_b, l_b, _blocks(acc, C)))
  unb = lambda x: jnp.moveaxis(x, 0, 2).reshape(*x.shape[1:3], -1)
  return unb(m_b), unb(l_b), _unblocks(acc_b)


# The flash-kernel step modules: ring_step_forward / ring_step_backward with one contract.
_KERNEL_STEPS = {"pallas": pallas_gpu_ring_step, "tpu": pallas_tpu_ring_step}


def _forward_kernels(q, k, v, seg, axis, scale, steps):
  """The forward with each step flash kernels (`steps`), merged by log-sum-exp."""
  n, idx = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
  B, T, H, _ = q.shape

  def step(s, carry):
    o_BxTxHxDv, lse_BxHxT, k_blk, v_blk, seg_blk = carry
    src = (idx - s) % n
    o_s, lse_s = steps.ring_step_forward(q, k_blk, v_blk, seg, seg_blk, idx * T, src * T,
                                         scale=scale)
    rows = lambda x: jnp.swapaxes(x, 1, 2)                      # [B,H,T] ↔ [B,T,H]
    o_BxTxHxDv, lse_BxTxH = attention_ops.merge_by_lse(o_BxTxHxDv, rows(lse_BxHxT), o_s,
                                                       rows(lse_s))
    lse_BxHxT = rows(lse_BxTxH)
    k_blk, v_blk, seg_blk = jax.lax.ppermute((k_blk, v_blk, seg_blk), axis, _ring_perm(n))
    return o_BxTxHxDv, lse_BxHxT, k_blk, v_blk, seg_blk

  init = (jnp.zeros((B, T, H, v.shape[-1]), F32), jnp.full((B, H, T), -jnp.inf, F32), k, v, seg)
  o_BxTxHxDv, lse_BxHxT, *_ = jax.lax.fori_loop(0, n, step, init)
  return o_BxTxHxDv.astype(q.dtype), lse_BxHxT


def _forward(q, k, v, seg, axis, scale, impl):
  if impl in _KERNEL_STEPS:
    return _forward_kernels(q, k, v, seg, axis, scale, _KERNEL_STEPS[impl])
  n, idx = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
  B, T, H, _ = q.shape
  Dv = v.shape[-1]

  def step(s, carry):
    m_BxHxT, l_BxHxT, acc_BxTxHxDv, k_blk, v_blk, seg_blk = carry
    src = (idx - s) % n
    m_BxHxT, l_BxHxT, acc_BxTxHxDv = _attend_block(
        q, k_blk, v_blk, seg, seg_blk, idx * T, src * T, m_BxHxT, l_BxHxT, acc_BxTxHxDv, scale)
    k_blk, v_blk, seg_blk = jax.lax.ppermute((k_blk, v_blk, seg_blk), axis, _ring_perm(n))
    return m_BxHxT, l_BxHxT, acc_BxTxHxDv, k_blk, v_blk, seg_blk

  init = (jnp.full((B, H, T), -jnp.inf, F32), jnp.zeros((B, H, T), F32),
          jnp.zeros((B, T, H, Dv), F32), k, v, seg)
  m_BxHxT, l_BxHxT, acc_BxTxHxDv, *_ = jax.lax.fori_loop(0, n, step, init)
  # Every query sees itself (same position, same segment), so l > 0.
  o_BxTxHxDv = acc_BxTxHxDv / jnp.swapaxes(l_BxHxT, 1, 2)[..., None]
  lse_BxHxT = m_BxHxT + jnp.log(l_BxHxT)
  return o_BxTxHxDv.astype(q.dtype), lse_BxHxT


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def ring_attention_shard(q_BxTxHxD, k_BxTxHxD, v_BxTxHxDv, segment_ids_BxT, axis=AXIS,
                         scale=None, impl="xla"):
  """Per-shard body (inside shard_map over `axis`): causal attention of this shard's queries
  over every earlier position in the same segment. [B, T/n, H, Dv]."""
  scale = q_BxTxHxD.shape[-1] ** -0.5 if scale is None else scale
  return _forward(q_BxTxHxD, k_BxTxHxD, v_BxTxHxDv, segment_ids_BxT, axis, scale, impl)[0]


def _fwd(q, k, v, seg, axis, scale, impl):
  scale_ = q.shape[-1] ** -0.5 if scale is None else scale
  o, lse = _forward(q, k, v, seg, axis, scale_, impl)
  return o, (q, k, v, seg, o, lse)


def _grad_block(q, do, lse, delta, k_blk, v_blk, seg, seg_blk, q_first, k_first, dq, scale):
  """One ring step of the backward: dq [B,T,H,D] (accumulated) and this K/V block's
  (dk, dv), SUB × SUB at a time, query sub-blocks before a key sub-block skipped."""
  T = q.shape[1]
  C = _sub(T)
  n_q = T // C
  dt = q.dtype
  q_b, do_b, segq_b = _blocks(q, C), _blocks(do.astype(dt), C), _blocks(seg, C)
  lse_b = jnp.moveaxis(lse.reshape(*lse.shape[:2], -1, C), 2, 0)
  delta_b = jnp.moveaxis(delta.reshape(*delta.shape[:2], -1, C), 2, 0)

  def per_k(dq_b, args):
    j, k_c, v_c, segk_c = args
    pos_k = k_first + j * C + jnp.arange(C)
    # First query sub-block whose last position reaches this key sub-block's first.
    first_q = jnp.clip((k_first + j * C - q_first) // C, 0, n_q)

    def per_q(i, carry):
      dq_b, dk_c, dv_c = carry
      pos_q = q_first + i * C + jnp.arange(C)
      s_BxHxCxC, visible_BxCxC = _scores(q_b[i], k_c, segq_b[i], segk_c, pos_q, pos_k, scale)
      p_BxHxCxC = jnp.where(visible_BxCxC[:, None],
                            jnp.exp(s_BxHxCxC - lse_b[i][..., None]), 0.0)
      # Matmul operands in the inputs' dtype (bf16 on the tensor cores), fp32 accumulation,
      # as in flash attention's backward; softmax statistics stay fp32.
      dv_c = dv_c + jnp.einsum("bhts,bthd->bshd", p_BxHxCxC.astype(dt), do_b[i],
                               preferred_element_type=F32)
      dp_BxHxCxC = jnp.einsum("bthd,bshd->bhts", do_b[i], v_c, preferred_element_type=F32)
      ds_BxHxCxC = (p_BxHxCxC * (dp_BxHxCxC - delta_b[i][..., None]) * scale).astype(dt)
      dq_b = dq_b.at[i].add(jnp.einsum("bhts,bshd->bthd", ds_BxHxCxC, k_c,
                                       preferred_element_type=F32))
      dk_c = dk_c + jnp.einsum("bhts,bthd->bshd", ds_BxHxCxC, q_b[i],
                               preferred_element_type=F32)
      return dq_b, dk_c, dv_c

    zeros = lambda x: jnp.zeros(x.shape, F32)
    dq_b, dk_c, dv_c = jax.lax.fori_loop(first_q, n_q, per_q, (dq_b, zeros(k_c), zeros(v_c)))
    return dq_b, (dk_c, dv_c)

  dq_b, (dk_b, dv_b) = jax.lax.scan(per_k, _blocks(dq, C), (
      jnp.arange(T // C), _blocks(k_blk, C), _blocks(v_blk, C), _blocks(seg_blk, C)))
  return _unblocks(dq_b), _unblocks(dk_b), _unblocks(dv_b)


def _bwd(axis, scale, impl, res, do_BxTxHxDv):
  q, k, v, seg, o, lse_BxHxT = res
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  n, idx = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
  T = q.shape[1]
  do32 = do_BxTxHxDv.astype(F32)
  delta_BxHxT = jnp.einsum("bthd,bthd->bht", do32, o.astype(F32))

  def step(s, carry):
    dq_BxTxHxD, k_blk, v_blk, seg_blk, dk_blk, dv_blk = carry
    src = (idx - s) % n
    if impl in _KERNEL_STEPS:
      dq_step, dk_step, dv_step = _KERNEL_STEPS[impl].ring_step_backward(
          q, k_blk, v_blk, seg, seg_blk, idx * T, src * T, do_BxTxHxDv, lse_BxHxT, delta_BxHxT,
          scale=scale)
      dq_BxTxHxD = dq_BxTxHxD + dq_step
    else:
      dq_BxTxHxD, dk_step, dv_step = _grad_block(q, do_BxTxHxDv, lse_BxHxT, delta_BxHxT, k_blk,
                                                 v_blk, seg, seg_blk, idx * T, src * T,
                                                 dq_BxTxHxD, scale)
    # K/V move on to the next shard; their gradients travel with them.
    k_blk, v_blk, seg_blk, dk_blk, dv_blk = jax.lax.ppermute(
        (k_blk, v_blk, seg_blk, dk_blk + dk_step, dv_blk + dv_step), axis, _ring_perm(n))
    return dq_BxTxHxD, k_blk, v_blk, seg_blk, dk_blk, dv_blk

  init = (jnp.zeros(q.shape, F32), k, v, seg, jnp.zeros(k.shape, F32), jnp.zeros(v.shape, F32))
  dq, _, _, _, dk, dv = jax.lax.fori_loop(0, n, step, init)  # n hops: dK/dV are home
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


ring_attention_shard.defvjp(_fwd, _bwd)


IMPLEMENTATIONS = ("xla", "pallas", "tpu")


def default_implementation(shard_len: int) -> str:
  """The target platform's step kernels (attention ops.ring_step_implementation)."""
  return attention_ops.ring_step_implementation(attention_ops.implementation(), shard_len)


def ring_attention(q_BxTxHxD, k_BxTxHxD, v_BxTxHxDv, segment_ids_BxT, *, mesh=None, axis=AXIS,
                   scale=None, implementation=None):
  """Causal, segment-masked attention on [B, T, H, ·] arrays sharded over `axis` along T
  (shard_map over the mesh set with jax.set_mesh, or `mesh`).

  implementation: "pallas" runs each ring step as flash kernels (pallas_gpu_ring_step.py; the GPU
  default, interpret mode elsewhere), "tpu" as jax's Mosaic flash kernels (pallas_tpu_ring_step.py;
  shards of a multiple of 128 positions; the TPU interpreter off TPU, under
  pltpu.force_tpu_interpret_mode()), "xla" as SUB × SUB score blocks in XLA; None picks by
  the target platform (default_implementation)."""
  mesh = mesh or jax.sharding.get_abstract_mesh()
  shard_len = q_BxTxHxD.shape[1] // mesh.shape[axis]
  impl = implementation or default_implementation(shard_len)
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"ring_attention implementation must be one of {IMPLEMENTATIONS}, got "
                     f"{implementation!r}")
  if impl == "tpu" and not pallas_tpu_flash.fits(shard_len):
    raise ValueError(f"ring_attention implementation 'tpu' takes shards of a multiple of "
                     f"{pallas_tpu_flash.BLOCK} positions; got {shard_len} (T={q_BxTxHxD.shape[1]} "
                     f"over {mesh.shape[axis]} shards)")
  x4, x2 = activation_spec(mesh, 4, axis), activation_spec(mesh, 2, axis)
  body = lambda q, k, v, seg: ring_attention_shard(q, k, v, seg, axis, scale, impl)
  return jax.shard_map(body, mesh=mesh, in_specs=(x4, x4, x4, x2), out_specs=x4,
                       check_vma=False)(q_BxTxHxD, k_BxTxHxD, v_BxTxHxDv, segment_ids_BxT)
