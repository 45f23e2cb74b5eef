"""KDA stage 2 (reference.chunk_recurrence) as Mosaic TPU kernels: the state crosses chunks
in VMEM.

The grid is (B, H, N) with the chunk axis "arbitrary" (sequential on one core), the TPU form
of the GPU kernels' in-kernel loop: the [K, V] fp32 state lives in a VMEM scratch buffer from
the first chunk to the last, while the pipeline fetches chunk n+1's tiles during chunk n.

  _recurrence_kernel      U = U0 - W S, O = Qg S + Aqk U, S' = decay ⊙ S + Kdᵀ U; S0 is
                          read at n = 0, the final state written at n = N-1 and, for the
                          backward pass only, each chunk's start state.
  _recurrence_bwd_kernel  the chunks in reverse (the index maps read N-1-n), carrying dS:
                          dU = Aqkᵀ dO + Kd dS', dW = -dU Sᵀ, dQg = dO Sᵀ, dKd = U dS'ᵀ,
                          dAqk = dO Uᵀ, ddecay = Σ_v S ⊙ dS', dS = decay ⊙ dS' + Qgᵀ dO - Wᵀ dU.

Dots take the stage-1 dtype (bf16 in bf16 models, accumulating in fp32) and fp32 at HIGHEST
precision otherwise. The decay arrives as a [K, 1] column ([B, H, N, K, 1]) so that it scales
the state's rows without a transpose.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

F32 = jnp.float32


def _dots(dtype):
  prec = jax.lax.Precision.HIGHEST if dtype == F32 else jax.lax.Precision.DEFAULT
  general = lambda dims: (lambda a, b: jax.lax.dot_general(
      a.astype(dtype), b.astype(dtype), (dims, ((), ())), precision=prec,
      preferred_element_type=F32))
  return general(((1,), (0,))), general(((1,), (1,))), general(((0,), (0,)))  # ab, abᵀ, aᵀb


def _recurrence_kernel(W_ref, U0_ref, Qg_ref, Kd_ref, Aqk_ref, decay_ref, S0_ref,
                       O_ref, SN_ref, *rest):
  *states_ref, S_ref = rest          # the chunk-start states output only with_states
  dot, _, t_dot = _dots(W_ref.dtype)
  n = pl.program_id(2)

  @pl.when(n == 0)
  def _():
    S_ref[...] = S0_ref[...].astype(F32)

  S_KV = S_ref[...]
  if states_ref:
    states_ref[0][...] = S_KV
  U_CV = U0_ref[...].astype(F32) - dot(W_ref[...], S_KV)
  O_ref[...] = (dot(Qg_ref[...], S_KV) + dot(Aqk_ref[...], U_CV)).astype(O_ref.dtype)
  S_KV = decay_ref[...] * S_KV + t_dot(Kd_ref[...], U_CV)
  S_ref[...] = S_KV

  @pl.when(n == pl.num_programs(2) - 1)
  def _():
    SN_ref[...] = S_KV.astype(SN_ref.dtype)


def _recurrence_bwd_kernel(W_ref, U0_ref, Qg_ref, Kd_ref, Aqk_ref, decay_ref, states_ref,
                           dO_ref, dSN_ref, dW_ref, dU0_ref, dQg_ref, dKd_ref, dAqk_ref,
                           ddecay_ref, dS0_ref, dS_ref):
  dot, dot_t, t_dot = _dots(W_ref.dtype)
  i = pl.program_id(2)

  @pl.when(i == 0)
  def _():
    dS_ref[...] = dSN_ref[...].astype(F32)

  dS_KV, S_KV = dS_ref[...], states_ref[...]
  dO_CV = dO_ref[...].astype(F32)
  U_CV = U0_ref[...].astype(F32) - dot(W_ref[...], S_KV)
  dU_CV = t_dot(Aqk_ref[...], dO_CV) + dot(Kd_ref[...], dS_KV)
  dW_ref[...] = -dot_t(dU_CV, S_KV)
  dU0_ref[...] = dU_CV
  dQg_ref[...] = dot_t(dO_CV, S_KV)
  dKd_ref[...] = dot_t(U_CV, dS_KV)
  dAqk_ref[...] = dot_t(dO_CV, U_CV)
  ddecay_ref[...] = jnp.sum(S_KV * dS_KV, axis=1, keepdims=True)
  dS_KV = decay_ref[...] * dS_KV + t_dot(Qg_ref[...], dO_CV) - t_dot(W_ref[...], dU_CV)
  dS_ref[...] = dS_KV

  @pl.when(i == pl.num_programs(2) - 1)
  def _():
    dS0_ref[...] = dS_KV


def _params(interpret):
  return None if interpret else pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "arbitrary"))


def _specs(C, K, V, N, reverse):
  """BlockSpecs of the per-chunk tiles, chunk n (or N-1-n) of head-major arrays."""
  at = (lambda n: N - 1 - n) if reverse else (lambda n: n)
  chunk = lambda D: pl.BlockSpec((None, None, C, D), lambda b, h, n: (b, h, at(n), 0))
  decay = pl.BlockSpec((None, None, None, K, 1), lambda b, h, n: (b, h, at(n), 0, 0))
  per_chunk_state = pl.BlockSpec((None, None, None, K, V), lambda b, h, n: (b, h, at(n), 0, 0))
  state = pl.BlockSpec((None, None, K, V), lambda b, h, n: (b, h, 0, 0))
  return chunk, decay, per_chunk_state, state


def recurrence_call(st, S0, *, chunk_size, with_states, interpret):
  """(O [B,H,Tp,V] in the stage-1 dtype, final state fp32[, chunk-start states fp32
  [B,H,N,K,V]]). st: W, U0, Qg, Kd, Aqk head-major, decay [B,H,N,K,1]."""
  B, H, Tp, K = st["W"].shape
  V = st["U0"].shape[-1]
  C, N = chunk_size, Tp // chunk_size
  chunk, decay, per_chunk_state, state = _specs(C, K, V, N, reverse=False)
  out_shape = [jax.ShapeDtypeStruct((B, H, Tp, V), st["U0"].dtype),
               jax.ShapeDtypeStruct((B, H, K, V), F32)]
  out_specs = [chunk(V), state]
  if with_states:
    out_shape.append(jax.ShapeDtypeStruct((B, H, N, K, V), F32))
    out_specs.append(per_chunk_state)
  return pl.pallas_call(
      _recurrence_kernel, grid=(B, H, N),
      in_specs=[chunk(K), chunk(V), chunk(K), chunk(K), chunk(C), decay, state],
      out_specs=out_specs, out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((K, V), F32)],
      interpret=interpret, compiler_params=_params(interpret), name="kda_tpu_recurrence",
  )(st["W"], st["U0"], st["Qg"], st["Kd"], st["Aqk"], st["decay"], S0)


def recurrence_bwd_call(st, states, dO, dSN, *, chunk_size, interpret):
  """(cotangents of st, fp32; dS0) from dO [B,H,Tp,V], dSN [B,H,K,V] and the chunk-start
  states of recurrence_call(with_states=True)."""
  B, H, Tp, K = st["W"].shape
  V = st["U0"].shape[-1]
  C, N = chunk_size, Tp // chunk_size
  chunk, decay, per_chunk_state, state = _specs(C, K, V, N, reverse=True)
  rows = lambda D: jax.ShapeDtypeStruct((B, H, Tp, D), F32)
  dW, dU0, dQg, dKd, dAqk, ddecay, dS0 = pl.pallas_call(
      _recurrence_bwd_kernel, grid=(B, H, N),
      in_specs=[chunk(K), chunk(V), chunk(K), chunk(K), chunk(C), decay, per_chunk_state,
                chunk(V), state],
      out_specs=[chunk(K), chunk(V), chunk(K), chunk(K), chunk(C), decay, state],
      out_shape=[rows(K), rows(V), rows(K), rows(K), rows(C),
                 jax.ShapeDtypeStruct((B, H, N, K, 1), F32),
                 jax.ShapeDtypeStruct((B, H, K, V), F32)],
      scratch_shapes=[pltpu.VMEM((K, V), F32)],
      interpret=interpret, compiler_params=_params(interpret), name="kda_tpu_recurrence_bwd",
  )(st["W"], st["U0"], st["Qg"], st["Kd"], st["Aqk"], st["decay"], states, dO, dSN)
  return {"W": dW, "U0": dU0, "Qg": dQg, "Kd": dKd, "Aqk": dAqk, "decay": ddecay}, dS0
