"""Routing replay for MoE: the training pass runs the experts the rollout picked.

A rollout picks experts with the inference path (prefill chunks, then one token at a time);
the training pass recomputes every position at once, after the params have moved. Both can
pick different top-k sets for the same token, so the importance ratio would compare two
different networks. With replay on, each MoE layer takes the rollout's ids from the
variable replay/topk (model/moe.py) and weighs them with its own scores, so the router still
learns. The mismatch metric is the fraction of (token, MoE layer) pairs whose top-k sets
differ between the rollout and what the training pass would pick on its own.
"""

import jax.numpy as jnp

from moe_jax.model import layer_stack


def replay_variables(model_cfg, routes: dict) -> dict:
  """{layer: ids [B, T, K]} → the "replay" collection in the model's parameter layout
  (stacked like the params where layers are scanned)."""
  tree = {layer: {"ffn": {"topk": ids.reshape(-1, ids.shape[-1])}}
          for layer, ids in routes.items()}
  return layer_stack.stack(model_cfg, tree)


def mismatch(routes_a: dict, routes_b: dict, live_BxT):
  """Fraction of live (token, layer) pairs whose top-k expert sets differ."""
  live_BxT = live_BxT.astype(jnp.float32)
  differ, total = jnp.float32(0.0), jnp.float32(0.0)
  for layer, a_BxTxK in routes_a.items():
    b_BxTxK = routes_b[layer]
    diff_BxT = jnp.any(jnp.sort(a_BxTxK, -1) != jnp.sort(b_BxTxK, -1), -1)
    differ = differ + (diff_BxT * live_BxT).sum()
    total = total + live_BxT.sum()
  return differ / jnp.maximum(total, 1.0)
