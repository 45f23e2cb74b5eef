"""The grouped matmul's three products on the GPU: tokamax's y and dx, tokamax's dw (wrong on
the H200: benchmarks/moe.md) and pallas_kernels/moe/grouped_dw.py, with dw's error against
an fp32 reference.

  python scripts/bench_grouped_dw.py [--rows=131072] [--experts=32] [--shapes=1024x1408,704x1024]

bf16; group sizes are Dirichlet(0.5)-skewed with one empty group and 100 rows past the
groups. FLOPs 2·rows·K·N per product. Median of --iters runs after warm-up.
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from moe_jax.model import experts
from pallas_kernels.moe import grouped_dw as gdw
from scripts import timing

_ROWS = flags.DEFINE_integer("rows", 131072, "Rows (tokens × top-k) of the timed products.")
_EXPERTS = flags.DEFINE_integer("experts", 32, "Groups.")
_SHAPES = flags.DEFINE_string("shapes", "1024x1408,704x1024", "K x N pairs, comma-separated.")
_ITERS = flags.DEFINE_integer("iters", 10, "Timed runs per measurement (median reported).")
_PEAK_FLOPS = 762e12  # bf16 matmul through JAX, measured on this H200 (shared/device/README.md)


def _inputs(M, E, K, N, seed=7):
  rng = np.random.default_rng(seed)
  sizes = rng.multinomial(M - 100, rng.dirichlet(np.ones(E) * 0.5))
  sizes[3] = 0
  x = jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16)
  dy = jnp.asarray(rng.normal(size=(M, N)), jnp.bfloat16)
  return jnp.asarray(sizes, jnp.int32), x, dy


def _tokamax_dw(x, dy, gs):
  import tokamax
  return tokamax.ragged_dot_general(x, dy, gs, experts._RAGGED_CONTRACTING,
                                    preferred_element_type=x.dtype, implementation="mosaic")


def _dw_errors(E, K, N):
  """dw relative error of both kernels at 4096 rows, against fp32 ragged_dot's VJP (the
  fp32 reference is dense in E, so it is not run at the timed size)."""
  gs, x, dy = _inputs(4096, E, K, N)
  dy = jnp.where((jnp.arange(4096) < gs.sum())[:, None], dy, 0)
  w0 = jnp.zeros((E, K, N), jnp.float32)
  with jax.default_matmul_precision("highest"):
    _, vjp = jax.vjp(lambda w: jax.lax.ragged_dot(x.astype(jnp.float32), w, gs), w0)
    ref = np.asarray(vjp(dy.astype(jnp.float32))[0])
  err = lambda a: float(np.linalg.norm(np.asarray(a, np.float32) - ref) / np.linalg.norm(ref))
  return err(_tokamax_dw(x, dy, gs)), err(gdw.grouped_dw(x, dy, gs))


def main(_):
  import tokamax
  M, E = _ROWS.value, _EXPERTS.value
  print("| K → N | product | ms | TFLOP/s | % peak | dw rel. err (4096 rows) |")
  print("|---|---|---|---|---|---|")
  for shape in _SHAPES.value.split(","):
    K, N = map(int, shape.split("x"))
    gs, x, dy = _inputs(M, E, K, N)
    w = jnp.asarray(np.random.default_rng(1).normal(size=(E, K, N)) / np.sqrt(K), jnp.bfloat16)
    err_tk, err_ours = _dw_errors(E, K, N)
    products = [   # arrays go in as arguments: closed-over ones would be baked into the HLO
        ("y (tokamax)", lambda x, w, dy, gs: tokamax.ragged_dot(
            x, w, gs, implementation="mosaic"), ""),
        ("dx (tokamax)", lambda x, w, dy, gs: tokamax.ragged_dot(
            dy, jnp.swapaxes(w, 1, 2), gs, implementation="mosaic"), ""),
        ("dw (tokamax)", lambda x, w, dy, gs: _tokamax_dw(x, dy, gs), f"{err_tk:.1e}"),
        ("dw (grouped_dw)", lambda x, w, dy, gs: gdw.grouped_dw(x, dy, gs), f"{err_ours:.1e}"),
    ]
    flops = 2 * (M - 100) * K * N
    for name, fn, err in products:
      ms = timing.median_ms(jax.jit(fn), (x, w, dy, gs), _ITERS.value)
      tflops = flops / ms / 1e9
      print(f"| {K} → {N} | {name} | {ms:.3f} | {tflops:.0f} | "
            f"{100 * tflops * 1e12 / _PEAK_FLOPS:.0f}% | {err} |", flush=True)


if __name__ == "__main__":
  app.run(main)
