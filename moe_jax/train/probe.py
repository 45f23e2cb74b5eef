"""Routing fluctuation (log.route_fluctuation): the fraction of (token, MoE layer) pairs whose
top-k expert set changed over one optimizer step, on a fixed probe batch.

Early routing swings are what the routing-stability kit (router/latent clip, init
regulariser, z-loss) is for; MaxVio shows imbalance, this shows churn. The probe batch is
the first validation batch; its routes come from the MoE layers' sown top-k ids
(intermediates["topk"], either parameter layout), sorted so only the set counts.
"""

import jax
import jax.numpy as jnp
import numpy as np


def needed(step: int, every: int) -> bool:
  """Routes are taken after each logging step and the step before it."""
  return step % every == 0 or (step + 1) % every == 0


class RouteProbe:
  """probe.observe(step, state) → the fluctuation since step − 1, or None when the routes
  after step − 1 were not taken (the first call, or a gap)."""

  def __init__(self, apply_fn, state_shardings, batch_sharding, batch):
    def routes(params, router, batch):
      _, variables = apply_fn({"params": params, "router": router}, batch,
                              mutable=["intermediates"])
      found = [x.reshape(-1, x.shape[-1])
               for path, x in jax.tree_util.tree_flatten_with_path(variables)[0]
               if any(getattr(k, "key", None) == "topk" for k in path)]
      return jnp.sort(jnp.concatenate(found), axis=-1)

    self._routes = jax.jit(routes, in_shardings=(state_shardings.params,
                                                 state_shardings.router, batch_sharding))
    self._batch = batch
    self._last = None   # (step, routes)

  def observe(self, step: int, state):
    routes = np.asarray(self._routes(state.params, state.router, self._batch))
    last, self._last = self._last, (step, routes)
    if last is None or last[0] != step - 1:
      return None
    return float(np.mean(np.any(routes != last[1], axis=-1)))
