"""Times the real train step (the one scripts/train.py runs) and writes benchmarks/train.md
and benchmarks/train.json.

  python -m benchmarks.bench_train --rows=1b_dropless,1b_capacity,h200_dropless --out=$OUT
  python -m benchmarks.bench_train --rows=tiny_cpu --out=benchmarks       # CPU, CI scale

Per row, two fresh processes share a new compilation cache: the cold one (empty cache)
measures launch → first step (imports, data, init, trace+lower, compile, the step), then
the steady step (median of --steps after warm-up, each step waited for; tokens/s, MFU),
the pipelined step (windows of --steps dispatched back to back, as train.py runs them
without the loss guard: median window / steps), peak device memory and a per-phase
profile with the GPU's idle time between kernels; the warm one (the cache filled by the
cold one) measures launch → first step again, as a restarted or resumed job sees it.

MFU = model FLOPs per step / step time / PEAK_FLOPS, with model FLOPs per step
  6 · N_active · tokens                          (every matmul with an active, non-embedding
                                                  parameter: fwd 2, bwd 4 FLOPs per weight)
  + 3 · n_mla · tokens · T · H · (d_qk + d_v)    (causal attention, fwd T/2 keys · 2 matmuls
                                                  · 2 FLOPs, ×3 with the backward)
  + 3 · n_kda · tokens · H · (C · (K + V) + 4 · K · V)   (KDA intra-chunk (causal half of
                                                  C keys) and state read/update, ×3)
Recomputation (remat) is not counted: it is cost, not model work.
"""

import time

_LAUNCH = time.time()

import gzip  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

from absl import app, flags  # noqa: E402

from benchmarks.xprof_tables import (device_gaps, hlo_ops, op_of, tool_rows,  # noqa: E402
                                     trace_events)

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repo
_ROWS = flags.DEFINE_list("rows", ["tiny_cpu"], "Rows to measure (ROWS).")
_OUT = flags.DEFINE_string("out", "benchmarks", "Where train.md and train.json go (and logs).")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steady steps (after 3 warm-up steps).")
_WARM = flags.DEFINE_list("warm", ["all"], "Rows that also get a warm-cache process ('all').")
_CHILD = flags.DEFINE_string("child", "", "Internal: measure this row in this process.")
_MODE = flags.DEFINE_enum("mode", "cold", ["cold", "warm"], "Internal: cold or warm run.")
_CACHE = flags.DEFINE_string("cache_dir", "", "Internal: the compilation cache of the row.")
_RESULT = flags.DEFINE_string("result", "", "Internal: the child's JSON output.")
_LOGS = flags.DEFINE_string("logs", "", "Where each process's log goes (default <out>/logs).")
_XLA_FLAGS = flags.DEFINE_string("xla_flags", "", "Extra XLA_FLAGS for every row's processes "
                                 "(e.g. --xla_gpu_autotune_level=4, XLA's default: these win "
                                 "over the config's train.xla_flags); the row records the "
                                 "XLA_FLAGS it ran with.")
_START_ONLY = flags.DEFINE_bool("start_only", False, "Cold processes too stop after the first "
                                "step: an A/B of start-up alone (no steady steps, no profile).")
_SET = flags.DEFINE_multi_string("set", [], "Extra config override key=value for every row "
                                 "(e.g. model.remat=True), applied last.")

PEAK_FLOPS = 762e12   # bf16 dense matmul measured on the H200 (../shared/device/README.md)
PHASES = ("optimizer", "moe_experts", "moe_dispatch", "router", "shared_experts", "dense_ffn",
          "kda", "mla", "loss")

