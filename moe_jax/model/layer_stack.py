"""Which layers are scanned, and the two parameter layouts.

With `model.scan_layers` the training model compiles one period of the layer pattern and
`nn.scan`s it over the periods (MaxText's scanned layers): compile time no longer grows
with depth. Layers split into

  head    the layers before the scan (the dense-FFN ones, moe.first_dense, and the
          pattern's letters up to where it changes), unrolled;
  body    `n` periods of len(layer_pattern) layers, scanned over under "periods" ([n, ...]);
  tail    what is left of the last incomplete period, unrolled.

Within each part, consecutive identical blocks (same mixer, same FFN) form a *run*, and a run
of two or more is itself an nn.scan over one block: "KKKA" compiles one KDA block and one
MLA block per period, not four blocks. A block's HLO is compiled once per place it appears,
so this is what sets the cold compile (benchmarks/train.md: the three unrolled tail layers
of long_context_1b cost 14 s of its 45 s). The scan starts where the pattern's letter
changes, so that no run is cut in two by the period boundary.

A run's parameters sit under its layers' names: "layer_0" (one layer), "layers_1_2" (layers
1-2 stacked, [2, ...]); under "periods" the names are those of period 0's layers:
"periods"/"layers_4_6" is [n, 3, ...], layers 4-6, 8-10, 12-14 for P = 4.

`unstack` gives the per-layer layout ("layer_l", one tree per layer: the unscanned model's,
and the layout of checkpoints written before scanning); `stack` gives the scanned one. Both
work on any tree whose top level is laid out like the params (params, grads, Adam moments,
the router collection), and `convert` on a whole train state. `unstack` also reads the
layout before runs (one "block_j" per pattern position under "periods", the scan starting
at moe.first_dense), and `stack(..., legacy=True)` writes it, to restore such checkpoints.

Inference (cache path) always runs unscanned: infer.generate.inference_model turns
scanning off and `unstack` gives it the variables, so a decode step reads each layer's
weights and cache in place.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp

PERIODS = "periods"


def mixer_kind(cfg, layer: int) -> str:
  """The pattern string applies cyclically: "KKKA" over 8 layers is KKKAKKKA."""
  return cfg.layer_pattern[layer % len(cfg.layer_pattern)]


def is_moe(cfg, layer: int) -> bool:
  """MoE FFN from layer `moe.first_dense` on (never when moe.num_experts == 0)."""
  return cfg.moe.num_experts > 0 and layer >= cfg.moe.first_dense


@dataclasses.dataclass(frozen=True)
class Plan:
  start: int                  # first scanned layer
  period: int                 # layers per scan step (len(layer_pattern))
  n: int                      # scan steps (0: nothing scanned)
  head: tuple[range, ...]     # runs before the scan (every layer, one each, when n == 0)
  body: tuple[range, ...]     # runs of period 0 (layers start … start+period-1)
  tail: tuple[range, ...]     # runs after the scan

  @property
  def end(self) -> int:
    return self.start + self.n * self.period


def run_name(run: range) -> str:
  return f"layer_{run.start}" if len(run) == 1 else f"layers_{run.start}_{run[-1]}"


def _runs(cfg, layers: range, merge: bool) -> tuple[range, ...]:
  """`layers` cut into maximal runs of identical blocks (all of length 1 without merge)."""
  runs, first = [], layers.start
  for l in layers:
    if l + 1 == layers.stop or not merge or (
        (mixer_kind(cfg, l + 1), is_moe(cfg, l + 1)) != (mixer_kind(cfg, l), is_moe(cfg, l))):
      runs.append(range(first, l + 1))
      first = l + 1
  return tuple(runs)


def plan(cfg, legacy: bool = False) -> Plan:
  """The scan plan of a model config. Nothing is scanned when scan_layers is off, with fewer
  than two periods, or when a sub-layer's work depends on its depth (attn_res full / block
  keep a growing list of streams; mix needs its block boundaries to repeat every period;
  runs are only merged with a plain residual, whose write does not depend on the layer).
  `legacy`: the layout before runs (scan from moe.first_dense, no runs)."""
  P, first, L = len(cfg.layer_pattern), _first_dense_end(cfg), cfg.n_layers
  merge = cfg.attn_res == "none" and not legacy
  start = _pattern_boundary(cfg, first) if merge else first
  n = (L - start) // P
  periodic = cfg.attn_res == "none" or (
      cfg.attn_res == "mix" and (2 * P) % cfg.attn_res_block_size == 0
      and (2 * start) % cfg.attn_res_block_size == 0)
  if not cfg.get("scan_layers", False) or n < 2 or not periodic:
    return Plan(first, P, 0, _runs(cfg, range(L), False), (), ())
  end = start + n * P
  return Plan(start, P, n, _runs(cfg, range(start), merge),
              _runs(cfg, range(start, start + P), merge), _runs(cfg, range(end, L), merge))


def _first_dense_end(cfg) -> int:
  return min(cfg.moe.first_dense, cfg.n_layers) if cfg.moe.num_experts else 0


def _pattern_boundary(cfg, first: int) -> int:
  """The first layer from `first` on where the pattern's letter changes (so a period starting
  there does not cut a run of equal letters), if that keeps the number of periods."""
  P, p = len(cfg.layer_pattern), cfg.layer_pattern
  for s in range(first, first + P):
    if p[s % P] != p[(s - 1) % P]:
      return s if (cfg.n_layers - s) // P == (cfg.n_layers - first) // P else first
  return first


def _take(x, idx: tuple):
  if isinstance(x, jax.ShapeDtypeStruct):   # abstract trees (param counting, restore targets)
    return jax.ShapeDtypeStruct(x.shape[len(idx):], x.dtype)
  return x[idx]


def _stack(*xs):
  if isinstance(xs[0], jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype)
  return jnp.stack(xs)


def is_stacked(tree) -> bool:
  return isinstance(tree, dict) and PERIODS in tree


def stacked_axes(keys) -> int:
  """How many leading axes of the param at this key path stack layers (the scan over the
  periods, a run)."""
  return sum(k == PERIODS or str(k).startswith("layers_") for k in keys)


def _held(name: str, legacy_start: int) -> tuple[range, bool] | None:
  """(the layers a group named `name` holds, period 0's under "periods"; whether they are
  stacked on an axis of their own), None for a key that holds no layers."""
  if m := re.fullmatch(r"layer_(\d+)", name):
    return range(int(m[1]), int(m[1]) + 1), False
  if m := re.fullmatch(r"layers_(\d+)_(\d+)", name):
    return range(int(m[1]), int(m[2]) + 1), True
  if m := re.fullmatch(r"block_(\d+)", name):   # the layout before runs
    return range(legacy_start + int(m[1]), legacy_start + int(m[1]) + 1), False
  return None


def unstack(cfg, tree):
  """Scanned layout (or the one before runs) → per-layer layout (unchanged when `tree` has no
  scanned layers)."""
  if not is_stacked(tree):
    return tree
  P, legacy_start = len(cfg.layer_pattern), _first_dense_end(cfg)
  out = {}

  def put(name, group, lead: tuple, offset: int):
    held = _held(name, legacy_start)
    if held is None:
      out[name] = group
      return
    layers, own_axis = held
    for k, l in enumerate(layers):
      idx = lead + ((k,) if own_axis else ())
      out[f"layer_{l + offset}"] = (jax.tree.map(lambda x, idx=idx: _take(x, idx), group)
                                    if idx else group)

  for name, group in tree.items():
    if name != PERIODS:
      put(name, group, (), 0)
  leaves = jax.tree.leaves(tree[PERIODS])
  # The scan length from the arrays: this works under any config with the same pattern
  # (the inference config has scanning off).
  for i in range(leaves[0].shape[0] if leaves else 0):
    for name, group in tree[PERIODS].items():
      put(name, group, (i,), i * P)
  return out


def stack(cfg, tree, legacy: bool = False):
  """Per-layer layout → scanned layout (unchanged when cfg scans nothing or `tree` is
  stacked already). A tree may hold only some layers (the router collection: the MoE ones);
  every run is all of one kind, so it is there whole or not at all."""
  p = plan(cfg, legacy)
  if p.n == 0 or is_stacked(tree) or not isinstance(tree, dict):
    return tree

  def group(run: range, offset: int = 0):
    trees = [tree.get(f"layer_{l + offset}") for l in run]
    if trees[0] is None:
      return None
    return trees[0] if len(run) == 1 else jax.tree.map(_stack, *trees)

  out = {k: v for k, v in tree.items() if not str(k).startswith("layer_")}
  for run in p.head + p.tail:
    if (g := group(run)) is not None:
      out[run_name(run)] = g
  periods = {}
  for j, run in enumerate(p.body):
    per_period = [group(run, i * p.period) for i in range(p.n)]
    if per_period[0] is not None:
      periods[f"block_{j}" if legacy else run_name(run)] = jax.tree.map(_stack, *per_period)
  out[PERIODS] = periods
  return out


def convert(cfg, tree, to_stacked: bool, legacy: bool = False):
  """`stack` or `unstack` on every dict in a pytree that holds layers (a train state's
  params, router and optimizer moments; checkpoints from before scanning)."""
  def visit(node):
    if isinstance(node, dict):
      holds_layers = is_stacked(node) or any(str(k).startswith("layer_") for k in node)
      if holds_layers:
        return stack(cfg, node, legacy) if to_stacked else unstack(cfg, node)
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
