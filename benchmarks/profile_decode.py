"""Where decode time goes: one jitted decode step (T = 1) for models of only KDA or only MLA
layers, and the KDA op alone, on the long_context_1b shapes.

  python -m benchmarks.profile_decode [--layers=4] [--filled=8192] [--batch=8]
      [--decode_matmul=pallas] [--decode_dispatch=fused] [--kda_decode=kernel]
      [--trace_dir=DIR]
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from configs import long_context_1b
from moe_jax.infer.cache import init_cache
from moe_jax.infer.generate import inference_model, make_step
from moe_jax.train.state import frozen_model_config
from pallas_kernels.kda import kda
from benchmarks.random_variables import random_variables
from benchmarks.timing import median_ms
from benchmarks.xprof_tables import hlo_op_table

_LAYERS = flags.DEFINE_integer("layers", 4, "Layers per probe model.")
_FILLED = flags.DEFINE_integer("filled", 8192, "Cache length the decode step continues from.")
_BATCH = flags.DEFINE_integer("batch", 1, "Rows decoded per step.")
_MATMUL = flags.DEFINE_string("decode_matmul", "pallas", "model.decode_matmul: xla | pallas.")
_DISPATCH = flags.DEFINE_string(
    "decode_dispatch", "auto", "model.moe.decode_dispatch: auto | gather | fused | grouped | layer.")
_KDA_DECODE = flags.DEFINE_string("kda_decode", "auto", "model.kda_decode: auto | xla | kernel.")
_TRACE = flags.DEFINE_string("trace_dir", None, "Also trace the KDA-only and MLA-only steps "
                             "with the JAX profiler here (subfolders K, A) and print xprof's "
                             "per-op tables and the launches and device time per 5 steps.")


def step_ms(pattern, moe=True, trace=False, **model):
  c = long_context_1b.get_config()
  c.model.update({"dtype": "bfloat16", "n_layers": _LAYERS.value, "layer_pattern": pattern,
                  "decode_matmul": _MATMUL.value, "kda_decode": _KDA_DECODE.value,
                  **model})
  c.model.moe.decode_dispatch = _DISPATCH.value
  if not moe:
    c.model.moe.num_experts = 0
  m = inference_model(frozen_model_config(c))
  variables = random_variables(m, 64)
  B = _BATCH.value
  cache = init_cache(m.cfg, B, 4 * _FILLED.value)
  cache["length"] = jnp.full((B,), _FILLED.value, jnp.int32)
  step = jax.jit(make_step(m))
  tok, live = np.zeros((B, 1), np.int32), np.ones((B, 1), bool)
  ms = median_ms(lambda: step(variables, tok, live, cache), (), 50)
  if trace:
    trace_dir = os.path.join(_TRACE.value, pattern)
    with jax.profiler.trace(trace_dir):
      for _ in range(5):
        jax.block_until_ready(step(variables, tok, live, cache))
    with open(os.path.join(trace_dir, "decode_step.hlo.txt"), "w") as f:
      f.write(step.lower(variables, tok, live, cache).compile().as_text())
  return ms


def kda_ms(impl, T=1):
  B, H, K = 1, 16, 64
  ks = jax.random.split(jax.random.key(0), 5)
  q = jax.random.normal(ks[0], (B, T, H, K), jnp.bfloat16)
  k = jax.random.normal(ks[1], (B, T, H, K), jnp.bfloat16)
  v = jax.random.normal(ks[2], (B, T, H, K), jnp.bfloat16)
  g = -jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H, K)))
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
  S0 = jnp.zeros((B, H, K, K))
  f = jax.jit(lambda *a: kda(*a, initial_state=S0, output_final_state=True, lower_bound=-5.0,
                             implementation=impl))
  return median_ms(f, (q, k, v, g, beta), 50)


def main(argv):
  del argv
  rows = [("KDA op alone, recurrent, T=1", kda_ms("recurrent")),
          ("KDA op alone, xla chunked, T=1", kda_ms("xla")),
          (f"{_LAYERS.value} KDA layers, MoE", step_ms("K", trace=bool(_TRACE.value))),
          (f"{_LAYERS.value} MLA layers, MoE", step_ms("A", trace=bool(_TRACE.value))),
          (f"{_LAYERS.value} KDA layers, dense FFN", step_ms("K", moe=False)),
          (f"{_LAYERS.value} MLA layers, dense FFN", step_ms("A", moe=False))]
  print(f"\n{jax.devices()[0]}; decode step at filled {_FILLED.value}, batch {_BATCH.value}, "
        f"bf16, projections {_MATMUL.value}, experts {_DISPATCH.value}, "
        f"kda_decode {_KDA_DECODE.value}")
  print("| probe | ms |\n|---|---|")
  for name, ms in rows:
    print(f"| {name} | {ms:.3f} |")
  if _TRACE.value:
    for pattern, name in (("K", "KDA-only"), ("A", "MLA-only")):
      print(hlo_op_table(os.path.join(_TRACE.value, pattern), f"{name} step, 5 steps"))


if __name__ == "__main__":
  app.run(main)