_1B = {"data.seq_len": 8192, "data.batch_size": 4}
PIPELINED_WINDOWS = 3   # windows of --steps steps dispatched back to back (median reported)
# name: (config file[:arg], overrides, platform it is meant for[, devices (default 1)]).
# Multi-device rows keep 4 rows of 8K per device; their "× 1 device" column divides their
# tokens/s by the 1-device row of the same config in the same run.
ROWS = {
    "1b_dropless": ("configs/long_context_1b.py", _1B, "gpu"),
    "1b_capacity": ("configs/long_context_1b.py",
                    {**_1B, "model.moe.dispatch": "capacity"}, "gpu"),
    "1b_dropless_full_remat": ("configs/long_context_1b.py",
                               {**_1B, "model.remat_policy": "full"}, "gpu"),
    "1b_dropless_unscanned": ("configs/long_context_1b.py",
                              {**_1B, "model.scan_layers": False}, "gpu"),
    # KDA's fallback where jax_triton is not installed (the default is triton)
    "1b_dropless_kda_pallas_gpu": ("configs/long_context_1b.py",
                                   {**_1B, "model.kda_implementation": "pallas_gpu"}, "gpu"),
    "1b_dropless_dp2": ("configs/long_context_1b.py",
                        {**_1B, "data.batch_size": 8, "mesh.data": 2}, "gpu", 2),
    "1b_dropless_ep2": ("configs/long_context_1b.py",
                        {**_1B, "data.batch_size": 8, "mesh.data": 1, "mesh.expert": 2},
                        "gpu", 2),
    "h200_dropless": ("configs/single_h200.py", {}, "gpu"),
    "tiny_cpu": ("configs/tiny.py", {}, "cpu"),
    "tiny_cpu_dp2": ("configs/tiny.py", {"data.batch_size": 32, "mesh.data": 2}, "cpu", 2),
}
BASELINE = {"1b_dropless_dp2": "1b_dropless", "1b_dropless_ep2": "1b_dropless",
            "tiny_cpu_dp2": "tiny_cpu"}


def row_devices(name: str) -> int:
  return ROWS[name][3] if len(ROWS[name]) > 3 else 1


def _parse(value: str):
  """A --set value as the int, float, bool or string it spells."""
  for conv in (int, float):
    try:
      return conv(value)
    except ValueError:
      pass
  return {"True": True, "False": False}.get(value, value)


