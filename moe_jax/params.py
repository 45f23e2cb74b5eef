"""Parameter accounting: total and active (per token) parameters by component, from shapes only.

The model is initialised abstractly (jax.eval_shape), so a 1T-parameter config
is counted in seconds without allocating anything. Active = the parameters one
token's forward pass computes with: k of the E routed experts, one row of the
input embedding table (a lookup, not a matmul), everything else in full.
"""

import collections

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from moe_jax.fields import is_moe
from moe_jax.model import layer_stack
from moe_jax.model.transformer import HybridMoE, mixer_kind
from moe_jax.train.state import frozen_model_config

COMPONENTS = ("embedding", "lm_head", "kda", "mla", "dense_ffn", "router", "moe_latent",
              "shared_experts", "routed_experts", "norms")


def _component(cfg, keys: tuple[str, ...]) -> str:
  if keys[0] in ("embed", "lm_head"):
    return "embedding" if keys[0] == "embed" else "lm_head"
  if keys[0] == "final_norm":
    return "norms"
  layer = int(keys[0].removeprefix("layer_"))
  if keys[1] == "mixer":
    return "kda" if mixer_kind(cfg, layer) == "K" else "mla"
  if keys[1] != "ffn":  # mixer_norm, ffn_norm
    return "norms"
  if keys[2] == "router_kernel":
    return "router"
  if keys[2] in ("latent_down", "latent_norm", "latent_up"):   # every token uses them
    return "moe_latent"
  if keys[2] in ("gate_up", "down"):
    return "routed_experts"
  return "shared_experts" if keys[2] == "shared" else "dense_ffn"


def count(c: ml_collections.ConfigDict) -> dict:
  """{"total": {component: n}, "active": {component: n}} plus "total_sum"/"active_sum"."""
  cfg = frozen_model_config(c)
  T = cfg.kda_chunk_size
  batch = {"tokens": jax.ShapeDtypeStruct((1, T), jnp.int32),
           "segment_ids": jax.ShapeDtypeStruct((1, T), jnp.int32)}
  abstract = jax.eval_shape(HybridMoE(cfg).init, jax.random.key(0), batch)
  params = layer_stack.unstack(cfg, nn.meta.unbox(abstract["params"]))
  total = collections.Counter({k: 0 for k in COMPONENTS})
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    keys = tuple(p.key for p in path)
    total[_component(cfg, keys)] += leaf.size
  active = dict(total)
  active["embedding"] = cfg.d_model
  if is_moe(cfg):
    active["routed_experts"] = total["routed_experts"] * cfg.moe.top_k // cfg.moe.num_experts
  return {"total": dict(total), "active": active, "total_sum": sum(total.values()),
          "active_sum": sum(active.values())}


def table(counts: dict) -> str:
  """Markdown table by component, in billions and millions."""
  rows = ["| component | total | active |", "|---|---:|---:|"]
  fmt = lambda n: f"{n / 1e9:.3f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"
  for k in COMPONENTS:
    rows.append(f"| {k} | {fmt(counts['total'][k])} | {fmt(counts['active'][k])} |")
  rows.append(f"| **sum** | **{fmt(counts['total_sum'])}** | **{fmt(counts['active_sum'])}** |")
  return "\n".join(rows)
