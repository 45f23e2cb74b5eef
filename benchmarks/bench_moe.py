"""MoE layer speed on the GPU: router + dispatch + routed experts + combine, forward and
forward+backward, dropless vs capacity paths, next to a dense SwiGLU of the same active FLOPs.

  python -m benchmarks.bench_moe --out=$OUT [--experts=64,256] [--paths=dropless,capacity1.0]
  python -m benchmarks.bench_moe --out=$OUT --paths=dropless,latent1024,latent512   # latent MoE

bf16, tokens = 16384, d_model = 2048, expert hidden 1024, top-8, no shared expert
(the dense baseline is what a shared expert costs). FLOPs counted are the useful
expert matmuls, 6·N·k·D·F forward and 3× that forward+backward: padding slots of
the capacity path and the router are not counted. Median of --iters runs after warm-up.
Path latent<R>: dropless latent MoE (model.moe.latent_dim = R) with expert hidden F·D/R, so
its experts hold and compute as much as the standard ones (equal active expert params);
the latent projections (4·N·D·R FLOPs forward) are cost, not counted.
"""

import json
import os
import traceback

import flax.linen as nn
import jax
import jax.numpy as jnp
from absl import app, flags

from configs import base
from moe_jax.model.moe import MoE
from moe_jax.train.state import frozen_model_config
from benchmarks import timing

_EXPERTS = flags.DEFINE_string("experts", "64,256", "Comma-separated expert counts.")
_PATHS = flags.DEFINE_string("paths", "dropless,capacity1.0,capacity1.25",
                             "dropless | capacity<factor>, comma-separated.")
_ROUTINGS = flags.DEFINE_string("routings", "balanced,skewed", "Router states to time.")
_SKEW = flags.DEFINE_float("skew", 0.03, "Std of the random router bias of the skewed routing.")
_ITERS = flags.DEFINE_integer("iters", 20, "Timed runs per measurement (median reported).")
_OUT = flags.DEFINE_string("out", None, "Folder for the JSON and markdown results.")
_N, _D, _F, _K = 16384, 2048, 1024, 8
_PEAK_FLOPS = 762e12  # bf16 matmul through JAX, measured on this H200 (shared/device/README.md)


def layer_config(E, path):
  c = base.get_config()
  c.model.d_model = _D
  c.model.dtype = "bfloat16"
  m = c.model.moe
  m.update({"num_experts": E, "top_k": _K, "expert_hidden": _F, "num_shared": 0,
            "balancer": "none", "grouped_matmul": ""})  # "" = tokamax on GPU
  if path.startswith("latent"):
    R = int(path.removeprefix("latent"))
    m.dispatch, m.latent_dim, m.expert_hidden = "dropless", R, _F * _D // R
  elif path == "dropless_xla":
    m.dispatch, m.grouped_matmul = "dropless", "xla"
  elif path.startswith("capacity"):
    m.dispatch, m.capacity_factor = "capacity", float(path.removeprefix("capacity"))
  else:
    m.dispatch = path
  return frozen_model_config(c)


def router_bias(E, routing):
  """Balanced: no bias (random router, near-uniform load). Skewed: a fixed random preference."""
  if routing == "balanced":
    return jnp.zeros(E)
  return _SKEW.value * jax.random.normal(jax.random.key(7), (E,))


def fns(cfg, router_vars):
  def fwd(params, x):
    return MoE(cfg).apply({"params": params, "router": router_vars}, x)

  def fwd_bwd(params, x, dy):
    (y, stats), vjp = jax.vjp(fwd, params, x)
    return vjp((dy, jax.tree.map(jnp.zeros_like, stats)))

  return jax.jit(fwd), jax.jit(fwd_bwd)


def dense_fns():
  """SwiGLU with hidden k·F: the same FLOPs as the routed experts, as plain matmuls."""
  def fwd(w, x):
    h = jnp.einsum("nd,dgf->ngf", x, w["gate_up"])
    return jnp.einsum("nf,fd->nd", jax.nn.silu(h[:, 0]) * h[:, 1], w["down"])

  def fwd_bwd(w, x, dy):
    _, vjp = jax.vjp(fwd, w, x)
    return vjp(dy)

  return jax.jit(fwd), jax.jit(fwd_bwd)


