"""The exact spec the matmul kernels are tested against: the product in fp32."""

import jax.numpy as jnp


def matmul(x_MxK, w_KxN):
  """[M, N] fp32: x · w with fp32 operands and accumulation."""
  return jnp.dot(x_MxK.astype(jnp.float32), w_KxN.astype(jnp.float32))