def row_config(name: str, extra=()):
  import importlib.util
  path, overrides = ROWS[name][:2]
  path, _, arg = path.partition(":")
  spec = importlib.util.spec_from_file_location("row_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config(arg or None)
  c.checkpoint.async_save = False
  c.update_from_flattened_dict(overrides)
  c.update_from_flattened_dict({k: _parse(v) for k, v in (kv.split("=", 1) for kv in extra)})
  return c


def model_flops_per_step(c) -> dict:
  """The MFU numerator (module docstring), by term."""
  from moe_jax import params
  from moe_jax.model.kda import kda_heads
  from moe_jax.model.transformer import mixer_kind
  m = c.model
  counts = params.count(c)
  n_active = counts["active_sum"] - counts["active"]["embedding"]
  tokens = c.data.batch_size * c.data.seq_len
  T, H = c.data.seq_len, m.n_heads
  kinds = [mixer_kind(m, i) for i in range(m.n_layers)]
  dense = 6 * n_active * tokens
  Dq = m.mla_qk_head_dim + m.get("mla_qk_rope_dim", 0)
  mla = 3 * kinds.count("A") * tokens * T * H * (Dq + m.mla_v_head_dim)
  K, Hk = m.kda_head_dim, kda_heads(m)
  kda = 3 * kinds.count("K") * tokens * Hk * (m.kda_chunk_size * 2 * K + 4 * K * K)
  return {"matmul": dense, "mla_attention": mla, "kda": kda, "total": dense + mla + kda,
          "active_non_embedding_params": n_active, "total_params": counts["total_sum"]}


# GPU kernels by name, for the kernels whose op name the profile does not carry (seen on
# the H200: every kernel reported under "XlaModule").
KERNEL_PHASES = (("kda_", "kda"), ("mha_", "mla"), ("ring_step", "mla"),
                 ("ragged_dot", "moe_experts"), ("grouped_dw", "moe_experts"),
                 ("grouped_mgpu", "moe_experts"), ("nvjet", "cublas_matmuls"),
                 ("gemm", "cublas_matmuls"), ("cutlass", "cublas_matmuls"),
                 ("fusion", "xla_fusions"), ("memcpy", "copies"), ("convert", "xla_fusions"))


def phase_of(op_name: str, kernel_name: str = "") -> str:
  """The phase of a kernel: the named scope in its op name (model/transformer.py, moe.py,
  train/step.py), else what its kernel name says."""
  parts = op_name.replace("(", "/").replace(")", "/").split("/")
  for p in PHASES:
    if p in parts:
      return p
  if "moe" in parts:
    return "moe_other"
  for key, phase in KERNEL_PHASES:
    if key in kernel_name:
      return phase
  return "other"


def phase_profile(trace_dir: str, steps: int, ops: dict[str, str]) -> dict | None:
  """Device time per phase and the top kernels (ms per step), from xprof's kernel_stats:
  every GPU kernel with the framework op (named scopes) it ran for, or, where the profile
  has none, the op of its HLO instruction (hlo_ops). None without xprof."""
  try:
    import glob
    import xprof  # noqa: F401  (installed: the profile can be read)
    del xprof
  except ImportError:
    return None
  paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
  rows = tool_rows(paths, "kernel_stats")
  phases, kernels = {}, []
  for r in rows:
    op = str(r.get("op_name") or r.get("tf_op_name") or "")
    kernel = str(r.get("kernel_name") or "")
    if phase_of(op) == "other":   # no named scope in the profile's op: ask the HLO
      op = op_of(kernel, ops) or op
    ms = float(r.get("total_duration_us") or 0.0) / 1e3 / steps
    phase = phase_of(op, kernel)
    phases[phase] = phases.get(phase, 0.0) + ms
    kernels.append((ms, kernel[:80], op[-160:], r.get("occurrences")))
  kernels.sort(reverse=True)
  out = {"phase_ms": dict(sorted(phases.items(), key=lambda kv: -kv[1])),
         "kernel_ms_per_step": sum(phases.values()),
         "top_kernels": [{"ms": k[0], "kernel": k[1], "op": k[2], "n": k[3]}
                         for k in kernels[:40]]}
  try:   # the device's idle time between kernels, and the kernels around the longest waits
    out.update(device_gaps(trace_events(paths), steps))
  except Exception as e:  # noqa: BLE001 — best effort, as the rest of the profile
    out["gaps_error"] = f"{type(e).__name__}: {e}"
  return out


def measure(name: str, mode: str, cache_dir: str, steps: int, extra) -> dict:
  """One row in this process; the times count from this script's launch."""
  import jax
  from moe_jax import config as config_lib
  from moe_jax.data import pipeline
  from moe_jax.model.transformer import HybridMoE
  from moe_jax.parallel.mesh import make_mesh
  from moe_jax.train import checkpoint, compile_cache, loop, optim, state as state_lib, xla_flags

  rec = {"row": name, "mode": mode, "imports_s": time.time() - _LAUNCH}
  c = config_lib.validate(row_config(name, extra))
  # As train.py: the config's flags (train.xla_flags) after --xla_flags, before jax starts.
  rec["xla_flags"] = xla_flags.apply(c.train.xla_flags)
  compile_cache.enable(cache_dir)
  mesh = make_mesh(c.mesh)
  with jax.set_mesh(mesh):
    t = time.time()
    sources = pipeline.sources(c)
    t_sources = time.time() - t
    train_iter = iter(pipeline.train_dataset(sources["train"], c))
    batch_sh = state_lib.batch_sharding(mesh)
    batch = state_lib.global_batch(next(train_iter), batch_sh)
    rec["data_s"] = time.time() - t
    print(f"{name} {mode}: data_s {rec['data_s']:.1f} (sources {t_sources:.2f} s)", flush=True)
    model = HybridMoE(state_lib.frozen_model_config(c))
    manager = checkpoint.make_manager(os.path.join(tempfile.mkdtemp(), "checkpoints"), c)
    # loop.start, as train.py runs it: init (or restore) beside the step's trace and compile.
    state, _, _, _, step, timings = loop.start(c, mesh, model, optim.make_optimizer(c), batch,
                                                manager, train_iter)
    rec.update({"init_s": timings["init_or_restore"], "trace_lower_s": timings["lower"],
                "compile_s": timings["compile"], "init_and_compile_wall_s": timings["wall"],
                "train_step": timings["executable"],
                # train.split_step: the update half's, beside the gradient half's compile
                **{f"{k}_s": timings[k] for k in ("update_lower", "update_compile")
                   if k in timings}})
    print(f"{name} {mode}: {timings}", flush=True)
    t = time.time()
    state, m = step(state, batch)
    jax.block_until_ready(m["loss"])
    rec["first_step_run_s"] = time.time() - t
    print(f"{name} {mode}: first_step_run_s {rec['first_step_run_s']:.1f}", flush=True)
    rec["launch_to_first_step_s"] = time.time() - _LAUNCH
    rec["first_loss"] = float(m["loss"])
    if mode == "warm" or _START_ONLY.value:
      return rec

    tokens = c.data.batch_size * c.data.seq_len
    times = []
    for i in range(3 + steps):
      batch = state_lib.global_batch(next(train_iter), batch_sh)
      t = time.perf_counter()
      state, m = step(state, batch)
      jax.block_until_ready(m["loss"])
      if i >= 3:
        times.append(time.perf_counter() - t)
    rec["step_ms"] = statistics.median(times) * 1e3
    rec["step_ms_min_max"] = [min(times) * 1e3, max(times) * 1e3]
    rec["tokens_per_s"] = tokens / statistics.median(times)
    rec["loss_after"] = float(m["loss"])   # after 3 + steps steps
    # As train.py runs without the loss guard: each batch read and the step dispatched while
    # the device still runs the last one, the host waiting only at a logging step. The
    # blocked steps above also pay, each step, the dispatch and the device's idle start.
    windows = []
    for _ in range(PIPELINED_WINDOWS):
      t = time.perf_counter()
      for _ in range(steps):
        state, m = step(state, state_lib.global_batch(next(train_iter), batch_sh))
      jax.block_until_ready(m["loss"])
      windows.append((time.perf_counter() - t) / steps)
    rec["step_ms_pipelined"] = statistics.median(windows) * 1e3
    rec["step_ms_pipelined_windows"] = [w * 1e3 for w in windows]
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
    rec["peak_memory_gib"] = None if None in peaks else max(peaks) / 2**30   # per device
    rec["devices"] = jax.device_count()
    rec["tokens_per_step"] = tokens
    rec["platform"] = jax.default_backend()
    rec["device"] = jax.local_devices()[0].device_kind
    trace_dir = os.path.join(cache_dir or tempfile.mkdtemp(), "trace")
    n_prof = 3
    jax.profiler.start_trace(trace_dir)
    for _ in range(n_prof):
      state, m = step(state, state_lib.global_batch(next(train_iter), batch_sh))
    jax.block_until_ready(m["loss"])
    jax.profiler.stop_trace()
    texts = step.hlo_texts() if hasattr(step, "hlo_texts") else [step.as_text()]
    if _LOGS.value:
      with gzip.open(os.path.join(_LOGS.value, f"{name}.hlo.txt.gz"), "wt") as f:
        f.write("\n".join(texts))
    # train.split_step's two programs reuse fusion names (loop_add_fusion, ...), and the
    # profile names a kernel, not its program: the gradient half's op wins such a name.
    ops = {}
    for text in reversed(texts):
      ops.update(hlo_ops(text))
    try:
      rec.update(phase_profile(trace_dir, n_prof, ops) or {})
    except Exception as e:  # the profile is best effort; the timings above stand
      rec["phase_error"] = f"{type(e).__name__}: {e}"
  # Outside the mesh (params.count traces one row) and after the timed start-up.
  rec["flops"] = flops = model_flops_per_step(c)
  if rec["platform"] == "gpu":
    rec["mfu"] = flops["total"] / (rec["step_ms"] / 1e3) / PEAK_FLOPS / rec["devices"]
    rec["mfu_pipelined"] = (flops["total"] / (rec["step_ms_pipelined"] / 1e3) / PEAK_FLOPS
                            / rec["devices"])
  return rec


def run_row(name: str, steps: int, extra) -> list[dict]:
  """The cold and the warm process of one row, on a fresh cache."""
  cache = tempfile.mkdtemp(prefix=f"xla_cache_{name}_")
  logs = _LOGS.value or os.path.join(_OUT.value, "logs")
  os.makedirs(logs, exist_ok=True)
  recs = []
  modes = ("cold", "warm") if name in _WARM.value or "all" in _WARM.value else ("cold",)
  for mode in modes:
    result = os.path.join(cache, f"{mode}.json")
    cmd = [sys.executable, "-m", "benchmarks.bench_train", f"--child={name}", f"--mode={mode}",
           f"--cache_dir={cache}", f"--result={result}", f"--steps={steps}", f"--out={_OUT.value}",
           f"--logs={logs}", f"--xla_flags={_XLA_FLAGS.value}",
           f"--start_only={_START_ONLY.value}",
           *[f"--set={kv}" for kv in extra]]
    t = time.time()
    n = row_devices(name)   # the row's devices: the first n GPUs, or n CPU devices
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={n} "
                                      f"{_XLA_FLAGS.value}"}
    if ROWS[name][2] == "gpu":
      env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(n))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=_ROOT)
    log = os.path.join(logs, f"{name}_{mode}.log")
    with open(log, "w") as f:
      f.write(proc.stdout + proc.stderr)
    if proc.returncode:
      recs.append({"row": name, "mode": mode, "error": proc.stderr[-2000:]})
      print(f"{name} {mode}: failed (rc {proc.returncode}), see {log}", flush=True)
      break
    with open(result) as f:
      rec = json.load(f)
    rec["process_wall_s"] = time.time() - t
    recs.append(rec)
    print(f"{name} {mode}: first step {rec['launch_to_first_step_s']:.1f} s after launch",
          flush=True)
  return recs


