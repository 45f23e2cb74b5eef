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

MFU = model FLOPs per step / step time / 989 TFLOP/s per device: the H100/H200 dense bf16
spec peak, the denominator the field reports against (`mfu`, `peak_tflops` 989). The same
ratio against 762 TFLOP/s, the bf16 matmul rate measured through JAX on the H200
(../shared/device/README.md), is `mfu_measured_peak`. Model FLOPs per step:
  6 · N_active · tokens                          (every matmul with an active, non-embedding
                                                  parameter: fwd 2, bwd 4 FLOPs per weight)
  + 6 · n_mla · pairs · H · (d_qk + d_v)         (attention: QKᵀ and PV, 2 FLOPs a
                                                  multiply-add, ×3 with the backward, over the
                                                  (query, key) pairs the kernel computes:
                                                  causal and within one packed document,
                                                  L·(L+1)/2 a document; the timed batches' mean)
  + 3 · n_kda · tokens · H · (C · (K + V) + 4 · K · V)   (KDA intra-chunk (causal half of
                                                  C keys) and state read/update, ×3)
Recomputation (remat) is not counted: it is cost, not model work.

--baseline_dir=DIR times each row a second time on the code in DIR (its moe_jax,
pallas_kernels and configs: the previous default) in the same run, as row
`<row>_baseline`: its loss after the timed steps sits beside the row's, the same data and
seeds. `.baseline/` is ignored by git, for a checkout to carry to another machine:
  mkdir -p .baseline && git archive <rev> moe_jax pallas_kernels configs | tar -x -C .baseline

--label=NAME records the rows as `<row>_NAME` (and `<row>_NAME_baseline`), each with
`base_row`: the variants of one row then sit side by side in one train.json
(benchmarks/train_variants.sh runs a list of them).
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

import numpy as np  # noqa: E402

from benchmarks import provenance, train_floors  # noqa: E402
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
_BASELINE_DIR = flags.DEFINE_string("baseline_dir", "", "A checkout of the baseline code: "
                                    "each row also runs there, as <row>_baseline.")
_RESTATE = flags.DEFINE_bool("restate", False, "Re-derive the MFU of every GPU row in "
                             "<out>/train.json from its recorded step times (restate()).")
_CODE = flags.DEFINE_string("code_dir", "", "Internal: import moe_jax and configs from here.")
_SET = flags.DEFINE_multi_string("set", [], "Extra config override key=value for every row "
                                 "(e.g. model.remat=True), applied last.")
_LABEL = flags.DEFINE_string("label", "", "Record each row as <row>_<label> (a variant's name; "
                             "letters, digits and _).")

PEAK_FLOPS = 989e12   # H100/H200 dense bf16 spec peak (the field's MFU denominator)
MEASURED_PEAK_FLOPS = 762e12   # bf16 dense matmul measured through JAX on the H200
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
    # Kimi-Linear-48B's layer shapes, its first 4 layers (configs/kimi_linear_48b.py)
    "h200_slice": ("configs/kimi_linear_48b.py:h200_slice", {}, "gpu"),
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


def row_config(name: str, extra=(), code_dir: str = ""):
  """The row's config, read from code_dir's configs/ (default: this checkout's)."""
  import importlib.util
  path, overrides = ROWS[name][:2]
  path, _, arg = path.partition(":")
  spec = importlib.util.spec_from_file_location("row_config",
                                                os.path.join(code_dir or _ROOT, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config(arg or None)
  c.checkpoint.async_save = False
  c.update_from_flattened_dict(overrides)
  c.update_from_flattened_dict({k: _parse(v) for k, v in (kv.split("=", 1) for kv in extra)})
  return c


def attention_pairs(segment_ids_BxL) -> int:
  """(query, key) pairs a causal, document-masked attention kernel computes: L·(L+1)/2 for
  each document (a run of one nonzero segment id in a row), none for padding (id 0)."""
  total = 0
  for row in np.asarray(segment_ids_BxL).reshape(-1, np.shape(segment_ids_BxL)[-1]):
    bounds = np.concatenate([[0], np.flatnonzero(np.diff(row)) + 1, [row.size]])
    lengths = np.diff(bounds).astype(np.int64)
    total += int((lengths * (lengths + 1) // 2)[row[bounds[:-1]] > 0].sum())
  return total


def model_flops_per_step(c, pairs: float | None = None) -> dict:
  """The MFU numerator (module docstring), by term. pairs: the attention pairs a step
  computes (attention_pairs); None counts every row as one causal document."""
  from moe_jax import params
  from moe_jax.model.kda import kda_heads
  from moe_jax.model.transformer import mixer_kind
  m = c.model
  counts = params.count(c)
  n_active = counts["active_sum"] - counts["active"]["embedding"]
  tokens = c.data.batch_size * c.data.seq_len
  T, H = c.data.seq_len, m.n_heads
  full_row = c.data.batch_size * T * (T + 1) // 2
  pairs = full_row if pairs is None else pairs
  kinds = [mixer_kind(m, i) for i in range(m.n_layers)]
  dense = 6 * n_active * tokens
  Dq = m.mla_qk_head_dim + m.get("mla_qk_rope_dim", 0)
  mla = 6 * kinds.count("A") * pairs * H * (Dq + m.mla_v_head_dim)
  K, Hk = m.kda_head_dim, kda_heads(m)
  kda = 3 * kinds.count("K") * tokens * Hk * (m.kda_chunk_size * 2 * K + 4 * K * K)
  return {"matmul": dense, "mla_attention": mla, "kda": kda, "total": dense + mla + kda,
          "attention_pairs": pairs, "attention_pairs_full_row": full_row,
          "active_non_embedding_params": n_active, "total_params": counts["total_sum"]}


def mfu(flops_total: float, step_ms: float, devices: int, peak: float = PEAK_FLOPS) -> float:
  return flops_total / (step_ms / 1e3) / peak / devices


# GPU kernels by name, for the kernels whose op name the profile does not carry (seen on
# the H200: every kernel reported under "XlaModule").
KERNEL_PHASES = (("kda_", "kda"), ("mha_", "mla"), ("ring_step", "mla"),
                 ("short_conv", "kda"), ("ragged_dot", "moe_experts"),
                 ("grouped_dw", "moe_experts"), ("grouped_dot", "moe_experts"),
                 ("grouped_dx", "moe_experts"),
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
  if _CODE.value:   # the baseline's moe_jax, configs and pallas_kernels, not this checkout's
    sys.path.insert(0, _CODE.value)
  import jax
  from moe_jax import config as config_lib
  from moe_jax.data import pipeline
  from moe_jax.model.transformer import HybridMoE
  from moe_jax.parallel.mesh import make_mesh
  from moe_jax.train import checkpoint, compile_cache, loop, optim, state as state_lib, xla_flags

  rec = {"row": name, "mode": mode, "imports_s": time.time() - _LAUNCH}
  c = config_lib.validate(row_config(name, extra, _CODE.value))
  # As train.py: the config's flags (train.xla_flags) after --xla_flags, and its
  # train.memory_fraction, before jax starts.
  rec["xla_flags"] = (xla_flags.apply_config(c.train) if hasattr(xla_flags, "apply_config")
                      else xla_flags.apply(c.train.xla_flags))   # a baseline before it
  rec["memory_fraction"] = os.environ.get(xla_flags.MEM_FRACTION, "")
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
    times, pairs = [], []
    for i in range(3 + steps):
      host = next(train_iter)
      batch = state_lib.global_batch(host, batch_sh)
      t = time.perf_counter()
      state, m = step(state, batch)
      jax.block_until_ready(m["loss"])
      if i >= 3:
        times.append(time.perf_counter() - t)
        pairs.append(attention_pairs(host["segment_ids"]))
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
    rec["attention_pairs_per_step"] = statistics.mean(pairs)
    rec["dispatch"] = c.model.moe.dispatch if c.model.moe.num_experts else "dense"
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
  return rec   # FLOPs and MFU: add_mfu, in the parent, by this checkout's formula


def add_mfu(rec: dict, name: str, extra=()) -> dict:
  """A measured row with its model FLOPs (this checkout's formula and row config, also for
  a `_baseline` row: both rows are counted alike), each phase's floor and, on a GPU, MFU."""
  c = row_config(name, extra)
  rec["flops"] = flops = model_flops_per_step(c, rec["attention_pairs_per_step"])
  bw = train_floors.hbm_bytes_per_s(rec.get("device"))
  rec["phase_floor_ms"] = train_floors.phase_floors_ms(c, flops, PEAK_FLOPS, bw)
  rec["phase_floor_hbm_tb_per_s"] = bw / 1e12
  return _with_mfu(rec, flops) if rec["platform"] == "gpu" else rec


def _with_mfu(rec: dict, flops: dict) -> dict:
  """rec with peak_tflops and MFU (against 989, and the measured 762) of its step times."""
  rec["peak_tflops"] = PEAK_FLOPS / 1e12
  for key, ms in (("", "step_ms"), ("_pipelined", "step_ms_pipelined")):
    if rec.get(ms):
      rec[f"mfu{key}"] = mfu(flops["total"], rec[ms], rec.get("devices", 1))
      rec[f"mfu{key}_measured_peak"] = mfu(flops["total"], rec[ms], rec.get("devices", 1),
                                           MEASURED_PEAK_FLOPS)
  return rec


def timed_pairs(c, steps: int = 10) -> float:
  """The mean attention pairs of the batches measure() times: the 5th to (4 + steps)th
  batch of the row's data (the first step and 3 warm-up steps read the first 4)."""
  from moe_jax.data import pipeline
  it = iter(pipeline.train_dataset(pipeline.sources(c)["train"], c))
  batches = [next(it) for _ in range(4 + steps)][4:]
  return statistics.mean(attention_pairs(b["segment_ids"]) for b in batches)


def restate(rec: dict) -> dict:
  """A GPU row measured when MFU divided by 762 TFLOP/s and counted full-row causal
  attention, re-derived as measure() derives it now, from its recorded step times: against
  989, with the attention pairs of its config's timed batches. A row no longer in ROWS uses
  the data of the row whose name it extends (`1b_…` → 1b_dropless, `h200_…` →
  h200_dropless) and keeps its recorded matmul and KDA terms."""
  from moe_jax import config as config_lib
  name = rec.get("base_row") or rec["row"].removesuffix("_baseline")
  base = name if name in ROWS else ("1b_dropless" if name.startswith("1b_") else "h200_dropless")
  c = config_lib.validate(row_config(base))
  tokens = c.data.batch_size * c.data.seq_len
  if tokens != rec["tokens_per_step"]:
    raise ValueError(f"row {rec['row']!r}: tokens_per_step={rec['tokens_per_step']} is not "
                     f"{base}'s {tokens}; cannot restate")
  pairs = timed_pairs(c)
  if name in ROWS:
    flops = model_flops_per_step(row_config(name), pairs)
  else:
    old = rec["flops"]
    mla = old["mla_attention"] * pairs / (c.data.batch_size * c.data.seq_len ** 2 / 2)
    flops = {**old, "mla_attention": mla, "total": old["matmul"] + mla + old["kda"],
             "attention_pairs": pairs,
             "attention_pairs_full_row": c.data.batch_size * c.data.seq_len ** 2 // 2}
  return _with_mfu({**rec, "flops": flops, "restated": {
      "date": provenance.today(), "was": {k: rec.get(k) for k in ("mfu", "mfu_pipelined")},
      "how": "bench_train --restate: 989 TFLOP/s, document-masked attention pairs; step "
             "times as measured"}}, flops)


def run_row(name: str, steps: int, extra, code_dir: str = "") -> list[dict]:
  """The cold and the warm process of one row, on a fresh cache; with code_dir, on the
  code there, as row `<name>_baseline`."""
  label = "_".join(filter(None, (name, _LABEL.value, "baseline" if code_dir else "")))
  cache = tempfile.mkdtemp(prefix=f"xla_cache_{label}_")
  logs = _LOGS.value or os.path.join(_OUT.value, "logs")
  os.makedirs(logs, exist_ok=True)
  recs = []
  modes = ("cold", "warm") if name in _WARM.value or "all" in _WARM.value else ("cold",)
  for mode in modes:
    result = os.path.join(cache, f"{mode}.json")
    cmd = [sys.executable, "-m", "benchmarks.bench_train", f"--child={name}", f"--mode={mode}",
           f"--cache_dir={cache}", f"--result={result}", f"--steps={steps}", f"--out={_OUT.value}",
           f"--logs={logs}", f"--xla_flags={_XLA_FLAGS.value}",
           f"--start_only={_START_ONLY.value}", f"--code_dir={code_dir}",
           *[f"--set={kv}" for kv in extra]]
    t = time.time()
    n = row_devices(name)   # the row's devices: the first n GPUs, or n CPU devices
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={n} "
                                      f"{_XLA_FLAGS.value}"}
    if ROWS[name][2] == "gpu":
      env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(n))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=_ROOT)
    log = os.path.join(logs, f"{label}_{mode}.log")
    with open(log, "w") as f:
      f.write(proc.stdout + proc.stderr)
    stamp = {"row": label, "base_row": name, "date": provenance.today(),
             "commit": "baseline:" + os.path.basename(os.path.abspath(code_dir)) if code_dir
             else provenance.commit(), "set": list(extra), "extra_xla_flags": _XLA_FLAGS.value}
    if proc.returncode:
      recs.append({**stamp, "mode": mode, "error": proc.stderr[-2000:]})
      print(f"{label} {mode}: failed (rc {proc.returncode}), see {log}", flush=True)
      break
    with open(result) as f:
      rec = {**json.load(f), **stamp}
    rec["process_wall_s"] = time.time() - t
    recs.append(rec)
    print(f"{label} {mode}: first step {rec['launch_to_first_step_s']:.1f} s after launch",
          flush=True)
  return recs


def _scaling(by_row: dict, row: str) -> str:
  """tokens/s of a row over its `_baseline` row, or of a multi-device row over its 1-device
  row, measured in the same run."""
  cold = by_row[row]["cold"]
  if f"{row}_baseline" in by_row:
    base, what = by_row[f"{row}_baseline"].get("cold", {}), "baseline"
  else:
    base, what = by_row.get(BASELINE.get(row, ""), {}).get("cold", {}), f"on {cold['devices']}"
  if "tokens_per_s" not in base:
    return "—"
  return f"{cold['tokens_per_s'] / base['tokens_per_s']:.2f}× {what}"


def markdown(records: list[dict], extra) -> str:
  first = next((r for r in records if "commit" in r), {})
  lines = [f"## {provenance.today()}, commit {first.get('commit', 'unknown')}: "
           "`python -m benchmarks.bench_train` " + (f"(--set {' '.join(extra)})" if extra
                                                    else ""), "",
           "MFU against the 989 TFLOP/s dense bf16 spec peak (in brackets: against 762, the "
           "matmul rate measured on the H200); attention counts the causal pairs within "
           "each packed document.", ""]
  head = ("| row | device | dispatch | tokens/step | cold: init ‖ (lower + compile) = wall; "
          "launch→1st step s | warm: same | step ms (blocked; pipelined) | tokens/s | "
          "× baseline or 1 device | MFU (blocked; pipelined) [762] | loss after | "
          "peak GiB / device |")
  lines += [head, "|---|---|---|---|---|---|---|---|---|---|---|---|"]
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
      lines.append(f"| {row} | | | | {start(cold)} | {start(warm)} | | | | | | |")
      continue
    mfu = (f"{100 * cold['mfu']:.1f}%; {100 * cold['mfu_pipelined']:.1f}% "
           f"[{100 * cold['mfu_measured_peak']:.1f}%]" if cold.get("mfu") else "—")
    peak = f"{cold['peak_memory_gib']:.1f}" if cold.get("peak_memory_gib") else "—"
    lines.append(
        f"| {row} | {cold['device']} | {cold.get('dispatch', '')} | {cold['tokens_per_step']} | "
        f"{start(cold)} | {start(warm)} | {cold['step_ms']:.1f}; "
        f"{cold['step_ms_pipelined']:.1f} | {cold['tokens_per_s']:,.0f} | "
        f"{_scaling(by_row, row)} | {mfu} | {cold['loss_after']:.4f} | {peak} |")
  phases = sorted({p for rs in by_row.values() for p in (rs.get("cold", {}).get("phase_ms") or {})})
  if not phases:
    return "\n".join(lines) + "\n"
  lines += ["", "Per-phase device time (ms per step: GPU kernel time by the named scope of the "
            "op it ran for; `kernels` is their sum, against the step time). Under each row, "
            "each phase's floor (benchmarks/train_floors.py: its FLOPs at 989 TFLOP/s or its "
            "HBM traffic at the device's spec bandwidth, H100 3.35 TB/s, H200 4.8):", ""]
  lines += ["| row | kernels | " + " | ".join(phases) + " |",
            "|---|---|" + "---|" * len(phases)]
  for row, rs in by_row.items():
    ph = rs.get("cold", {}).get("phase_ms") or {}
    if ph:
      lines.append(f"| {row} | {rs['cold']['kernel_ms_per_step']:.1f} | "
                   + " | ".join(f"{ph.get(p, 0):.1f}" for p in phases) + " |")
      fl = rs["cold"].get("phase_floor_ms") or {}
      if fl:
        lines.append(f"| floor | {sum(fl.values()):.1f} | "
                     + " | ".join(f"{fl[p]:.1f}" if p in fl else "" for p in phases) + " |")
  for row, rs in by_row.items():
    cold = rs.get("cold", {})
    if "device_idle_ms_per_step" in cold:
      copies = (f", copies alone {cold['copy_only_ms_per_step']:.1f}"
                if "copy_only_ms_per_step" in cold else "")
      lines += ["", f"{row}: the GPU busy {cold['device_busy_ms_per_step']:.1f}{copies} and "
                f"idle {cold['device_idle_ms_per_step']:.1f} ms a step in the profiled steps; "
                "the longest waits (ms a step, between these kernels):", "",
                "| ms | n | before | after |", "|---|---|---|---|"]
      lines += [f"| {g['ms_per_step']:.2f} | {g['n']} | {g['before']} | {g['after']} |"
                for g in cold["top_gaps"][:8]]
  return "\n".join(lines) + "\n"


def merge_records(old: list[dict], new: list[dict]) -> list[dict]:
  """train.json's rows with `new` appended: earlier measurements of a row stay (its history,
  and its other mode: a cold-only re-run keeps the row's warm launch), except one of the same
  row, mode and commit, which a re-run of that code replaces."""
  same = {(r["row"], r["mode"], r.get("commit")) for r in new}
  return [r for r in old if (r["row"], r["mode"], r.get("commit")) not in same] + new


def main(argv):
  del argv
  if _CHILD.value:
    rec = measure(_CHILD.value, _MODE.value, _CACHE.value, _STEPS.value, _SET.value)
    with open(_RESULT.value, "w") as f:
      json.dump(rec, f, indent=1)
    return
  os.makedirs(_OUT.value, exist_ok=True)
  json_path = os.path.join(_OUT.value, "train.json")
  if _RESTATE.value:
    old = json.load(open(json_path))
    new = [restate(r) if r.get("platform") == "gpu" and r.get("step_ms") and "restated" not in r
           and r.get("peak_tflops") != PEAK_FLOPS / 1e12 else r for r in old]
    with open(json_path, "w") as f:
      json.dump(new, f, indent=1)
    for r in new:
      if "restated" in r:
        print(f"{r['row']}: mfu {r['restated']['was']['mfu']:.3f} (762, full rows) → "
              f"{r['mfu']:.3f} (989, packed); measured-peak {r['mfu_measured_peak']:.3f}")
    return
  for name in _ROWS.value:
    if name not in ROWS:
      raise app.UsageError(f"--rows: unknown row {name!r}; known: {sorted(ROWS)}")
  if _LABEL.value and not re.fullmatch(r"\w+", _LABEL.value):
    raise app.UsageError(f"--label: {_LABEL.value!r} is not a name (letters, digits and _)")
  if _BASELINE_DIR.value and not os.path.isdir(os.path.join(_BASELINE_DIR.value, "moe_jax")):
    raise app.UsageError(f"--baseline_dir={_BASELINE_DIR.value!r} has no moe_jax/: give a "
                         "checkout of the baseline code")
  records = []
  for name in _ROWS.value:
    records += run_row(name, _STEPS.value, _SET.value)
    if _BASELINE_DIR.value:
      records += run_row(name, _STEPS.value, _SET.value, _BASELINE_DIR.value)
  # Counting traces the model abstractly: on the CPU, after the rows' processes are done
  # (a GPU client here would have held device memory while they ran).
  import jax
  jax.config.update("jax_platforms", "cpu")
  records = [add_mfu(r, r["base_row"], _SET.value) if "step_ms" in r else r for r in records]
  old = json.load(open(json_path)) if os.path.exists(json_path) else []
  with open(json_path, "w") as f:
    json.dump(merge_records(old, records), f, indent=1)
  md = markdown(records, _SET.value)
  with open(os.path.join(_OUT.value, "train.md"), "a") as f:
    f.write("\n" + md)
  print(md)


if __name__ == "__main__":
  app.run(main)
