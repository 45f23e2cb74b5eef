"""Which layers are scanned, and the two parameter layouts.

With `model.scan_layers` the training model compiles one period of the layer pattern and
`nn.scan`s it over the periods (MaxText's scanned layers): compile time no longer grows
with depth. Layers split into

  head    the leading dense-FFN layers (moe.first_dense), unrolled;
  body    `n` periods of len(layer_pattern) layers, scanned: the params of block j of
          the period are stacked over the periods, under "periods"/"block_j" ([n, ...]);
  tail    what is left of the last incomplete period, unrolled.

Layer l = start + i·P + j of the body is block j at scan step i. `unstack` gives the
per-layer layout ("layer_l", one tree per layer: the unscanned model's, and the layout of
checkpoints written before scanning); `stack` gives the scanned one. Both work on any
tree whose top level is laid out like the params (params, grads, Adam moments, the router
collection), and `convert` on a whole train state.

Inference (cache path) always runs unscanned: infer.generate.inference_model turns
scanning off and `unstack` gives it the variables, so a decode step reads each layer's
weights and cache in place.
"""

import dataclasses

import jax
import jax.numpy as jnp

from moe_jax.fields import is_moe

PERIODS = "periods"


@dataclasses.dataclass(frozen=True)
class Plan:
  start: int       # first scanned layer
  period: int      # layers per scan step (len(layer_pattern))
  n: int           # scan steps (0: nothing scanned)

  def layer(self, i: int, j: int) -> int:
    return self.start + i * self.period + j

  @property
  def end(self) -> int:
    return self.start + self.n * self.period


def plan(cfg) -> Plan:
  """The scan plan of a model config. Nothing is scanned when scan_layers is off, with fewer
  than two periods, or when a sub-layer's work depends on its depth (attn_res full / block
  keep a growing list of streams; mix needs its block boundaries to repeat every period)."""
  P, start = len(cfg.layer_pattern), _start(cfg)
  n = (cfg.n_layers - start) // P
  periodic = cfg.attn_res == "none" or (
      cfg.attn_res == "mix" and (2 * P) % cfg.attn_res_block_size == 0
      and (2 * start) % cfg.attn_res_block_size == 0)
  if not cfg.get("scan_layers", False) or n < 2 or not periodic:
    return Plan(start, P, 0)
  return Plan(start, P, n)


def _start(cfg) -> int:
  return min(cfg.moe.first_dense, cfg.n_layers) if is_moe(cfg) else 0


def _take(x, i):
  if isinstance(x, jax.ShapeDtypeStruct):   # abstract trees (param counting, restore targets)
    return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
  return x[i]


def _stack(*xs):
  if isinstance(xs[0], jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype)
  return jnp.stack(xs)


def is_stacked(tree) -> bool:
  return isinstance(tree, dict) and PERIODS in tree


def unstack(cfg, tree):
  """Scanned layout → per-layer layout (unchanged when `tree` has no scanned layers)."""
  if not is_stacked(tree):
    return tree
  # The scan length from the arrays: this works under any config with the same pattern
  # (the inference config has scanning off).
  n = jax.tree.leaves(tree[PERIODS])[0].shape[0]
  p = Plan(_start(cfg), len(cfg.layer_pattern), n)
  out = {k: v for k, v in tree.items() if k != PERIODS}
  for j in range(p.period):
    block = tree[PERIODS][f"block_{j}"]
    for i in range(p.n):
      out[f"layer_{p.layer(i, j)}"] = jax.tree.map(lambda x, i=i: _take(x, i), block)
  return out


def stack(cfg, tree):
  """Per-layer layout → scanned layout (unchanged when cfg scans nothing or `tree` is
  stacked already)."""
  p = plan(cfg)
  if p.n == 0 or is_stacked(tree) or not isinstance(tree, dict):
    return tree
  names = {p.layer(i, j) for i in range(p.n) for j in range(p.period)}
  out = {k: v for k, v in tree.items()
         if not (k.startswith("layer_") and int(k.removeprefix("layer_")) in names)}
  blocks = {}
  for j in range(p.period):
    layers = [tree[f"layer_{p.layer(i, j)}"] for i in range(p.n)]
    blocks[f"block_{j}"] = jax.tree.map(_stack, *layers)
  out[PERIODS] = blocks
  return out


def convert(cfg, tree, to_stacked: bool):
  """`stack` or `unstack` on every dict in a pytree that holds layers (a train state's
  params, router and optimizer moments; checkpoints from before scanning)."""
  def visit(node):
    if isinstance(node, dict):
      holds_layers = is_stacked(node) or any(str(k).startswith("layer_") for k in node)
      if holds_layers:
        return stack(cfg, node) if to_stacked else unstack(cfg, node)
      return {k: visit(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
      return type(node)(visit(v) for v in node)
    if hasattr(node, "_fields"):  # namedtuples (optax states)
      return type(node)(*(visit(v) for v in node))
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
      return node.replace(**{f.name: visit(getattr(node, f.name))
                             for f in dataclasses.fields(node) if f.init})
    return node
  return visit(tree)
