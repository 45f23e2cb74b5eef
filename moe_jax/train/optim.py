"""Optimizer: router clip → global-norm clip → AdamW (decay on matrices only), skipping
non-finite updates."""

import jax
import jax.numpy as jnp
import ml_collections
import optax

from moe_jax.fields import is_moe, param_names
from moe_jax.model import layer_stack
from moe_jax.train.schedule import make_schedule

# apply_if_finite applies a non-finite update after this many in a row; never let it.
_NEVER = 2**31 - 1


def decay_mask(params):
  """Weight decay on ≥2-D kernels and embeddings; not on norms, biases, gate scalars. A
  scanned layer's params carry one more (leading) axis, not counted."""
  def is_matrix(path, p):
    stacked = any(getattr(k, "key", None) == layer_stack.PERIODS for k in path)
    return p.ndim - stacked >= 2
  return jax.tree_util.tree_map_with_path(is_matrix, params)


def routing_mask(names: tuple[str, ...]):
  """params → True on the MoE routing params named in `names`: a param of that name
  (`router_kernel`) or inside a module of that name (`latent_down/kernel`)."""
  def mask(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: any(getattr(k, "key", None) in names for k in path[-2:]), params)
  return mask


def routing_grad_norm(c: ml_collections.ConfigDict, grads) -> dict:
  """{"router_grad_norm": the global norm of the routing params' gradients (those the router
  clip covers, optim.router_clip_params), before any clip} for an MoE model, else {}."""
  if not is_moe(c.model):
    return {}
  mask = routing_mask(param_names(c.optim.router_clip_params))(grads)
  return {"router_grad_norm": optax.tree.norm(
      jax.tree.map(lambda g, m: g if m else jnp.zeros((), g.dtype), grads, mask))}


def make_clipping(c: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """The routing params in optim.router_clip_params (by default the router kernels; with a
  latent MoE also its projections) first get their own global-norm clip: their gradients
  spike when routing shifts and would otherwise dominate the global norm. Then everything
  gets the global clip."""
  o = c.optim
  stages = []
  if o.router_grad_clip_norm:
    names = param_names(o.router_clip_params)
    stages.append(optax.masked(optax.clip_by_global_norm(o.router_grad_clip_norm),
                               routing_mask(names)))
  stages.append(optax.clip_by_global_norm(o.grad_clip_norm))
  return optax.chain(*stages)


def make_optimizer(c: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """Updates with a non-finite gradient are dropped and counted (state.total_notfinite)."""
  o = c.optim
  tx = optax.chain(
      make_clipping(c),
      optax.adamw(make_schedule(c.schedule, o.learning_rate), b1=o.b1, b2=o.b2, eps=o.eps,
                  weight_decay=o.weight_decay, mask=decay_mask),
  )
  return optax.apply_if_finite(tx, max_consecutive_errors=_NEVER)


def skipped_updates(opt_state) -> jax.Array:
  """How many updates were skipped for non-finite gradients so far."""
  return opt_state.total_notfinite


def learning_rate(c: ml_collections.ConfigDict, step):
  return make_schedule(c.schedule, c.optim.learning_rate)(step)
