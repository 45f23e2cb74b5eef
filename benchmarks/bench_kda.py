"""KDA speed on the GPU: triton (the default), pallas_gpu and xla vs flash-linear-attention's
chunk_kda, same inputs.

  python -m benchmarks.bench_kda --out=$OUT [--shapes=1x8192x16,4x8192x16] [--impls=triton,pallas_gpu,xla]
      [--jobs=2 --shape_timeout=280]   # one process per shape, two GPUs at a time

bf16 inputs, K=V=128, bounded gate (lower_bound=-5; --gate=unbounded: Kimi's, no bound, fla
with safe_gate off) computed from raw gate inputs as part of the timed function: inside the op as fla's (A_log, dt_bias passed; pallas_gpu's prologue
kernel), or in XLA before it for "<impl>/xla_gate". Median of --iters runs after warm-up,
on benchmarks/timing.py's two clocks for every row, fla's included: pipelined (fwd_ms: windows
of calls dispatched back to back, the device's time per call; the ratios' clock) and blocked
(fwd_ms_blocked: each call waited on). fla's row also has triton's do_bench (_do_bench), the
clock of fla's own benchmarks: set against our blocked rows, it would charge our host dispatch
and wake-up (about 0.3 ms a call) to us. With fla's row in the process, every row has
fwd_x_fla, fwd_bwd_x_fla (pipelined) and fwd_x_fla_blocked, fwd_bwd_x_fla_blocked: fla's ms
over its own.
Every row also records its wall time with compiles (row_s; fla's first_fwd_s: its first
call, compiles and any autotuning), what a device call's plan needs. Unbounded gates'
stage 1 is pallas_gpu.UNBOUNDED_STAGE1's; `--knobs=UNBOUNDED_STAGE1='xla'` times the
other one in the same process (a pallas_gpu row; `triton:UNBOUNDED_STAGE1='xla'` a triton
row).
"""

import ast
import functools
import json
import os
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from pallas_kernels.kda import kda, kda_gate, pallas_gpu
from benchmarks import timing

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repo
_SHAPES = flags.DEFINE_string("shapes", "1x8192x16,4x8192x16,1x32768x16,1x65536x32,8x4096x32",
                              "Comma-separated BxTxH, or BxTxHxK for K = V other than 128 "
                              "(long_context_1b's heads: 64).")
_IMPLS = flags.DEFINE_string("impls", "triton,pallas_gpu,xla", "Our implementations to time "
                             "(impl/xla_gate: the gate in XLA before the op, the old path).")
_FLA = flags.DEFINE_bool("fla", True, "Time fla too (its autotuning takes minutes a shape).")
_KNOBS = flags.DEFINE_multi_string(
    "knobs", [], "Extra pallas_gpu rows with module launch knobs set, e.g. "
    "--knobs=BLOCK_K=64,ROLLED=False --knobs=WARPS.tiles=2, or triton rows with triton_gpu's: "
    "--knobs=triton:WU_BLOCK=32 (restored after the row).")
_JOBS = flags.DEFINE_integer(
    "jobs", 1, "Shapes at a time, each in its own process; process slot i runs on GPU i "
    "(CUDA_VISIBLE_DEVICES). fla autotunes per process, so this is what fits a multi-GPU "
    "host's table into one time limit.")
_SHAPE_TIMEOUT = flags.DEFINE_integer(
    "shape_timeout", 0, "With --jobs > 1: seconds before a shape's process is stopped "
    "(0: no limit). The rows it finished are kept.")
_ITERS = flags.DEFINE_integer("iters", 20, "Timed runs per measurement (median reported).")
_GATE = flags.DEFINE_enum("gate", "bounded", ["bounded", "unbounded"], "The gate: bounded by "
                          "-5 (the seeds') or unbounded (Kimi Linear's).")
_OUT = flags.DEFINE_string("out", None, "Folder for the JSON and markdown results.")
_DIM = 128
_LOWER = -5.0
_PEAK_FLOPS = 762e12   # bf16 matmul through JAX, measured on this H200 (shared/device/README.md)
_PEAK_BYTES = 4.3e12   # device copy, read + write


