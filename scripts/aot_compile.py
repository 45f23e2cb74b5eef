"""Compile the real train step for a TPU topology on a CPU machine (no TPU needed), and
report the per-device memory XLA plans for it (what MaxText's train_compile.py does).

  pip install 'libtpu==0.0.48.*'      # jax 0.11.2's TPU runtime; only the compiler is used
  python scripts/aot_compile.py --config=configs/kimi_linear_48b.py --topology=v5p:4x4x4 \
      [--config.mesh.fsdp=-1 ...] [--out=benchmarks/aot/kimi_48b.json]

The mesh is the config's (`mesh.*`, one axis may be -1) over the topology's chips. The
state is abstract (shapes and shardings only) and the batch is data.batch_size ×
data.seq_len, as train_and_evaluate builds them. The kernel choices resolve for the target,
TPU (pallas_kernels/platform.py reads the mesh's devices), so the program holds the Mosaic
kernels a TPU run would: KDA (pallas_tpu), MLA flash attention, tokamax's grouped matmul.
Printed: argument / output / temporary / generated-code bytes per device, their sum against
the chip's HBM, the mesh, and the Mosaic kernels in the compiled program by name.
"""

import collections
import json
import os
import re
import time

os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")      # quiets libtpu's host checks
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
# Only the compiler is used, no chip: skip libtpu's one-process-per-host lockfile, so that
# several compiles (and the AOT test) can run side by side.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from moe_jax import config as config_lib, params as params_lib  # noqa: E402
from moe_jax.model.transformer import HybridMoE  # noqa: E402
from moe_jax.parallel.mesh import make_mesh  # noqa: E402
from moe_jax.train import optim, state as state_lib, step as step_lib  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "Config file[:arg].")
_TOPOLOGY = flags.DEFINE_string("topology", "v5p:2x2x2", "TPU generation:chips, e.g. v5p:8x16x16.")
_OUT = flags.DEFINE_string("out", None, "Write the report as JSON here.")

HBM_GB = {"v5p": 95.74, "v5e": 16.0, "v5litepod": 16.0, "v6e": 32.0, "v4": 32.0}


def example_batch(c) -> dict:
  T = c.data.seq_len
  shapes = {"tokens": np.int32, "targets": np.int32, "segment_ids": np.int32,
            "positions": np.int32, "loss_mask": np.float32}
  return {k: np.zeros((1, T), dt) for k, dt in shapes.items()}   # host arrays: shapes only


def mosaic_kernels(hlo_text: str) -> dict:
  """{kernel name: call sites} of the Mosaic custom calls in a compiled TPU program (each
  instruction is named after its pallas_call)."""
  names = re.findall(r"%([A-Za-z_][\w-]*?)(?:\.\d+)? = .*custom_call_target=\"tpu_custom_call\"",
                     hlo_text)
  return dict(sorted(collections.Counter(names).items()))


def ep_buffers_gb(c, chips: int) -> dict:
  """Per chip, one MoE layer's all-to-all send buffer [P, S, D] (bf16) for its local
  assignments: the worst case (S = all of them: the dispatch before rounds) and the
  load-sized one (S = ep_buffer_factor × the balanced share; parallel/expert.py)."""
  from moe_jax.parallel import expert as expert_parallel
  m, P = c.model, c.mesh.expert
  if P <= 1 or not m.moe.num_experts:
    return {}
  tokens = c.data.batch_size * c.data.seq_len // chips
  A = tokens * m.moe.top_k
  width = m.moe.latent_dim or m.d_model
  S = expert_parallel.slots(A, P, m.moe.ep_buffer_factor)
  return {"worst_case_gb": P * A * width * 2 / 1e9, "load_sized_gb": P * S * width * 2 / 1e9}


def compile_for(c, topology: str, config_path: str = "") -> dict:
  config_lib.validate(c)
  devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
  mesh = make_mesh(c.mesh, devices)
  with jax.set_mesh(mesh):
    model = HybridMoE(state_lib.frozen_model_config(c))
    tx = optim.make_optimizer(c)
    t0 = time.perf_counter()
    abstract, state_sh, _ = state_lib.train_state_plan(model, tx, example_batch(c), mesh)
    batch_sh = state_lib.batch_sharding(mesh)
    batch = state_lib.abstract_batch(c, example_batch(c), batch_sh)
    lowered = step_lib.jit_train_step(c, state_sh, batch_sh).lower(abstract, batch)
    t_lower = time.perf_counter() - t0
    compiled = lowered.compile()
    t_compile = time.perf_counter() - t0 - t_lower
  mem = compiled.memory_analysis()
  per_device = {k: getattr(mem, f"{k}_size_in_bytes") for k in
                ("argument", "output", "temp", "generated_code", "alias")}
  total = per_device["argument"] + per_device["output"] + per_device["temp"] + \
      per_device["generated_code"] - per_device["alias"]
  chip = topology.split(":")[0]
  counts = params_lib.count(c)
  kernels = mosaic_kernels(compiled.as_text())
  return {"config": config_path, "moe_dispatch": c.model.moe.dispatch,
          "ep_buffer_factor": c.model.moe.ep_buffer_factor,
          "global_batch": c.data.batch_size * c.data.seq_len,
          "ep_buffer_per_layer": ep_buffers_gb(c, len(devices)),
          "mosaic_kernels": kernels, "topology": topology, "chips": len(devices), "device_kind": devices[0].device_kind,
          "mesh": dict(mesh.shape), "batch": [c.data.batch_size, c.data.seq_len],
          "per_device_bytes": per_device, "per_device_total_gb": total / 1e9,
          "hbm_gb": HBM_GB.get(chip), "lower_s": t_lower, "compile_s": t_compile,
          "params_total": counts["total_sum"], "params_active": counts["active_sum"]}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  r = compile_for(_CONFIG.value, _TOPOLOGY.value,
                  config_flags.get_config_filename(flags.FLAGS["config"]))
  if _OUT.value:
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    with open(_OUT.value, "w") as f:
      json.dump(r, f, indent=2, default=str)
  gb = {k: v / 1e9 for k, v in r["per_device_bytes"].items()}
  print(f"{r['topology']} ({r['chips']} × {r['device_kind']}), mesh {r['mesh']}, "
        f"batch {r['batch'][0]} × {r['batch'][1]}: lowered in {r['lower_s']:.0f} s, "
        f"compiled in {r['compile_s']:.0f} s")
  print(f"per device: arguments {gb['argument']:.2f} GB, outputs {gb['output']:.2f} GB "
        f"(aliased {gb['alias']:.2f}), temporaries {gb['temp']:.2f} GB, code "
        f"{gb['generated_code']:.3f} GB; total {r['per_device_total_gb']:.2f} GB of "
        f"{r['hbm_gb']} GB HBM")
  print("Mosaic kernels: " + (", ".join(f"{k} ×{n}" for k, n in r["mosaic_kernels"].items())
                              or "none"))


if __name__ == "__main__":
  app.run(main)
