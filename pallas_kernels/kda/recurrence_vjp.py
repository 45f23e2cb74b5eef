"""Stage 2's custom VJP, shared by the GPU and TPU kernels: the forward keeps only its
inputs; the backward recomputes the chunk-start states (a forward call with_states) and
hands them to the backward kernels. `call(st, S0, *, chunk_size, with_states, interpret)`
and `bwd_call(st, states, dO, dSN, *, chunk_size, interpret)` are the platform's launchers.
"""

import functools

import jax

from pallas_kernels import residuals


def recurrence_with_vjp(call, bwd_call):
  """recurrence(st, S0, chunk_size, interpret) -> (O in the stage-1 dtype, S fp32)."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
  def recurrence(st, S0, chunk_size, interpret):
    O, S = call(st, S0, chunk_size=chunk_size, with_states=False, interpret=interpret)
    return O, S

  def fwd(st, S0, chunk_size, interpret):
    return recurrence(st, S0, chunk_size, interpret), residuals.tag((st, S0))

  def bwd(chunk_size, interpret, res, cts):
    st, S0 = res
    dO, dSN = cts
    _, _, states = call(st, S0, chunk_size=chunk_size, with_states=True, interpret=interpret)
    d_st, dS0 = bwd_call(st, states, dO, dSN, chunk_size=chunk_size, interpret=interpret)
    return {n: d_st[n].astype(st[n].dtype) for n in st}, dS0.astype(S0.dtype)

  recurrence.defvjp(fwd, bwd)
  return recurrence