def _scaling(by_row: dict, row: str) -> str:
  """tokens/s of a multi-device row over its 1-device baseline measured in the same run."""
  cold = by_row[row]["cold"]
  base = by_row.get(BASELINE.get(row, ""), {}).get("cold", {})
  if "tokens_per_s" not in base:
    return "—"
  return f"{cold['tokens_per_s'] / base['tokens_per_s']:.2f}× on {cold['devices']}"


def markdown(records: list[dict], extra) -> str:
  date = time.strftime("%Y-%m-%d")
  lines = [f"## {date}: `benchmarks/bench_train.py` " + (f"(--set {' '.join(extra)})" if extra
                                                        else ""), ""]
  head = ("| row | device | tokens/step | cold: init ‖ (lower + compile) = wall; launch→1st step "
          "s | warm: same | step ms (blocked; pipelined) | tokens/s | × 1 device | MFU "
          "(blocked; pipelined) | peak GiB / device |")
  lines += [head, "|---|---|---|---|---|---|---|---|---|---|"]
  by_row = {}
  for r in records:
    by_row.setdefault(r["row"], {})[r["mode"]] = r
  for row, rs in by_row.items():
    cold, warm = rs.get("cold", {}), rs.get("warm", {})
    start = lambda r: (f"{r['init_s']:.1f} ‖ ({r['trace_lower_s']:.1f} + {r['compile_s']:.1f}) "
                       f"= {r['init_and_compile_wall_s']:.1f}; **{r['launch_to_first_step_s']:.1f}**"
                       if "launch_to_first_step_s" in r else "—")
    if "error" in cold or not cold:
      lines.append(f"| {row} | failed: {cold.get('error', '')[-200:]!r} |")
      continue
    if "step_ms" not in cold:   # --start_only
      lines.append(f"| {row} | | | {start(cold)} | {start(warm)} | | | | | |")
      continue
    mfu = (f"{100 * cold['mfu']:.1f}%; {100 * cold['mfu_pipelined']:.1f}%" if cold.get("mfu")
           else "—")
    peak = f"{cold['peak_memory_gib']:.1f}" if cold.get("peak_memory_gib") else "—"
    lines.append(
        f"| {row} | {cold['device']} | {cold['tokens_per_step']} | {start(cold)} | "
        f"{start(warm)} | {cold['step_ms']:.1f}; {cold['step_ms_pipelined']:.1f} | "
        f"{cold['tokens_per_s']:,.0f} | "
        f"{_scaling(by_row, row)} | {mfu} | {peak} |")
  phases = sorted({p for rs in by_row.values() for p in (rs.get("cold", {}).get("phase_ms") or {})})
  if not phases:
    return "\n".join(lines) + "\n"
  lines += ["", "Per-phase device time (ms per step: GPU kernel time by the named scope of the "
            "op it ran for; `kernels` is their sum, against the step time):", ""]
  lines += ["| row | kernels | " + " | ".join(phases) + " |",
            "|---|---|" + "---|" * len(phases)]
  for row, rs in by_row.items():
    ph = rs.get("cold", {}).get("phase_ms") or {}
    if ph:
      lines.append(f"| {row} | {rs['cold']['kernel_ms_per_step']:.1f} | "
                   + " | ".join(f"{ph.get(p, 0):.1f}" for p in phases) + " |")
  for row, rs in by_row.items():
    cold = rs.get("cold", {})
    if "device_idle_ms_per_step" in cold:
      lines += ["", f"{row}: the GPU busy {cold['device_busy_ms_per_step']:.1f} and idle "
                f"{cold['device_idle_ms_per_step']:.1f} ms a step in the profiled steps; the "
                "longest waits (ms a step, between these kernels):", "",
                "| ms | n | before | after |", "|---|---|---|---|"]
      lines += [f"| {g['ms_per_step']:.2f} | {g['n']} | {g['before']} | {g['after']} |"
                for g in cold["top_gaps"][:8]]
  return "\n".join(lines) + "\n"


def main(argv):
  del argv
  if _CHILD.value:
    rec = measure(_CHILD.value, _MODE.value, _CACHE.value, _STEPS.value, _SET.value)
    with open(_RESULT.value, "w") as f:
      json.dump(rec, f, indent=1)
    return
  os.makedirs(_OUT.value, exist_ok=True)
  for name in _ROWS.value:
    if name not in ROWS:
      raise app.UsageError(f"--rows: unknown row {name!r}; known: {sorted(ROWS)}")
  records = []
  for name in _ROWS.value:
    records += run_row(name, _STEPS.value, _SET.value)
  json_path = os.path.join(_OUT.value, "train.json")
  old = json.load(open(json_path)) if os.path.exists(json_path) else []
  keep = [r for r in old if r["row"] not in _ROWS.value]
  with open(json_path, "w") as f:
    json.dump(keep + records, f, indent=1)
  md = markdown(records, _SET.value)
  with open(os.path.join(_OUT.value, "train.md"), "a") as f:
    f.write("\n" + md)
  print(md)


if __name__ == "__main__":
  app.run(main)
