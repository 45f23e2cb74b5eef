"""Causal, segment-masked flash attention on one device: the ring-step kernels
(pallas_gpu_ring_step.py) with both offsets 0, forward and backward under a custom VJP.

MLA training on one GPU uses this instead of jax's Pallas flash kernel
(jax.experimental.pallas.ops.gpu.attention.mha): the same contract (segment ids native,
no [T, T] mask), 1.5× faster fwd+bwd at 64K (benchmarks/sequence.md), and no shape limits
(T and head dims are padded to whole tiles; Dqk may differ from Dv).
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import residuals
from pallas_kernels.attention import pallas_gpu_ring_step

F32 = jnp.float32


def causal_attention(q_BxTxHxD, k_BxTxHxD, v_BxTxHxDv, segment_ids_BxT, *, interpret=None):
  """softmax(q kᵀ / √D, causal, same segment only) v: [B, T, H, Dv] in q's dtype. Every
  query sees itself, so no row is empty (padding, id 0, attends to padding). interpret:
  None = off on GPU only."""
  interpret = jax.default_backend() != "gpu" if interpret is None else interpret
  return _attention_jit(q_BxTxHxD, k_BxTxHxD, v_BxTxHxDv, segment_ids_BxT, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, seg, interpret):
  return _fwd(q, k, v, seg, interpret)[0]


def _fwd(q, k, v, seg, interpret):
  zero = jnp.zeros((), jnp.int32)
  o, lse_BxHxT = pallas_gpu_ring_step.ring_step_forward(q, k, v, seg, seg, zero, zero,
                                             scale=q.shape[-1] ** -0.5, interpret=interpret,
                                             out_dtype=q.dtype)
  # q, k, v are the model's projections (saved by remat's dots policies); o and lse are the
  # kernel's, rebuilt by a second forward kernel unless saved by name.
  o_res, lse_BxHxT = residuals.tag((o, lse_BxHxT))
  return o, (q, k, v, seg, o_res, lse_BxHxT)


def _bwd(interpret, res, do_BxTxHxDv):
  q, k, v, seg, o, lse_BxHxT = res
  zero = jnp.zeros((), jnp.int32)
  delta_BxHxT = jnp.einsum("bthd,bthd->bht", do_BxTxHxDv.astype(F32), o.astype(F32))
  dq, dk, dv = pallas_gpu_ring_step.ring_step_backward(q, k, v, seg, seg, zero, zero, do_BxTxHxDv,
                                            lse_BxHxT, delta_BxHxT, scale=q.shape[-1] ** -0.5,
                                            interpret=interpret, out_dtype=q.dtype)
  return dq, dk.astype(k.dtype), dv.astype(v.dtype), None


_attention.defvjp(_fwd, _bwd)
# Jitted, so that every layer with these shapes shares one trace and one lowering of the
# kernels (forward, backward, recomputation): the step's trace + lower time stops growing
# with the number of attention layers.
_attention_jit = jax.jit(_attention, static_argnums=4)
