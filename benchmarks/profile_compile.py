"""Where the train step's cold compile goes: XLA's own trace events (passes, autotuning,
LLVM, ptxas, Triton) during `compile()`, summed by name, with a fresh compilation cache.

  python -m benchmarks.profile_compile --row=1b_dropless [--set=k=v ...] [--out=$OUT]

The row is one of benchmarks/bench_train.py's ROWS; --set and --out are its flags (with --out
given, the summary goes to <out>/compile_<row>.json). Printed: trace+lower and compile seconds
and the 40 event names with the most time (inclusive; nested events overlap, and XLA runs
some stages on several threads, so a name's total can exceed the wall time).

  python -m benchmarks.profile_compile --row=1b_dropless --part=grads+update

times (no profiler) a part of the step instead: its gradient half, its update half, both
compiled at once on two threads (what train.split_step waits for), the one-program step
(`train_step`) or the loss alone (`forward`).
"""

import collections
import glob
import gzip
import json
import os
import tempfile
import time

import jax
from absl import app, flags

from moe_jax.data import pipeline
from moe_jax.model.transformer import HybridMoE
from moe_jax.parallel.mesh import make_mesh
from moe_jax.train import compile_cache, optim, state as state_lib, step as step_lib, xla_flags
from benchmarks import bench_train

_ROW = flags.DEFINE_string("row", "1b_dropless", "A row of benchmarks/bench_train.py.")
_PART = flags.DEFINE_enum(
    "part", "step", ["step", "train_step", "grads", "update", "grads+update", "forward"],
    "What to compile: 'step', the one-program train step, profiled; the others are timed "
    "only: 'train_step' (the same program), the gradient or the update half of "
    "train.split_step (step.jit_step_halves), both halves at once on two threads, or the "
    "loss alone ('forward').")


def _parts(c, state_sh, batch_sh, abstract, batch):
  """{part: (jitted function, abstract arguments)}; the update's arguments are a function of
  the gradient half's out_info."""
  grads, update = step_lib.jit_step_halves(c, state_sh, batch_sh)
  w = c.model.vision.patch_loss_weight

  def forward(state, batch):
    return step_lib.loss_fn(state.params, state.router, state.apply_fn, batch, w)

  def update_args(grads_out_info=None):   # the gradient half's outputs (traced if not given)
    return (abstract, *(grads_out_info or grads.trace(abstract, batch).out_info))

  return {
      "train_step": (step_lib.jit_train_step(c, state_sh, batch_sh), (abstract, batch)),
      "grads": (grads, (abstract, batch)),
      "update": (update, update_args),
      "forward": (jax.jit(forward, in_shardings=(state_sh, batch_sh)), (abstract, batch)),
  }


def event_totals(trace_dir: str) -> dict:
  """{event name: [total seconds, count, distinct threads]} from the Perfetto trace."""
  path, = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
  with gzip.open(path) as f:
    events = json.load(f)["traceEvents"]
  totals = collections.defaultdict(lambda: [0.0, 0, set()])
  for e in events:
    if e.get("ph") == "X" and "dur" in e:
      t = totals[e["name"]]
      t[0] += e["dur"] / 1e6
      t[1] += 1
      t[2].add(e.get("tid"))
  return {k: [v[0], v[1], len(v[2])] for k, v in totals.items()}


def main(argv):
  del argv
  c = bench_train.row_config(_ROW.value, bench_train._SET.value)
  xla_flags.apply_config(c.train)   # before jax starts, as train.py
  compile_cache.enable(tempfile.mkdtemp(prefix="xla_cache_profile_"))   # empty: a cold compile
  mesh = make_mesh(c.mesh)
  with jax.set_mesh(mesh):
    example = next(iter(pipeline.train_dataset(pipeline.sources(c)["train"], c)))
    model = HybridMoE(state_lib.frozen_model_config(c))
    abstract, state_sh, _ = state_lib.train_state_plan(model, optim.make_optimizer(c),
                                                       example, mesh)
    batch_sh = state_lib.batch_sharding(mesh)
    batch = state_lib.abstract_batch(c, example, batch_sh)
    if _PART.value != "step":
      _time_parts(c, state_sh, batch_sh, abstract, batch)
      return
    t = time.perf_counter()
    lowered = step_lib.jit_train_step(c, state_sh, batch_sh).lower(abstract, batch)
    lower_s = time.perf_counter() - t
    trace_dir = tempfile.mkdtemp(prefix="compile_trace_")
    t = time.perf_counter()
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      lowered.compile()
    compile_s = time.perf_counter() - t
  totals = event_totals(trace_dir)
  top = sorted(totals.items(), key=lambda kv: -kv[1][0])[:40]
  print(f"{_ROW.value}: trace+lower {lower_s:.1f} s, compile {compile_s:.1f} s (profiled)")
  print("| event | total s | count | threads |\n|---|---|---|---|")
  for name, (s, n, threads) in top:
    print(f"| {name[:90]} | {s:.2f} | {n} | {threads} |")
  if flags.FLAGS["out"].present:
    with open(os.path.join(bench_train._OUT.value, f"compile_{_ROW.value}.json"), "w") as f:
      json.dump({"row": _ROW.value, "set": bench_train._SET.value, "lower_s": lower_s,
                 "compile_s": compile_s, "events": dict(top)}, f, indent=1)


def _time_parts(c, state_sh, batch_sh, abstract, batch):
  """Trace+lower and compile seconds of the parts named by --part (two at once: each on
  its own thread, as jax's compile leaves the GIL)."""
  import concurrent.futures
  parts = _parts(c, state_sh, batch_sh, abstract, batch)
  names = _PART.value.split("+")
  lowered, out = {}, {}
  for n in names:   # grads before update: the update's arguments are its outputs
    fn, args = parts[n]
    if n == "update":
      args = args(lowered["grads"].out_info if "grads" in lowered else None)
    t = time.perf_counter()
    lowered[n] = fn.lower(*args)
    out[f"{n}_lower_s"] = time.perf_counter() - t

  def compile_one(n):
    t = time.perf_counter()
    lowered[n].compile()
    return time.perf_counter() - t

  t = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
    for n, s in zip(names, pool.map(compile_one, names)):
      out[f"{n}_compile_s"] = s
  out["compile_wall_s"] = time.perf_counter() - t
  print(f"{_ROW.value} {_PART.value}: " + ", ".join(f"{k} {v:.1f}" for k, v in out.items()),
        flush=True)
  if flags.FLAGS["out"].present:
    with open(os.path.join(bench_train._OUT.value,
                           f"compile_{_ROW.value}_{_PART.value}.json"), "w") as f:
      json.dump({"row": _ROW.value, "part": _PART.value, "set": bench_train._SET.value, **out},
                f, indent=1)


if __name__ == "__main__":
  app.run(main)
