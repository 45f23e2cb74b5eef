"""Where the dropless MoE layer's time goes on the GPU: each stage alone, forward+backward.

  python -m benchmarks.profile_moe_stages [--num_experts=64]

Same shapes as bench_moe.py (16384 tokens, d_model 2048, hidden 1024, top-8, bf16). Stages:
router (fp32 logits, sigmoid, top-k), dispatch (sort, repeat, gather to sorted order),
experts (grouped SwiGLU on sorted rows, tokamax), combine (unsort gather, weighted sum),
and the whole layer.
"""


import flax.linen as nn
import jax
import jax.numpy as jnp
from absl import app, flags

from moe_jax.model import experts, router
from moe_jax.model.dispatch import (combine, inverse_permutation, permute_rows, repeat_rows,
                                     sort_by_group)
from moe_jax.model.moe import MoE
from benchmarks import timing
from benchmarks.bench_moe import _D, _F, _K, _N, _PEAK_FLOPS, layer_config

_EXPERTS = flags.DEFINE_integer("num_experts", 64, "Routed experts E.")



def fwd_bwd(f):
  """jit of f and of its VJP against a random cotangent of f's output."""
  def both(*args):
    out, vjp = jax.vjp(f, *args)
    return vjp(jax.tree.map(lambda o: jnp.full_like(o, 0.01), out))
  return jax.jit(f), jax.jit(both)


def _dispatch(x, order):
  """The layer's dispatch gather (moe.dropless): x repeated k times, rows in `order`."""
  return permute_rows(repeat_rows(x, _K), order, inverse_permutation(order))


def main(argv):
  del argv
  E = _EXPERTS.value
  cfg = layer_config(E, "dropless")
  x = jax.random.normal(jax.random.key(0), (_N, _D), jnp.bfloat16)
  params = nn.meta.unbox(MoE(cfg).init(jax.random.key(2), x[None, :16])["params"])
  gate_up = params["gate_up"].astype(jnp.bfloat16)
  down = params["down"].astype(jnp.bfloat16)
  kernel = params["router_kernel"]
  logits = lambda kernel, x: router.logits(x, kernel, cfg.moe.router_dtype or cfg.dtype)
  idx, w = router.select(logits(kernel, x), jnp.zeros(E), _K, "sigmoid", 1.0)
  order, sizes, _ = sort_by_group(idx.reshape(-1), E)
  x_sorted = _dispatch(x, order)
  y_sorted = experts.swiglu_grouped(x_sorted, sizes, gate_up, down)

  stages = {
      "router": lambda kernel, x: router.select(
          logits(kernel, x), jnp.zeros(E), _K, "sigmoid", 1.0)[1],
      "dispatch (sort + gather)": lambda x, idx: _dispatch(
          x, sort_by_group(idx.reshape(-1), E)[0]),
      "experts (tokamax SwiGLU)": lambda xs, gu, dn: experts.swiglu_grouped(xs, sizes, gu, dn),
      "combine (unsort + sum)": lambda ys, w, order: combine(
          permute_rows(ys, inverse_permutation(order), order), w, jnp.bfloat16),
      "whole layer": lambda p, x: MoE(cfg).apply({"params": p, "router": {"bias": jnp.zeros(E)}},
                                                 x[None])[0],
  }
  args = {
      "router": (kernel, x), "dispatch (sort + gather)": (x, idx),
      "experts (tokamax SwiGLU)": (x_sorted, gate_up, down),
      "combine (unsort + sum)": (y_sorted, w, order), "whole layer": (params, x),
  }
  flops = 6 * _N * _K * _D * _F
  print(f"{jax.devices()[0]}, E={E}, tokens {_N}, d_model {_D}, hidden {_F}, top-{_K}, bf16")
  print("| stage | fwd ms | fwd+bwd ms |\n|---|---|---|")
  for name, f in stages.items():
    jf, jb = fwd_bwd(f)
    iters = flags.FLAGS.iters
    ms_f = timing.median_ms(jf, args[name], iters)
    ms_b = timing.median_ms(jb, args[name], iters)
    extra = ""
    if name.startswith(("experts", "whole")):
      extra = f" ({100 * flops / (ms_f * 1e-3) / _PEAK_FLOPS:.0f}% / " \
              f"{100 * 3 * flops / (ms_b * 1e-3) / _PEAK_FLOPS:.0f}% of peak)"
    print(f"| {name} | {ms_f:.2f} | {ms_b:.2f}{extra} |", flush=True)


if __name__ == "__main__":
  app.run(main)
