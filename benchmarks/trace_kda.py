"""Where KDA's time goes, kernel by kernel: our implementations under the JAX profiler
(xprof's per-op table) and fla's chunk_kda under the torch profiler, same shape and inputs.

  python -m benchmarks.trace_kda --shape=4x8192x16 --impls=triton,pallas_gpu --fla=false --out=$OUT
  python -m benchmarks.trace_kda --impls= --fla=true --passes=fwd   # fla's forward kernels only
  python -m benchmarks.trace_kda --impls=triton --knobs=triton:WU_STAGES=3 --fla=false

Each side runs forward and forward+backward 5 times inside its trace; the tables list the
ops/kernels by total device time (divide by 5 for one call).
"""

import os

import jax
import jax.numpy as jnp
from absl import app, flags

from benchmarks.bench_kda import fla_fns, inputs, jax_fns, knob_impl, parse_shape, set_knobs
from benchmarks.xprof_tables import hlo_op_table

_SHAPE = flags.DEFINE_string("shape", "4x8192x16", "BxTxH (K=V=128) or BxTxHxK.")
_OUT = flags.FLAGS["out"]  # defined by bench_kda: here the folder for traces and tables
# bench_kda's flags: --impls (ours to trace, comma-separated), --fla (fla too; its backward
# autotunes for minutes a shape), --knobs (one more trace per setting, e.g.
# --knobs=triton:WU_STAGES=3).
_IMPLS, _FLA, _KNOBS = flags.FLAGS["impls"], flags.FLAGS["fla"], flags.FLAGS["knobs"]
_PASSES = flags.DEFINE_list("passes", ["fwd", "fwd_bwd"], "Which calls to trace: fwd, "
                             "fwd_bwd (fla's backward autotunes for minutes a shape).")
_REPS = 5


def trace_ours(inp, folder, impl, label=None):
  """impl's forward and forward+backward under the profiler, in folder/<label>_<pass>."""
  label = label or impl
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)
  args = [bf(inp["q"]), bf(inp["k"]), bf(inp["v"]), bf(inp["x"]), bf(inp["beta"]),
          jnp.asarray(inp["A_log"]), jnp.asarray(inp["dt_bias"])]
  fwd, fwd_bwd = jax_fns(impl)
  for name, fn, a in (("fwd", fwd, args), ("fwd_bwd", fwd_bwd, args + [bf(inp["do"])])):
    if name not in _PASSES.value:
      continue
    jax.block_until_ready(fn(*a))
    d = os.path.join(folder, f"{label}_{name}")
    with jax.profiler.trace(d):
      for _ in range(_REPS):
        jax.block_until_ready(fn(*a))
    print(hlo_op_table(d, f"{label} {name}, {_REPS} calls"), flush=True)


def trace_fla(inp):
  import torch
  from torch.profiler import ProfilerActivity, profile
  f, fb = fla_fns(inp)
  for name, fn in (("fwd", f), ("fwd_bwd", fb)):
    if name not in _PASSES.value:
      continue
    for _ in range(3):
      fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
      for _ in range(_REPS):
        fn()
      torch.cuda.synchronize()
    print(f"\nfla {name}, {_REPS} calls")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60),
          flush=True)


def main(argv):
  del argv
  B, T, H, D = parse_shape(_SHAPE.value)
  inp = inputs(B, T, H, dim=D)
  folder = _OUT.value or "/tmp/trace_kda"
  for impl in filter(None, _IMPLS.value.split(",")):
    trace_ours(inp, folder, impl)
  for spec in _KNOBS.value:   # the knob rows of bench_kda, traced
    impl, _, settings = knob_impl(spec)
    undo = set_knobs(spec)
    try:
      # (no brackets: the trace folder's name is globbed when the table is read)
      trace_ours(inp, folder, impl, f"{impl}-{settings}".replace("=", "-").replace(",", "_"))
    finally:
      undo()
  if _FLA.value:
    try:
      trace_fla(inp)
    except Exception as e:  # noqa: BLE001 — fla is optional
      print(f"fla not traced: {type(e).__name__}: {e}")


if __name__ == "__main__":
  app.run(main)
