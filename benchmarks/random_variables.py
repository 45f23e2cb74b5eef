"""Random bf16 variables of a model's shapes, without running its initialiser.

Why: on the H200, `jax.jit(model.init)` for the 16-layer long-context model took ≈ 2 min per
model (compiling; the decode step itself compiles in ≈ 17 s), which ate most of each
benchmark's device slot. Timing does not need the initialiser's values, only its shapes
and values of a sane scale: matrices N(0, 0.02²), vectors (norm scales, biases) ones.
Routing stays data-dependent (random router rows): different tokens pick different experts,
as in a real model, rather than all picking the same ones (as equal router rows would).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp


def random_variables(model: nn.Module, T: int, seed: int = 0, dtype=jnp.bfloat16):
  """Variables shaped like model.init's on a [1, T] batch; ≥2-D floats in `dtype`."""
  batch = {"tokens": jnp.zeros((1, T), jnp.int32), "segment_ids": jnp.ones((1, T), jnp.int32)}
  shapes = nn.meta.unbox(jax.eval_shape(model.init, jax.random.key(0), batch))
  leaves, tree = jax.tree.flatten(shapes)
  keys = jax.random.split(jax.random.key(seed), len(leaves))

  def fill(key, shape, dtype_in):
    if not jnp.issubdtype(dtype_in, jnp.floating):
      return jnp.zeros(shape, dtype_in)
    if len(shape) < 2:
      return jnp.ones(shape, dtype_in)
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

  jfill = jax.jit(fill, static_argnums=(1, 2))
  return jax.tree.unflatten(tree, [jfill(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])