def inputs(B, T, H, seed=0, dim=_DIM):
  rng = np.random.default_rng(seed)
  K = V = dim
  normed = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  return {
      "q": normed(rng.standard_normal((B, T, H, K), np.float32)),
      "k": normed(rng.standard_normal((B, T, H, K), np.float32)),
      "v": rng.standard_normal((B, T, H, V), np.float32),
      "x": rng.standard_normal((B, T, H, K), np.float32),
      "beta": 1 / (1 + np.exp(-rng.standard_normal((B, T, H), np.float32))),
      "A_log": np.log(rng.uniform(1, 16, H)).astype(np.float32),
      "dt_bias": rng.standard_normal(H * K).astype(np.float32) * 0.5,
      "do": rng.standard_normal((B, T, H, V), np.float32),
  }


def parse_shape(shape):
  """(B, T, H, K) of 'BxTxH' (K = 128) or 'BxTxHxK'."""
  parts = shape.split("x")
  if len(parts) not in (3, 4) or not all(p.isdigit() and int(p) > 0 for p in parts):
    raise ValueError(f"--shapes entry {shape!r}: expected BxTxH or BxTxHxK, positive integers")
  dims = tuple(map(int, parts))
  return dims if len(dims) == 4 else dims + (_DIM,)


def floors(B, T, H, C=64, dim=_DIM):
  """FLOPs of the chunked algorithm's matmuls and the fewest bytes moved (bf16 tensors)."""
  K = V = dim
  per_chunk = 3 * C * C * K + 2 * C * C * V + 6 * C * K * V
  fwd_flops = B * H * (T // C) * per_chunk
  fwd_bytes = B * T * H * (2 * (3 * K + 2 * V) + 2)
  bwd_bytes = B * T * H * 2 * (6 * K + 4 * V + 2)
  return {"fwd": (fwd_flops, fwd_bytes), "fwd_bwd": (3 * fwd_flops, bwd_bytes)}


def time_jax(fn, args, iters):
  """({"": pipelined ms, "_blocked": blocked ms}, output of one call): benchmarks/timing.py's
  two clocks, which time_torch uses for fla too."""
  out = fn(*args)
  return {"": timing.pipelined_ms(fn, args, iters, warmup=2),
          "_blocked": timing.median_ms(fn, args, iters, warmup=1)}, out


def lower_bound():
  """The gate's lower bound (--gate): -5, or None for Kimi's unbounded gate."""
  return _LOWER if _GATE.value == "bounded" else None


def knob_impl(spec):
  """(implementation, modules, settings) of a --knobs spec: 'triton:NAME=VALUE,...' sets
  triton_gpu's, triton_gpu_stage1's or triton_gpu_fwd16's knobs for a triton row, anything
  else pallas_gpu's."""
  if spec.startswith("triton:"):
    from pallas_kernels.kda import triton_gpu, triton_gpu_fwd16, triton_gpu_stage1
    return ("triton", (triton_gpu, triton_gpu_stage1, triton_gpu_fwd16),
            spec.removeprefix("triton:"))
  return "pallas_gpu", (pallas_gpu,), spec


def set_knobs(spec):
  """Applies 'NAME=VALUE,...' (NAME.key for a dict entry) to pallas_gpu, or with a
  'triton:' prefix to whichever of triton_gpu, triton_gpu_stage1 and triton_gpu_fwd16 has
  it, or to pallas_gpu where none has such a knob (the triton implementation runs
  pallas_gpu's op with its own stages, so pallas_gpu's UNBOUNDED_STAGE1 applies to it too);
  returns an undo."""
  saved = []
  _, modules, spec = knob_impl(spec)
  for item in (x for x in spec.split(",") if x):
    name, value = item.split("=")
    name, _, key = name.partition(".")
    owner = next((m for m in (*modules, pallas_gpu) if hasattr(m, name)), modules[0])
    holder = getattr(owner, name) if key else owner.__dict__
    key = key or name
    if key not in holder:
      raise ValueError(f"--knobs: {' / '.join(m.__name__ for m in modules)} has no "
                       f"{item.split('=')[0]!r}")
    saved.append((holder, key, holder[key]))
    holder[key] = ast.literal_eval(value)
  jax.clear_caches()   # knobs are read while tracing

  def undo():
    for holder, key, old in reversed(saved):
      holder[key] = old
    jax.clear_caches()
  return undo


def jax_fns(impl):
  """impl: an implementation with the gate inside the op (A_log, dt_bias passed, as fla's
  use_gate_in_kernel), or "<impl>/xla_gate": kda_gate in XLA, then the op on g."""
  impl, _, variant = impl.partition("/")

  def fwd(q, k, v, x, beta, A_log, dt_bias):
    if variant == "xla_gate":
      g = kda_gate(x, A_log, dt_bias, lower_bound=lower_bound())
      return kda(q, k, v, g, beta, lower_bound=lower_bound(), implementation=impl)[0]
    return kda(q, k, v, x, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound(),
               implementation=impl)[0]

  def fwd_bwd(q, k, v, x, beta, A_log, dt_bias, do):
    o, vjp = jax.vjp(fwd, q, k, v, x, beta, A_log, dt_bias)
    return o, vjp(do)

  return jax.jit(fwd), jax.jit(fwd_bwd)


def fla_fns(inp):
  import torch
  from fla.ops.kda import chunk_kda

  dev = "cuda"
  t = {n: torch.tensor(a, device=dev) for n, a in inp.items()}
  for n in ("q", "k", "v", "x", "beta", "do"):
    t[n] = t[n].to(torch.bfloat16)
  leaves = {n: t[n].clone().requires_grad_(True) for n in ("q", "k", "v", "x", "beta")}

  def fwd():
    return chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["x"], leaves["beta"],
                     A_log=t["A_log"], dt_bias=t["dt_bias"], use_gate_in_kernel=True,
                     safe_gate=lower_bound() is not None, lower_bound=lower_bound())[0]

  def fwd_bwd():
    for p in leaves.values():
      p.grad = None
    fwd().backward(t["do"])

  return fwd, fwd_bwd


