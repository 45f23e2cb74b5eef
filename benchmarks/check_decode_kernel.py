"""The KDA decode kernel compiled (Triton) against the same kernel in interpret mode (XLA ops),
on one GPU, output by output, across launch configurations: a check for what interpret mode
on CPU cannot show (races between a program's warps, miscompiles at some widths).

  python -m benchmarks.check_decode_kernel [--shapes=2x32x128,...] [--num_warps=4,8] [--out=DIR]

Each row: B×H×K, dtype, num_warps, and the relative error of o, the new state, the state's
update (new − old) and the conv tails. In fp32 both sides should agree to ~1e-7; in bf16
they round in different places (XLA's fusions keep excess precision), so ~5e-3 is normal
there and only fp32 rows are a pass/fail signal. Results: benchmarks/gpu_tests.md.
"""

import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from pallas_kernels.kda import pallas_gpu_decode

_SHAPES = flags.DEFINE_list("shapes", ["2x2x16", "2x4x32", "1x16x64", "2x16x64", "2x2x64",
                                       "1x32x128", "2x32x128", "1x2x128", "2x32x32"],
                            "BxHxK launch shapes (K = V).")
_WARPS = flags.DEFINE_list("num_warps", ["4", "8"], "Launch widths to run each shape at.")
_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "Model dtypes.")
_FP32_BOUND = flags.DEFINE_float("fp32_bound", 1e-5, "Largest fp32 error that passes.")
_OUT = flags.DEFINE_string("out", None, "Folder for check_decode_kernel.json.")


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / (np.linalg.norm(b) + 1e-30))


def inputs(B, H, K, dtype, W=4, seed=0):
  """Random projections, tails, weights and state for one step (every row live)."""
  r = np.random.default_rng(seed)
  n = lambda *s, scale=1.0: jnp.asarray(r.normal(size=s) * scale, dtype)
  widths = (H * K, H * K, H * K, K, H, K)
  where = {name: (0, int(first)) for name, first in
           zip(pallas_gpu_decode.PROJECTIONS, np.cumsum((0,) + widths))}
  conv = {c: (n(B, W - 1, H * K), n(W, H * K, scale=0.5)) for c in "qkv"}
  conv["seg"] = jnp.ones((B, W - 1), jnp.int32)
  params = {"f_b": n(K, H, K, scale=K ** -0.5), "A_log": n(H, scale=0.1),
            "dt_bias": n(H * K, scale=0.1), "g_b": n(K, H, K, scale=K ** -0.5),
            "g_b_bias": None, "o_norm": n(K, scale=0.1) + 1}
  state = jnp.asarray(r.normal(size=(B, H, K, K)) * 0.1, jnp.float32)
  return (n(B, sum(widths)),), where, jnp.ones(B, jnp.int32), conv, params, state


def check(B, H, K, dtype, warps) -> dict:
  srcs, where, seg, conv, params, state = inputs(B, H, K, dtype)
  shipped = pallas_gpu_decode.num_warps
  pallas_gpu_decode.num_warps = lambda K: warps
  try:
    outs = {}
    for interpret in (True, False):
      step = jax.jit(lambda *a, interpret=interpret: pallas_gpu_decode.decode_step(
          *a[:1], where, *a[1:], lower_bound=None, eps=1e-6, dtype=dtype,
          interpret=interpret))
      with jax.default_matmul_precision("highest"):
        outs[interpret] = jax.device_get(step(srcs, seg, conv, params, state))
  finally:
    pallas_gpu_decode.num_warps = shipped
  (o1, S1, t1, _), (o0, S0, t0, _) = outs[True], outs[False]
  return {"o": rel_err(o0, o1), "state": rel_err(S0, S1),
          "update": rel_err(S0 - state, S1 - state),
          "tails": max(rel_err(a, b) for a, b in zip(t0, t1))}


def main(_):
  if jax.default_backend() != "gpu":
    raise SystemExit(f"check_decode_kernel compares the compiled Triton kernel with interpret "
                     f"mode: it needs a GPU, and JAX's backend is {jax.default_backend()!r}")
  rows = []
  for shape, dtype, warps in itertools.product(_SHAPES.value, _DTYPES.value, _WARPS.value):
    B, H, K = (int(x) for x in shape.split("x"))
    row = {"B": B, "H": H, "K": K, "dtype": dtype, "num_warps": int(warps),
           "shipped_warps": pallas_gpu_decode.num_warps(K),
           **check(B, H, K, jnp.dtype(dtype), int(warps))}
    if dtype == "float32":
      row["pass"] = max(row["o"], row["state"], row["tails"]) < _FP32_BOUND.value
    rows.append(row)
    print(json.dumps(row), flush=True)
  failed = [r for r in rows if r.get("pass") is False]
  print(f"{len(failed)} of {sum('pass' in r for r in rows)} fp32 rows over "
        f"{_FP32_BOUND.value:g}")
  if _OUT.value:
    os.makedirs(_OUT.value, exist_ok=True)
    with open(os.path.join(_OUT.value, "check_decode_kernel.json"), "w") as f:
      json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
