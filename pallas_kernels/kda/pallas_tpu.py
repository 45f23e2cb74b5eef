"""Chunked KDA on Mosaic TPU kernels: forward and backward (custom VJPs), the contract of
`ops.kda` (bounded and unbounded gates, segment ids, initial and final state, bf16 / fp32).

  stage 1  pallas_tpu_intra       one program per chunk: A, Aqk, T = (I+βA)^-1, W, U0, Qg, Kd
  stage 2  pallas_tpu_recurrence  the chunk axis sequential, the state in VMEM

The layout glue stays in XLA: inputs are `reference.prepare`d and `chunk_layout`ed as for
every implementation, then made head-major ([B, T, H, D] → [B, H, T, D]) so that each kernel
block is a [C, D] tile. The per-chunk decay Γ_C = e^{G_end} (0 past a reset) is computed in
XLA and differentiated there. Unbounded gates take the elementwise-diagonal stage 1 of
reference.chunk_intra (the safe path) and the Pallas stage 2, as on GPU.

Off a TPU the kernels run in Pallas's TPU interpreter (`interpret=pltpu.InterpretParams()`),
which checks them on CPU; on a TPU, or when compiling ahead of time for one
(pallas_kernels/platform.py), they lower through Mosaic.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import platform
from pallas_kernels.kda import pallas_tpu_intra
from pallas_kernels.kda import pallas_tpu_recurrence
from pallas_kernels.kda import reference
from pallas_kernels.kda.recurrence_vjp import recurrence_with_vjp

F32 = jnp.float32
MAX_HEAD_DIM = 256   # K, V: the [K, V] fp32 state (256 KB) and its double-buffered tiles in VMEM


def fits(K, V) -> bool:
  """Head dims the kernels take: multiples of 8 (a tile's sublanes) up to MAX_HEAD_DIM; the
  blocks span the whole head dim, so Mosaic's lane rule holds for any of them (narrower than
  128 lanes only pads)."""
  return all(d % 8 == 0 and 8 <= d <= MAX_HEAD_DIM for d in (K, V))


def _heads_first(x):
  return jnp.swapaxes(x, 1, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def intra(q, k, v, G, beta, seg, scale, chunk_size, interpret):
  """Stage 1 (bounded gates), head-major; β [B,H,Tp,1]. No residuals beyond the inputs: the
  backward kernel recomputes A and T in VMEM."""
  W, U0, Qg, Kd, Aqk = pallas_tpu_intra.intra_call(q, k, v, G, beta, seg, scale=scale,
                                          chunk_size=chunk_size, interpret=interpret)
  return {"W": W, "U0": U0, "Qg": Qg, "Kd": Kd, "Aqk": Aqk}


def _intra_fwd(q, k, v, G, beta, seg, scale, chunk_size, interpret):
  return intra(q, k, v, G, beta, seg, scale, chunk_size, interpret), (q, k, v, G, beta, seg)


def _intra_bwd(scale, chunk_size, interpret, res, d_st):
  q, k, v, G, beta, seg = res
  grads = pallas_tpu_intra.intra_bwd_call(q, k, v, G, beta, seg, d_st, scale=scale,
                                 chunk_size=chunk_size, interpret=interpret)
  return (*(g.astype(x.dtype) for g, x in zip(grads, (q, k, v, G, beta))), None)


intra.defvjp(_intra_fwd, _intra_bwd)


# Stage 2: (O [B,H,Tp,V] in the stage-1 dtype, S fp32); the backward kernel casts dO itself.
recurrence = recurrence_with_vjp(pallas_tpu_recurrence.recurrence_call,
                                 pallas_tpu_recurrence.recurrence_bwd_call)


def default_interpret() -> bool:
  return platform.target() != "tpu"


def interpret_params(interpret: bool):
  """What pallas_call takes: the TPU interpreter's parameters, or False (Mosaic)."""
  return pltpu.InterpretParams() if interpret else False


def kda_pallas_tpu(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None,
                   chunk_size=64, bounded=True, interpret=None):
  """Chunked KDA on the TPU kernels. `interpret` defaults to True off a TPU target."""
  if interpret is None:
    interpret = default_interpret()
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  return _kda_jit(q, k, v, g, beta, initial_state, segment_ids, scale=scale,
                  chunk_size=chunk_size, bounded=bounded, interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=("scale", "chunk_size", "bounded", "interpret"))
def _kda_jit(q, k, v, g, beta, initial_state, segment_ids, *, scale, chunk_size, bounded,
             interpret):
  B, T, H, K = q.shape
  V = v.shape[-1]
  C, mode = chunk_size, interpret_params(interpret)
  dt = q.dtype if q.dtype in (jnp.bfloat16, jnp.float16) else F32
  q, k, v, g, beta, reset = reference.prepare(q, k, v, g, beta, segment_ids, dtype=dt)
  q, k, v, beta, G, seg = reference.chunk_layout(q, k, v, g, beta, reset, C)
  N = q.shape[1] // C
  if bounded:
    st = intra(*map(_heads_first, (q, k, v, G, beta[..., None])), seg, scale, C, mode)
  else:  # unbounded gates: diagonal tiles elementwise in fp32 (the safe path), in XLA
    st = reference.chunk_intra(q.astype(F32), k.astype(F32), v.astype(F32), G, beta, seg,
                               scale=scale, chunk_size=C, bounded=False)
    st = {n: _heads_first(st[n]).astype(dt) for n in ("W", "U0", "Qg", "Kd", "Aqk")}
  G_end_BHNK = _heads_first(G).reshape(B, H, N, C, K)[:, :, :, -1]
  starts_BN = seg.reshape(B, N, C)[:, :, -1] == 0           # no reset inside the chunk
  st["decay"] = jnp.where(starts_BN[:, None, :, None], jnp.exp(G_end_BHNK), 0.0)[..., None]
  S0 = jnp.zeros((B, H, K, V), F32) if initial_state is None else initial_state.astype(F32)
  O, S = recurrence(st, S0, C, mode)
  return _heads_first(O)[:, :T], S