def time_torch(fn, iters):
  """time_jax's clocks for a torch call, and triton's do_bench (CUDA events around each call,
  L2 flushed between calls: fla's own benchmarks' clock) as "_do_bench"."""
  import torch
  import triton
  wait = lambda _: torch.cuda.synchronize()
  return {"": timing.host_pipelined_ms(fn, wait, iters), "_blocked":
          timing.host_median_ms(fn, wait, iters),
          "_do_bench": triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")}


def _ms_fields(fwd, fwd_bwd):
  """{"fwd_ms": pipelined, "fwd_ms_blocked": ..., "fwd_bwd_ms": ..., ...} from time_jax's or
  time_torch's clocks."""
  return {f"{mode}_ms{clock}": ms for mode, by_clock in (("fwd", fwd), ("fwd_bwd", fwd_bwd))
          for clock, ms in by_clock.items()}


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def add_ratios_to_fla(rows: dict) -> dict:
  """fla's time over each row's, per pass and clock: fwd_x_fla, fwd_bwd_x_fla (pipelined,
  the targets' clock) and fwd_x_fla_blocked, fwd_bwd_x_fla_blocked; > 1 is faster than fla.
  Rows without fla's times (or their own) get none."""
  fla = rows.get("fla", {})
  for r in rows.values():
    for key in [k for k in r if k in ("fwd_ms", "fwd_bwd_ms", "fwd_ms_blocked",
                                      "fwd_bwd_ms_blocked") and k in fla]:
      r[key.replace("_ms", "_x_fla")] = fla[key] / r[key]
  return rows


def bench_shape(B, T, H, impls, iters, log, on_row=lambda rows: None, dim=_DIM):
  inp = inputs(B, T, H, dim=dim)
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)
  args = [bf(inp["q"]), bf(inp["k"]), bf(inp["v"]), bf(inp["x"]), bf(inp["beta"]),
          jnp.asarray(inp["A_log"]), jnp.asarray(inp["dt_bias"])]
  do = bf(inp["do"])
  label = f"{B}x{T}x{H}" + (f"x{dim}" if dim != _DIM else "")
  rows, outs = {}, {}
  first = None   # (row, its output and gradients): every later row is checked against it
  variants = [(impl, "") for impl in impls] + [
      (f"{impl}[{settings}]", k) for k in _KNOBS.value
      for impl, _, settings in [knob_impl(k)]]
  for impl, knobs in variants:
    undo = set_knobs(knobs)
    start = time.perf_counter()
    try:
      fwd, fwd_bwd = jax_fns(impl.split("[")[0])
      ms_f, o = time_jax(fwd, args, iters)
      ms_fb, (_, grads) = time_jax(fwd_bwd, args + [do], iters)
      rows[impl] = _ms_fields(ms_f, ms_fb)
      outs[impl] = np.asarray(o.astype(jnp.float32))
      got = [outs[impl], *(np.asarray(g.astype(jnp.float32)) for g in grads[:5])]
      if first is None:
        first = impl, got
      else:   # the largest relative error over o, dq, dk, dv, dx, dβ
        rows[impl][f"max_rel_err_vs_{first[0]}"] = max(map(rel, got, first[1]))
    except Exception as e:  # one failing variant must not hide the others' numbers
      rows[impl] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
      log.write(traceback.format_exc())
    finally:
      undo()
    rows[impl]["row_s"] = time.perf_counter() - start   # compiles included: plans device calls
    # Each row as soon as it exists: fla's autotuning (minutes) may outlive a time limit.
    print(label, impl, json.dumps(rows[impl]), flush=True)
    on_row(rows)
  if _FLA.value:
    start = time.perf_counter()
    try:
      f, fb = fla_fns(inp)
      o = f().detach().float().cpu().numpy()
      first_fwd_s = time.perf_counter() - start    # fla's compiles (and any autotuning)
      rows["fla"] = _ms_fields(time_torch(f, iters), time_torch(fb, iters))
      rows["fla"]["first_fwd_s"] = first_fwd_s
      outs["fla"] = o
    except Exception as e:
      rows["fla"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
      log.write(traceback.format_exc())
    rows["fla"]["row_s"] = time.perf_counter() - start
    print(label, "fla", json.dumps(rows["fla"]), flush=True)
  ref = outs.get("fla")
  for impl, o in outs.items():
    if ref is not None and impl != "fla":
      rows[impl]["rel_err_vs_fla"] = rel(o, ref)
  fl = floors(B, T, H, dim=dim)
  for r in rows.values():
    if "fwd_ms" in r:
      for mode in ("fwd", "fwd_bwd"):
        flops, nbytes = fl[mode]
        ms = r[f"{mode}_ms"]
        r[f"{mode}_tok_s"] = B * T / (ms / 1e3)
        r[f"{mode}_flop_floor_pct"] = 100 * flops / _PEAK_FLOPS / (ms / 1e3)
        r[f"{mode}_byte_floor_pct"] = 100 * nbytes / _PEAK_BYTES / (ms / 1e3)
  return add_ratios_to_fla(rows)


def run_shapes(shapes, impls, out_dir):
  """Every shape in this process; results are saved after every row."""
  results = {"device": str(jax.devices()[0].device_kind), "date": time.strftime("%Y-%m-%d"),
             "gate": _GATE.value, "shapes": {}}

  def save(shape, rows):
    results["shapes"][shape] = rows
    with open(os.path.join(out_dir, "bench_kda.json"), "w") as f:
      json.dump(results, f, indent=1)

  with open(os.path.join(out_dir, "bench_kda.log"), "w") as log:
    for shape in shapes:
      B, T, H, D = parse_shape(shape)
      rows = bench_shape(B, T, H, impls, _ITERS.value, log,
                         on_row=functools.partial(save, shape), dim=D)
      save(shape, rows)
      print(shape, json.dumps(rows), flush=True)
  return results


def run_parallel(shapes, out_dir):
  """Each shape in a child process of this script, --jobs at a time, slot i on GPU i."""
  flags_kept = [f"--impls={_IMPLS.value}", f"--iters={_ITERS.value}", f"--fla={_FLA.value}",
                f"--gate={_GATE.value}"] + [
      f"--knobs={k}" for k in _KNOBS.value]
  pending, running = list(shapes), {}
  results = {"device": None, "date": time.strftime("%Y-%m-%d"), "gate": _GATE.value,
             "shapes": {}}
  while pending or running:
    for slot in range(_JOBS.value):
      if slot not in running and pending:
        shape = pending.pop(0)
        sub = os.path.join(out_dir, f"shape_{shape}")
        cmd = [sys.executable, "-m", "benchmarks.bench_kda", f"--shapes={shape}", "--jobs=1",
               f"--out={sub}"]
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(slot))
        running[slot] = (subprocess.Popen(cmd + flags_kept, env=env, cwd=_ROOT), shape, sub,
                         time.monotonic())
    time.sleep(1)
    for slot, (proc, shape, sub, t0) in list(running.items()):
      late = _SHAPE_TIMEOUT.value and time.monotonic() - t0 > _SHAPE_TIMEOUT.value
      if proc.poll() is None and not late:
        continue
      if proc.poll() is None:
        proc.kill()
        proc.wait()
      del running[slot]
      try:
        with open(os.path.join(sub, "bench_kda.json")) as f:
          child = json.load(f)
        results["device"] = results["device"] or child["device"]
        rows = child["shapes"].get(shape, {})
      except (OSError, ValueError):
        rows = {}
      if proc.returncode != 0:
        rows["process"] = {"error": f"ended with {proc.returncode}"
                                    + (" (stopped at --shape_timeout)" if late else "")}
      results["shapes"][shape] = rows
  results["shapes"] = {s: results["shapes"][s] for s in shapes}
  with open(os.path.join(out_dir, "bench_kda.json"), "w") as f:
    json.dump(results, f, indent=1)
  return results