def main(argv):
  del argv
  rows, log = [], []
  key = jax.random.key(0)
  x = jax.random.normal(key, (8, _N // 8, _D), jnp.bfloat16)
  dy = jax.random.normal(jax.random.key(1), x.shape, jnp.bfloat16)
  flops = 6 * _N * _K * _D * _F
  pct = lambda ms, f: 100 * f / (ms * 1e-3) / _PEAK_FLOPS

  w = {"gate_up": jax.random.normal(key, (_D, 2, _K * _F), jnp.bfloat16) * _D ** -0.5,
       "down": jax.random.normal(key, (_K * _F, _D), jnp.bfloat16) * (_K * _F) ** -0.5}
  f, fb = dense_fns()
  ms_f = timing.median_ms(f, (w, x.reshape(_N, _D)), _ITERS.value)
  ms_fb = timing.median_ms(fb, (w, x.reshape(_N, _D), dy.reshape(_N, _D)), _ITERS.value)
  rows.append({"E": "-", "routing": "-", "path": f"dense SwiGLU (hidden {_K * _F})",
               "max_vio": 0.0, "dropped": 0.0, "fwd_ms": ms_f, "fwd_pct": pct(ms_f, flops),
               "fwd_bwd_ms": ms_fb, "fwd_bwd_pct": pct(ms_fb, 3 * flops)})
  print(rows[-1], flush=True)

  for E in [int(e) for e in _EXPERTS.value.split(",")]:
    params_of = {}   # per latent width (0 = standard): the paths' parameter trees
    for routing in _ROUTINGS.value.split(","):
      reference = None
      for path in _PATHS.value.split(","):
        try:
          cfg = layer_config(E, path)
          if cfg.moe.latent_dim not in params_of:
            params_of[cfg.moe.latent_dim] = nn.meta.unbox(
                MoE(cfg).init(jax.random.key(2), x[:1, :16])["params"])
          params = params_of[cfg.moe.latent_dim]
          router_vars = {"bias": router_bias(E, routing)}
          f, fb = fns(cfg, router_vars)
          y, stats = f(params, x)
          if path == "dropless":
            reference = y
          err = (float(jnp.linalg.norm((y - reference).astype(jnp.float32))
                       / jnp.linalg.norm(reference.astype(jnp.float32)))
                 if reference is not None and not cfg.moe.latent_dim else float("nan"))
          ms_f = timing.median_ms(f, (params, x), _ITERS.value)
          ms_fb = timing.median_ms(fb, (params, x, dy), _ITERS.value)
          rows.append({"E": E, "routing": routing, "path": path,
                       "max_vio": float(stats["max_vio"]),
                       "dropped": 100 * float(stats["dropped_fraction"]),
                       "rel_err_vs_dropless": err,
                       "fwd_ms": ms_f, "fwd_pct": pct(ms_f, flops),
                       "fwd_bwd_ms": ms_fb, "fwd_bwd_pct": pct(ms_fb, 3 * flops)})
          print(rows[-1], flush=True)
        except Exception:  # noqa: BLE001 — record and go on to the next variant
          log.append(f"E={E} {routing} {path}:\n{traceback.format_exc()}")
          print(log[-1], flush=True)

  header = ("| E | routing | path | MaxVio | dropped % | rel err vs dropless | fwd ms | fwd TFLOP/s "
            "(% peak) | fwd+bwd ms | fwd+bwd TFLOP/s (% peak) |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
  tf = lambda pct: pct * _PEAK_FLOPS / 100 / 1e12
  lines = [header] + [
      f"| {r['E']} | {r['routing']} | {r['path']} | {r['max_vio']:.2f} | {r['dropped']:.1f} | "
      f"{r.get('rel_err_vs_dropless', float('nan')):.1e} | {r['fwd_ms']:.2f} | "
      f"{tf(r['fwd_pct']):.0f} ({r['fwd_pct']:.0f}%) | {r['fwd_bwd_ms']:.2f} | "
      f"{tf(r['fwd_bwd_pct']):.0f} ({r['fwd_bwd_pct']:.0f}%) |" for r in rows]
  table = "\n".join(lines)
  if _OUT.value:
    os.makedirs(_OUT.value, exist_ok=True)
    with open(os.path.join(_OUT.value, "bench_moe.json"), "w") as fh:
      json.dump({"rows": rows, "errors": log, "device": str(jax.devices()[0])}, fh, indent=2)
    with open(os.path.join(_OUT.value, "bench_moe.md"), "w") as fh:
      fh.write(table + "\n")
  print(f"\n{jax.devices()[0]}, tokens {_N}, d_model {_D}, hidden {_F}, top-{_K}, bf16; "
        f"% of {_PEAK_FLOPS / 1e12:.0f} TFLOP/s on the useful expert-matmul FLOPs")
  print(table)


if __name__ == "__main__":
  app.run(main)
