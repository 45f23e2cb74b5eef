"""Optimizer: global-norm clip → AdamW (decay on matrices only), skipping non-finite updates."""

import jax
import ml_collections
import optax

from moe_jax.train.schedule import make_schedule

# apply_if_finite applies a non-finite update after this many in a row; never let it.
_NEVER = 2**31 - 1


def decay_mask(params):
  """Weight decay on ≥2-D kernels and embeddings; not on norms, biases, gate scalars."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(c: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """Updates with a non-finite gradient are dropped and counted (state.total_notfinite)."""
  o = c.optim
  tx = optax.chain(
      optax.clip_by_global_norm(o.grad_clip_norm),
      optax.adamw(make_schedule(c.schedule, o.learning_rate), b1=o.b1, b2=o.b2, eps=o.eps,
                  weight_decay=o.weight_decay, mask=decay_mask),
  )
  return optax.apply_if_finite(tx, max_consecutive_errors=_NEVER)


def skipped_updates(opt_state) -> jax.Array:
  """How many updates were skipped for non-finite gradients so far."""
  return opt_state.total_notfinite


def learning_rate(c: ml_collections.ConfigDict, step):
  return make_schedule(c.schedule, c.optim.learning_rate)(step)