def table(results):
  lines = [f"KDA bf16 K=V=128, {results.get('gate', 'bounded')} gate, {results['device']}, "
           f"{results['date']}; median ms, pipelined "
           "(blocked) clock of benchmarks/timing.py for every row; fla's do_bench in its row",
           "| BxTxH | impl | fwd ms | fwd+bwd ms | fwd ×fla | fwd+bwd ×fla | fwd tok/s | "
           "%FLOP/%byte floor fwd | %FLOP/%byte floor fwd+bwd | rel err vs fla |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for shape, rows in results["shapes"].items():
    fla = rows.get("fla", {})
    for impl, r in rows.items():
      if "error" in r:
        lines.append(f"| {shape} | {impl} | error: {r['error'][:80]} |")
        continue
      ratio = lambda m: (f"{fla[m] / r[m]:.2f} ({fla[m + '_blocked'] / r[m + '_blocked']:.2f})"
                         if m in fla and m + "_blocked" in r else "-")
      ms = lambda m: (f"{r[m]:.3f} ({r[m + '_blocked']:.3f}"
                      + (f"; do_bench {r[m + '_do_bench']:.3f}" if m + "_do_bench" in r else "")
                      + ")") if m + "_blocked" in r else f"{r[m]:.3f}"
      lines.append(
          f"| {shape} | {impl} | {ms('fwd_ms')} | {ms('fwd_bwd_ms')} | {ratio('fwd_ms')} | "
          f"{ratio('fwd_bwd_ms')} | {r['fwd_tok_s']:.3g} | {r['fwd_flop_floor_pct']:.1f}/"
          f"{r['fwd_byte_floor_pct']:.1f} | {r['fwd_bwd_flop_floor_pct']:.1f}/"
          f"{r['fwd_bwd_byte_floor_pct']:.1f} | {r.get('rel_err_vs_fla', float('nan')):.2e} |")
  return "\n".join(lines)


def main(argv):
  del argv
  out_dir = _OUT.value or "."
  os.makedirs(out_dir, exist_ok=True)
  shapes = [s for s in _SHAPES.value.split(",") if s]
  impls = [s for s in _IMPLS.value.split(",") if s]
  results = (run_parallel(shapes, out_dir) if _JOBS.value > 1 else
             run_shapes(shapes, impls, out_dir))
  text = table(results)
  with open(os.path.join(out_dir, "bench_kda.md"), "w") as f:
    f.write(text + "\n")
  print(text)


if __name__ == "__main__":
  app.run(main)
