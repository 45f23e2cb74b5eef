"""The benchmark's kernel attribution: GPU profiles name every XLA fusion's op "XlaModule",
so benchmarks/bench_train.py reads each kernel's named scope from the compiled HLO; and
benchmarks/bench_kda.py's knob rows."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from benchmarks import bench_train, xprof_tables
from tests.conftest import ROOT, make_small_config, subprocess_env


def test_fusion_kernels_map_to_their_named_scope():
  def f(x):
    with jax.named_scope("kda"):
      y = jnp.exp(x) * 2.0 + 1.0
    with jax.named_scope("optimizer"):
      return jnp.sum(jnp.tanh(y) * x, axis=0)

  hlo = jax.jit(f).lower(jnp.ones((64, 32))).compile().as_text()
  ops = xprof_tables.hlo_ops(hlo)
  fusions = {k: v for k, v in ops.items() if "fusion" in k}
  assert fusions, list(ops)[:10]
  phases = {bench_train.phase_of(xprof_tables.op_of(k, ops)) for k in fusions}
  assert phases <= {"kda", "optimizer"} and phases, fusions
  # XLA's kernel names: the instruction name with '.' → '_', or with a trailing index.
  name = next(iter(fusions))
  assert xprof_tables.op_of(name + "_7", ops) == ops[name]
  assert bench_train.phase_of("XlaModule", "ring_step_dkv") == "mla"
  for kernel, phase in [("grouped_mgpu_dw_704x1024_mosaic_gpu_kernel", "moe_experts"),
                        ("_grouped_dot_triton", "moe_experts"), ("_short_conv_dz_triton", "kda")]:
    assert bench_train.phase_of("XlaModule", kernel) == phase, kernel


def test_kernel_registers_dumps_every_kda_kernel_with_its_launch_width(tmp_path):
  """benchmarks/kernel_registers.py's CPU half: one Triton IR file per KDA kernel (forward and
  backward), each with the num_warps the code ships (pallas_gpu.WARPS, the prologue's)."""
  from pallas_kernels.kda import pallas_gpu, pallas_gpu_prologue as prologue_gpu
  from benchmarks import kernel_registers
  fn, args = kernel_registers.kda_kernels(64)
  kernels = kernel_registers.dump_ttir(fn, args, str(tmp_path))
  shipped = {f"kda_intra_{n}": w for n, w in pallas_gpu.WARPS.items()
             if not n.endswith("_unbounded")}
  shipped.update(kda_prologue=prologue_gpu.WARPS, kda_prologue_bwd=prologue_gpu.WARPS)
  assert {n: kernels[n] for n in shipped} == shipped
  assert {"kda_recurrence", "kda_recurrence_bwd", "kda_recurrence_grads"} <= set(kernels)
  for name in kernels:
    assert f"tt.func public @{name}" in (tmp_path / f"{name}.ttir").read_text()
  # Kimi's unbounded gate on the Pallas stage 1: its own tiles kernel and launch width.
  fn, args = kernel_registers.kda_kernels(64, unbounded=True)
  (tmp_path / "unbounded").mkdir()
  kernels = kernel_registers.dump_ttir(fn, args, str(tmp_path / "unbounded"))
  assert kernels["kda_intra_tiles_unbounded"] == pallas_gpu.WARPS["tiles_unbounded"]
  assert "kda_intra_tiles" not in kernels and "kda_intra_tiles_bwd" in kernels


_KNOB_CHECK = """
import pytest
from pallas_kernels.kda import pallas_gpu, triton_gpu
from benchmarks import bench_kda
assert bench_kda.knob_impl("triton:WU_BLOCK=32")[::2] == ("triton", "WU_BLOCK=32")
assert bench_kda.knob_impl("BLOCK_K=64")[::2] == ("pallas_gpu", "BLOCK_K=64")
before = triton_gpu.WU_BLOCK, triton_gpu.WU_LOW_DOTS, pallas_gpu.BLOCK_K
undo = bench_kda.set_knobs("triton:WU_BLOCK=32,WU_LOW_DOTS=False")
assert (triton_gpu.WU_BLOCK, triton_gpu.WU_LOW_DOTS, pallas_gpu.BLOCK_K) == (32, False, before[2])
undo()
assert (triton_gpu.WU_BLOCK, triton_gpu.WU_LOW_DOTS, pallas_gpu.BLOCK_K) == before
from pallas_kernels.kda import triton_gpu_stage1
fused = triton_gpu_stage1.STAGE1_FUSED
undo = bench_kda.set_knobs(f"triton:STAGE1_FUSED={not fused}")   # the fused stage 1's module
assert triton_gpu_stage1.STAGE1_FUSED is (not fused)
undo()
assert triton_gpu_stage1.STAGE1_FUSED is fused
with pytest.raises(ValueError, match="triton_gpu / .*triton_gpu_stage1 / .*triton_gpu_fwd16 has no 'NOT_A_KNOB'"):
  bench_kda.set_knobs("triton:NOT_A_KNOB=1")
assert bench_kda.parse_shape("2x64x4") == (2, 64, 4, 128)
assert bench_kda.parse_shape("2x64x4x64") == (2, 64, 4, 64)
for bad in ("2x64", "2x64x4x64x1", "2xax4", "2x0x4"):
  with pytest.raises(ValueError, match=f"--shapes entry '{bad}': expected BxTxH or BxTxHxK"):
    bench_kda.parse_shape(bad)
assert bench_kda.floors(1, 64, 1, dim=16)["fwd"][1] == 64 * (2 * 5 * 16 + 2)
# fla's ms over each row's, pipelined and blocked; a time missing on either side: no ratio
ratios = bench_kda.add_ratios_to_fla({
    "triton": {"fwd_ms": 1.0, "fwd_ms_blocked": 2.0, "fwd_bwd_ms": 4.0},
    "fla": {"fwd_ms": 1.5, "fwd_ms_blocked": 1.8, "fwd_bwd_ms": 5.0, "fwd_bwd_ms_blocked": 6.0}})
t = ratios["triton"]
assert (t["fwd_x_fla"], t["fwd_x_fla_blocked"], t["fwd_bwd_x_fla"]) == (1.5, 0.9, 1.25), t
assert "fwd_bwd_x_fla_blocked" not in t and ratios["fla"]["fwd_bwd_x_fla_blocked"] == 1.0
import io, time
from absl import flags
flags.FLAGS(["bench_kda", "--fla=false"])
start = time.perf_counter()
rows = bench_kda.bench_shape(1, 64, 1, ["xla"], 2, io.StringIO(), dim=16)
assert set(rows) == {"xla"}, rows
row = rows["xla"]
assert 0 < row["row_s"] <= time.perf_counter() - start, row
assert all(row[f"{m}_ms{c}"] > 0 for m in ("fwd", "fwd_bwd") for c in ("", "_blocked")), row
# --gate=unbounded: Kimi's gate; a knob row times the other stage 1 beside the default's,
# checked against it (o and every gradient).
flags.FLAGS.unparse_flags()
flags.FLAGS(["bench_kda", "--fla=false", "--gate=unbounded",
             "--knobs=UNBOUNDED_STAGE1='xla'"])
rows = bench_kda.bench_shape(1, 32, 1, ["pallas_gpu"], 1, io.StringIO(), dim=16)
assert set(rows) == {"pallas_gpu", "pallas_gpu[UNBOUNDED_STAGE1='xla']"}, rows
assert rows["pallas_gpu[UNBOUNDED_STAGE1='xla']"]["max_rel_err_vs_pallas_gpu"] < 2e-2, rows
assert pallas_gpu.UNBOUNDED_STAGE1 == "pallas"
# A triton row takes pallas_gpu's knobs that triton_gpu lacks (its op is pallas_gpu's).
undo = bench_kda.set_knobs("triton:UNBOUNDED_STAGE1='xla',WU_BLOCK=32")
assert pallas_gpu.UNBOUNDED_STAGE1 == "xla" and triton_gpu.WU_BLOCK == 32
undo()
assert pallas_gpu.UNBOUNDED_STAGE1 == "pallas" and triton_gpu.WU_BLOCK == 64
print("ok")
"""


# 27 s on 2 cores (a subprocess importing bench_kda): make test-all runs it.
@pytest.mark.slow
def test_bench_kda_knobs_set_either_module_and_undo():
  """bench_kda's --knobs rows: 'triton:' sets triton_gpu's knobs for a triton row, anything
  else pallas_gpu's; the undo restores them; an unknown knob is a ValueError naming it. A
  shape may name its head width (BxTxHxK). And a row at a tiny shape on CPU (xla, K = 16):
  both clocks, and its wall time with compiles (row_s,
  what plans a device call); --gate=unbounded with a stage-1 knob row checked against the
  default's. In its own process: bench_kda and bench_train both define --out."""
  run = subprocess.run([sys.executable, "-c", _KNOB_CHECK], cwd=ROOT, capture_output=True,
                       text=True, env=subprocess_env(), timeout=300)
  assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]


def _trace(kernels, streams=("Stream #13(Compute)", "Stream #14(MemcpyD2D)")):
  """A trace_viewer trace: a host and a GPU process, the GPU's stream threads and a derived
  "XLA Ops" line (not a stream) that must be ignored; kernels = (stream index, ts, dur, name)."""
  ev = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 99, "args": {"name": "XLA Ops"}},
        {"ph": "X", "pid": 2, "tid": 99, "ts": 0, "dur": 1000, "name": "whole_op"},
        {"ph": "X", "pid": 1, "tid": 5, "ts": 0, "dur": 1000, "name": "host_work"}]
  ev += [{"ph": "M", "name": "thread_name", "pid": 2, "tid": 10 + i, "args": {"name": s}}
         for i, s in enumerate(streams)]
  ev += [{"ph": "X", "pid": 2, "tid": 10 + i, "ts": ts, "dur": dur, "name": n}
         for i, ts, dur, n in kernels]
  return {"traceEvents": ev}


def test_scope_groups_add_one_module_over_layers():
  """Kernels group by their HLO op's scope without the primitive, the jit/while wrappers
  and the layer index (a jit the op sits in stays its scope); a kernel with no op (Pallas)
  by its own name; a fusion's numbered kernel by its instruction's op."""
  ops = {"fusion_1": "jit(f)/jit(decode_turn)/while/body/HybridMoE/layer_0/kda/mixer/q_proj/dot_general",
         "fusion_2": "jit(f)/while/body/HybridMoE/layer_4/kda/mixer/q_proj/mul",
         "fusion_3": "jit(f)/while/body/HybridMoE/layer_1/moe/ffn/jit(take)/gather"}
  rows = [{"kernel_name": "fusion_1", "occurrences": 2, "total_duration_us": 3.0},
          {"kernel_name": "fusion_2_7", "occurrences": 1, "total_duration_us": 1.5},
          {"kernel_name": "fusion_3", "occurrences": 4, "total_duration_us": 8.0},
          {"kernel_name": "latent_decode", "occurrences": 4, "total_duration_us": 40.0}]
  assert xprof_tables.scope_groups(rows, ops) == {
      "HybridMoE/layer_*/kda/mixer/q_proj": (3, 4.5),
      "HybridMoE/layer_*/moe/ffn/jit(take)": (4, 8.0),
      "latent_decode": (4, 40.0)}


def test_device_gaps_count_the_union_of_streams_and_group_the_waits():
  # stream 0: a 0-10, b 30-40, c 100-130; stream 1 overlaps b (35-50), then d 200-210.
  # union: [0,10] [30,50] [100,130] [200,210] = 70 µs busy; gaps 20, 50, 70 µs.
  trace = _trace([(0, 0, 10, "a"), (0, 30, 10, "b"), (1, 35, 15, "copy"), (0, 100, 30, "c"),
                  (1, 200, 10, "a"), (0, 300, 0, "empty_after")])
  g = xprof_tables.device_gaps(trace, steps=2, min_us=30)
  # the zero-length event at 300 adds a 90 µs gap and no busy time
  assert abs(g["device_busy_ms_per_step"] - 0.070 / 2) < 1e-9
  assert g["copy_only_ms_per_step"] == 0.0     # no event named Memcpy...
  assert abs(g["device_idle_ms_per_step"] - (20 + 50 + 70 + 90) / 1e3 / 2) < 1e-9
  gaps = {(x["before"], x["after"]): (x["n"], round(x["ms_per_step"] * 2e3)) for x in g["top_gaps"]}
  # the 20 µs gap is under min_us; "copy" ends the union's second block, so it is "before"
  assert gaps == {("copy", "c"): (1, 50), ("c", "a"): (1, 70), ("a", "empty_after"): (1, 90)}
  assert [x["before"] for x in g["top_gaps"]] == ["a", "c", "copy"]   # longest first
  # summed, not unioned: the overlap of b and copy counts on both streams
  assert {k: round(v * 2e3) for k, v in g["stream_ms_per_step"].items()} == {
      "Stream #13(Compute)": 50, "Stream #14(MemcpyD2D)": 25}
  assert [(x["name"], round(x["ms_per_step"] * 2e3)) for x in g["top_events"]][:2] == [
      ("c", 30), ("a", 20)]
  assert xprof_tables.device_gaps({"traceEvents": trace["traceEvents"][:1]}, steps=1) == {}


def test_device_gaps_group_memory_copies_by_their_hlo_op():
  """Copies (events named Memcpy...) summed by (kind, HLO op) with their bytes; other
  events are not copies; a copy without an op argument falls back to its thunk's name."""
  trace = _trace([(1, 0, 10, "MemcpyD2D"), (1, 20, 30, "MemcpyD2D"), (1, 60, 5, "MemcpyD2D"),
                  (0, 0, 40, "kernel")])
  copy_events = [e for e in trace["traceEvents"] if e.get("name") == "MemcpyD2D"]
  copy_events[0]["args"] = {"hlo_op": "dynamic-slice.3", "num_bytes": "4000000"}
  copy_events[1]["args"] = {"hlo_op": "dynamic-slice.3", "num_bytes": 2000000}
  copy_events[2]["args"] = {"long_name": "copy_thunk_7", "bytes_transferred": "bad"}
  g = xprof_tables.device_gaps(trace, steps=2)
  assert g["top_copies"] == [
      {"ms_per_step": 0.040 / 2, "n_per_step": 1.0, "mb_per_step": 3.0, "kind": "MemcpyD2D",
       "op": "dynamic-slice.3"},
      {"ms_per_step": 0.005 / 2, "n_per_step": 0.5, "mb_per_step": 0.0, "kind": "MemcpyD2D",
       "op": "copy_thunk_7"}]
  assert g["copy_arg_names"] == ["bytes_transferred", "hlo_op", "long_name", "num_bytes"]
  # busy [0, 50] and [60, 65]; the kernel covers [0, 40]: copies alone 10 + 5 µs
  assert g["copy_only_ms_per_step"] == pytest.approx(0.015 / 2)


def test_scan_residuals_lists_the_stacks_a_change_removes():
  """benchmarks/scan_residuals.py on a small scanned model (2 periods of "KA" after a dense
  layer, remat policy `kernels`): the expert outputs [2, N·k, D] are stacked, once a MoE
  layer, and model.moe.weights_before_down removes exactly those stacks."""
  from benchmarks import scan_residuals
  c = make_small_config()
  c.model.update(n_layers=5, remat=True, remat_policy="kernels")
  m, B, L = c.model, c.data.batch_size, c.data.seq_len
  y_stack = ((2, B * L * m.moe.top_k, m.d_model), "float32")
  jaxpr = scan_residuals.vjp_jaxpr(c, "cpu")
  before, all_before = scan_residuals.stacked_residuals(jaxpr), scan_residuals.residual_bytes(jaxpr)
  c.model.moe.weights_before_down = True
  jaxpr = scan_residuals.vjp_jaxpr(c, "cpu")
  after, all_after = scan_residuals.stacked_residuals(jaxpr), scan_residuals.residual_bytes(jaxpr)
  assert before[y_stack] == 2 and y_stack not in after, (before, after)
  removed = scan_residuals.total_bytes({y_stack: 2})
  assert scan_residuals.total_bytes(before) - scan_residuals.total_bytes(after) == removed
  # the stacks are part of all the residuals (the dense head layer keeps its own)
  assert all_before > scan_residuals.total_bytes(before) > 0
  assert all_before - all_after == removed


def test_timing_clocks_run_each_call_and_wait_once_a_window():
  """benchmarks/timing.py's two clocks, the one pair every library in a comparison is timed
  with: blocked waits on every call, pipelined on the last call of each window only, and
  both return a median per call in ms."""
  import time as time_lib
  from benchmarks import timing
  calls, waits = [], []

  def call():
    calls.append(1)
    time_lib.sleep(0.002)
    return len(calls)

  ms = timing.host_median_ms(call, waits.append, iters=5, warmup=2)
  assert len(calls) == 7 and waits == list(range(1, 8)) and 2.0 <= ms < 50.0
  calls.clear(), waits.clear()
  ms = timing.host_pipelined_ms(call, waits.append, iters=3, calls=4, warmup=1)
  # one wait for the warm-up call, then one a window, on the window's last call
  assert len(calls) == 1 + 3 * 4 and waits == [1, 5, 9, 13] and 2.0 <= ms < 50.0
  f = jax.jit(lambda x: x * 2.0)
  x = jnp.ones((8,))
  assert timing.pipelined_ms(f, (x,), iters=2, calls=3) > 0.0
  assert timing.median_ms(f, (x,), iters=2) > 0.0


@pytest.mark.slow   # 12 s on 2 cores; make test keeps --memory_only's run of the script
def test_bench_kimi_48b_writes_its_record(tmp_path):
  """benchmarks/bench_kimi_48b.py end to end, shrunk (--small): a row per context with the
  issue's fields and the memory plan; the full 48B's plan from shapes alone."""
  r = subprocess.run([sys.executable, "-m", "benchmarks.bench_kimi_48b", "--small",
                      "--contexts=64,128", "--prefill_chunk=32", "--decode_tokens=4",
                      f"--out={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                     env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 0, r.stderr[-2000:]
  import json
  record = json.loads((tmp_path / "kimi_48b_h200.json").read_text())
  assert [row["context"] for row in record["rows"]] == [64, 128]
  for row in record["rows"]:
    assert row["prefill_tok_s"] > 0 and row["decode_ms_per_token"] > 0
    assert row["prefill_s"] * row["prefill_tok_s"] == pytest.approx(row["context"])
  assert {"date", "commit", "machine"} <= set(record)
  assert "| 128 |" in (tmp_path / "kimi_48b_h200.md").read_text()


@pytest.mark.slow   # two processes of the script, 20 s on 2 cores
def test_bench_kimi_48b_prefills_in_parts(tmp_path):
  """--state_dir with --part_seconds: the first process stops after a chunk, saving the
  prefill's state and no row; the second restores it, finishes the prefill and decodes,
  its row counting 2 parts, and the state is gone."""
  import json
  cmd = [sys.executable, "-m", "benchmarks.bench_kimi_48b", "--small", "--contexts=64",
         "--prefill_chunk=32", "--decode_tokens=4", f"--state_dir={tmp_path}/state",
         "--part_seconds=0.001", f"--out={tmp_path}/out"]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
  assert first.returncode == 0, first.stderr[-2000:]
  assert "paused after chunk 1 of 2" in first.stdout
  assert json.loads((tmp_path / "state" / "prefill_64.json").read_text())["next_chunk"] == 1
  assert not (tmp_path / "out" / "kimi_48b_h200.json").exists()
  second = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
  assert second.returncode == 0, second.stderr[-2000:]
  assert "resumed at chunk 1" in second.stdout
  [row] = json.loads((tmp_path / "out" / "kimi_48b_h200.json").read_text())["rows"]
  assert row["context"] == 64 and row["prefill_parts"] == 2 and row["prefill_s"] > 0
  assert row["decode_ms_per_token"] > 0 and os.listdir(tmp_path / "state") == []


@pytest.mark.slow   # a benchmark script end to end: second tier
def test_bench_kimi_48b_memory_only(tmp_path):
  """--memory_only compiles both programs from shapes and prints their memory, without
  allocating weights or writing a record."""
  r = subprocess.run([sys.executable, "-m", "benchmarks.bench_kimi_48b", "--small",
                      "--contexts=64,128", "--prefill_chunk=32", "--decode_tokens=4",
                      "--memory_only", f"--out={tmp_path}"], cwd=ROOT, capture_output=True,
                     text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 0, r.stderr[-2000:]
  import json
  report = json.loads(r.stdout[r.stdout.index("{"):])
  assert report["cache_positions"] == 132 and report["prefill_chunk"] == 32
  for program in ("prefill_step", "decode_loop"):
    assert report[program]["argument_gib"] > 0 and report[program]["temp_gib"] >= 0
  assert not (tmp_path / "kimi_48b_h200.json").exists()


def test_attention_flops_count_causal_pairs_within_documents():
  """The MFU numerator's attention term counts the (query, key) pairs a causal, document-
  masked kernel computes: L·(L+1)/2 a document, none for padding; a row of one document is
  the full-row count; and MFU divides by 989 TFLOP/s (762 only for mfu_measured_peak)."""
  import numpy as np
  from configs import long_context_1b
  seg = np.array([[1, 1, 1, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1], [3, 3, 4, 4, 4, 4, 0]])
  assert bench_train.attention_pairs(seg) == (6 + 3) + 28 + (3 + 10)
  c = long_context_1b.get_config()
  c.data.seq_len, c.data.batch_size = 8192, 4
  full = bench_train.model_flops_per_step(c)
  assert full["attention_pairs"] == full["attention_pairs_full_row"] == 4 * 8192 * 8193 // 2
  # 4 MLA layers (KKKA × 4), 16 heads, d_qk + d_v = 128
  assert full["mla_attention"] == 6 * 4 * full["attention_pairs"] * 16 * 128
  docs = bench_train.attention_pairs(np.repeat(np.arange(1, 9), 1024)[None].repeat(4, 0))
  packed = bench_train.model_flops_per_step(c, docs)
  assert docs == 4 * 8 * 1024 * 1025 // 2
  assert packed["mla_attention"] * 8 == pytest.approx(full["mla_attention"], rel=1e-3)
  assert packed["total"] - packed["mla_attention"] == full["total"] - full["mla_attention"]
  assert bench_train.mfu(989e12, 1000.0, 1) == pytest.approx(1.0)
  assert bench_train.mfu(762e12, 1000.0, 2, bench_train.MEASURED_PEAK_FLOPS) == 0.5


@pytest.mark.slow
def test_bench_train_row_and_its_baseline_on_cpu(tmp_path):
  """A row and its `_baseline` (the same code, given as --baseline_dir) in one call, named by
  --label: both dated and stamped with a commit and their base row, the same loss after the
  same data, the markdown's "× baseline" column, and the attention pairs of the batches the
  timed steps ran."""
  import json
  out = tmp_path / "out"
  run = subprocess.run(
      [sys.executable, "-m", "benchmarks.bench_train", "--rows=tiny_cpu", f"--out={out}",
       "--steps=2", "--warm=", f"--baseline_dir={ROOT}", "--set=data.seq_len=128",
       "--set=data.batch_size=4", "--label=short"], cwd=ROOT, capture_output=True, text=True,
      timeout=900, env=subprocess_env(MOE_JAX_COMMIT="abc1234", JAX_PLATFORMS="cpu"))
  assert run.returncode == 0, run.stderr[-3000:]
  rows = {r["row"]: r for r in json.load(open(out / "train.json"))}
  row, base = rows["tiny_cpu_short"], rows["tiny_cpu_short_baseline"]
  assert row["base_row"] == base["base_row"] == "tiny_cpu"
  assert row["commit"] == "abc1234" and base["commit"].startswith("baseline:")
  assert row["date"] == base["date"] and row["dispatch"] == base["dispatch"] == "dropless"
  assert row["loss_after"] == pytest.approx(base["loss_after"], rel=1e-5)
  assert 0 < row["attention_pairs_per_step"] <= 4 * 128 * 129 / 2
  assert row["flops"]["attention_pairs"] == row["attention_pairs_per_step"]
  md = (out / "train.md").read_text()
  assert "commit abc1234" in md and "× baseline" in md and "tiny_cpu_short_baseline" in md


def test_bench_train_keeps_a_rows_history_and_other_mode():
  """A new cold measurement of a row is appended: the row's warm launch and its earlier
  cold ones (other commits) stay; only the same row, mode and commit is replaced."""
  old = [{"row": "a", "mode": "cold", "commit": "c1", "step_ms": 3.0},
         {"row": "a", "mode": "warm", "commit": "c1", "launch_to_first_step_s": 7.0},
         {"row": "a", "mode": "cold", "commit": "c2", "step_ms": 2.0},
         {"row": "b", "mode": "cold", "commit": "c2", "step_ms": 5.0}]
  new = [{"row": "a", "mode": "cold", "commit": "c2", "step_ms": 1.0}]
  merged = bench_train.merge_records(old, new)
  assert merged == [old[0], old[1], old[3], new[0]]


def test_bench_train_rejects_a_label_that_is_not_a_name(tmp_path):
  """--label becomes part of a row's name: anything but letters, digits and _ is refused
  before a row runs, with the flag and the value in the message."""
  run = subprocess.run(
      [sys.executable, "-m", "benchmarks.bench_train", "--rows=tiny_cpu", f"--out={tmp_path}",
       "--label=fused swiglu"], cwd=ROOT, capture_output=True, text=True, timeout=120,
      env=subprocess_env(JAX_PLATFORMS="cpu"))
  assert run.returncode != 0
  assert "--label: 'fused swiglu' is not a name" in run.stderr
  assert not (tmp_path / "train.json").exists()


def test_phase_floors_are_flops_at_peak_or_bytes_at_bandwidth():
  """Each phase's floor: its FLOPs at the peak or its HBM bytes at the bandwidth, the larger
  (train_floors.py's module docstring)."""
  from benchmarks import train_floors
  from configs import kimi_linear_48b
  from moe_jax import params
  c = kimi_linear_48b.get_config("h200_slice")
  flops = bench_train.model_flops_per_step(c)
  counts, tokens = params.count(c), 8192
  fl = train_floors.phase_floors_ms(c, flops)
  assert fl["optimizer"] == pytest.approx(28 * counts["total_sum"] / 4.8e12 * 1e3)   # 37.5
  assert fl["loss"] == pytest.approx(6 * 163840 * 2304 * tokens / 989e12 * 1e3)       # 18.8
  experts_flops = 6 * counts["active"]["routed_experts"] * tokens / 989e12
  experts_bytes = counts["total"]["routed_experts"] * (3 * 2 + 4) / 4.8e12   # bf16 ×3, fp32
  assert fl["moe_experts"] == pytest.approx(1e3 * max(experts_flops, experts_bytes))
  assert fl["mla"] == pytest.approx(
      (6 * counts["active"]["mla"] * tokens + flops["mla_attention"]) / 989e12 * 1e3)
  # halving the bandwidth doubles exactly the memory-bound floors
  slow = train_floors.phase_floors_ms(c, flops, hbm_bytes_per_s=2.4e12)
  assert slow["optimizer"] == pytest.approx(2 * fl["optimizer"])
  assert slow["loss"] == fl["loss"] and slow["kda"] == fl["kda"]
  # a row's floors use its own device's bandwidth: an H100's is 3.35 TB/s, not the H200's
  assert train_floors.hbm_bytes_per_s("NVIDIA H100 80GB HBM3") == 3.35e12
  assert train_floors.hbm_bytes_per_s("NVIDIA H200") == 4.8e12
  assert train_floors.hbm_bytes_per_s(None) == 4.8e12
  h100 = bench_train.add_mfu({"attention_pairs_per_step": flops["attention_pairs"],
                              "platform": "gpu", "device": "NVIDIA H100 80GB HBM3",
                              "step_ms": 300.0}, "h200_slice")
  assert h100["phase_floor_hbm_tb_per_s"] == 3.35
  assert h100["phase_floor_ms"]["optimizer"] == pytest.approx(fl["optimizer"] * 4.8 / 3.35)


def test_decode_floors_at_1m_by_hand():
  """decode_floors at long_context_1b, 1M tokens, written out by hand: batch 1 reads every
  non-expert weight, 4 of 32 experts, 4 MLA layers' latents [2^20, 256] and 12 KDA states
  [16, 64, 64] fp32 (read and written) with their conv tails, in bf16 at 4.8 TB/s. The
  largest batches fit 141 GB beside the weights, and the best tokens/s ratio of hybrid to
  all-MLA stays below their cache ratio, 16/4 MLA layers."""
  from benchmarks import decode_floors
  from configs import long_context_1b
  L = 1 << 20
  c = long_context_1b.get_config().model
  n = decode_floors.count(c)
  t = n["total"]
  weights = (n["total_sum"] - t["embedding"] - t["routed_experts"] + 1024
             + t["routed_experts"] * 4 / 32)
  kda = 12 * (16 * 64 * 64 * 4 + 3 * 3 * (16 * 64 * 2 + 4))
  want = 2 * weights + 4 * L * 256 * 2 + 2 * kda
  f = decode_floors.step_floor(c, L, 1)
  assert f["bytes"] == pytest.approx(want) and f["bound"] == "memory"
  assert f["ms"] == pytest.approx(1e3 * want / 4.8e12)
  assert decode_floors.experts_read(32, 4, 1) == pytest.approx(4)
  assert 31.9 < decode_floors.experts_read(32, 4, 256) <= 32
  row = 4 * L * 256 * 2 + kda
  assert decode_floors.max_batch(c, L) == int((141e9 - 2 * n["total_sum"]) // row) == 64
  mla = long_context_1b.get_config("all_mla").model
  assert decode_floors.max_batch(mla, L) == 16
  ratio = (decode_floors.ceiling(c, L)["tokens_per_s"]
           / decode_floors.ceiling(mla, L)["tokens_per_s"])
  assert 3.9 < ratio < 4.0


def test_decode_batch_search_ends_beside_the_first_batch_that_does_not_fit():
  """bench_decode's search: doubling to the first out-of-memory batch, then bisection, so
  the largest batch that fits (37 here) sits next to one that did not (38); other errors
  propagate; with a resolution of 8 it stops within 8."""
  from benchmarks import batch_search

  def measure(b):
    if b > 37:
      raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
    return {"ms_per_token": 1.0 + b / 100}

  rows = batch_search.search_batches(measure, 1024)
  assert [r["batch"] for r in rows] == [1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37]
  fits = [r["batch"] for r in rows if not r["oom"]]
  assert max(fits) == 37 and {"batch": 38, "oom": True} in rows
  coarse = batch_search.search_batches(measure, 1024, resolution=8)
  assert [r["batch"] for r in coarse][-1] == 40 and coarse[-1]["oom"]
  assert [r["batch"] for r in batch_search.search_batches(measure, 16)] == [1, 2, 4, 8, 16]
  assert [r["batch"] for r in batch_search.search_batches(measure, 1024, start=24)] == [
      24, 48, 36, 42, 39, 37, 38]

  def broken(b):
    raise ValueError("a shape error")
  with pytest.raises(ValueError, match="a shape error"):
    batch_search.search_batches(broken, 8)


@pytest.mark.slow
def test_bench_decode_rows_on_cpu(tmp_path):
  """bench_decode at a toy size on CPU (--small): rows in decode.json's schema for both
  variants, tokens_per_s = batch · 1000 / ms_per_token, each with its decode options and
  the XLA_FLAGS it ran with (none here: a row with flags is not a default row)."""
  import json
  run = subprocess.run(
      [sys.executable, "-m", "benchmarks.bench_decode", "--small", "--contexts=64",
       "--batches=1,2", "--decode_tokens=4", "--repeats=2", f"--out={tmp_path}"],
      cwd=ROOT, capture_output=True, text=True, timeout=600,
      env=subprocess_env(MOE_JAX_COMMIT="abc1234", JAX_PLATFORMS="cpu", XLA_FLAGS=""))
  assert run.returncode == 0, run.stderr[-3000:]
  rows = json.load(open(tmp_path / "decode.json"))
  assert {(r["variant"], r["batch"]) for r in rows} == {
      ("hybrid", 1), ("hybrid", 2), ("all_mla", 1), ("all_mla", 2)}
  for r in rows:
    assert r["context"] == 64 and r["commit"] == "abc1234" and r["oom"] is False
    assert r["tokens_per_s"] == pytest.approx(r["batch"] * 1e3 / r["ms_per_token"])
    assert r["ms_per_token"] > 0 and r["peak_gib"] > 0
    assert (r["kda_decode"], r["decode_dispatch"], r["decode_matmul"],
            r["xla_flags"]) == ("auto", "auto", "pallas", "")
    assert "fused_projections" not in r   # not an inference option: always fused
    assert 0 < r["floor_ms"] < r["ms_per_token"]   # a toy step on CPU is far above an H200's
  assert "Largest batch that fits" in (tmp_path / "decode.md").read_text()
  # A run with another decode option adds its rows beside the defaults' (one call times both).
  run = subprocess.run(
      [sys.executable, "-m", "benchmarks.bench_decode", "--small", "--contexts=64",
       "--batches=1", "--decode_tokens=4", "--repeats=1", "--variants=hybrid",
       "--kda_decode=kernel", f"--out={tmp_path}"],
      cwd=ROOT, capture_output=True, text=True, timeout=600,
      env=subprocess_env(MOE_JAX_COMMIT="abc1234", JAX_PLATFORMS="cpu", XLA_FLAGS=""))
  assert run.returncode == 0, run.stderr[-3000:]
  rows = json.load(open(tmp_path / "decode.json"))
  assert len(rows) == 5 and [(r["variant"], r["batch"]) for r in rows
                             if r["kda_decode"] == "kernel"] == [("hybrid", 1)]
  table = (tmp_path / "decode.md").read_text()
  assert "| 64 | hybrid | kda_decode=kernel | 1 |" in table and "| 64 | hybrid | defaults | 1 |" in table


@pytest.mark.slow   # a benchmark script end to end: second tier
def test_bench_cached_attention_times_each_launch_width(tmp_path):
  """bench_cached_attention's prefill rows at Kimi's head dims (192 / 128), shrunk, on CPU:
  one timing per (--num_warps, --split) pair, in one process, their outputs equal."""
  import json
  run = subprocess.run(
      [sys.executable, "-m", "benchmarks.bench_cached_attention", "--heads=2", "--dqk=192",
       "--dv=128", "--chunk=64", "--cache=256", "--filled=128,256", "--iters=1",
       "--num_warps=4,8", "--split=true,false", f"--out={tmp_path}"], cwd=ROOT,
      capture_output=True, text=True,
      timeout=600, env=subprocess_env(JAX_PLATFORMS="cpu"))
  assert run.returncode == 0, run.stderr[-2000:]
  record = json.load(open(tmp_path / "bench_cached_attention.json"))
  assert [r["filled"] for r in record["rows"]] == [128, 256]
  variants = ["w4_split", "w4_padded", "w8_split", "w8_padded"]
  assert record["knobs"]["variants_timed"] == variants
  for r in record["rows"]:
    assert all(r[f"pallas_{v}_ms"] > 0 for v in variants) and (r["dqk"], r["dv"]) == (192, 128)
    assert r["rel_err_between_variants"] < 1e-2   # bf16: split and padded sum in other orders


@pytest.mark.slow   # a benchmark script end to end: second tier
def test_bench_attention_rounds_interleave_rows(tmp_path):
  """--rounds times every row that many times, interleaved, and reports each row's median
  round; a row that cannot run here (cuDNN off a GPU) is dropped, not fatal."""
  import json
  import numpy as np
  out = subprocess.run(
      [sys.executable, "-m", "benchmarks.bench_attention", "--shape=1,128,2,16", "--sweep=false",
       "--iters=1", "--rounds=2", "--doc_len=40", f"--out={tmp_path}"],
      capture_output=True, text=True, timeout=300, cwd=ROOT, env=subprocess_env())
  assert out.returncode == 0, out.stderr[-2000:]
  rows = {r["variant"]: r for r in json.load(open(tmp_path / "attention.json"))["rows"]}
  (name, row), = ((n, r) for n, r in rows.items() if n.startswith("default"))
  assert len(row["fwd_ms_rounds"]) == len(row["fwd_bwd_ms_rounds"]) == 2, row
  assert row["fwd_ms"] == float(np.median(row["fwd_ms_rounds"])) and row["error"] < 1e-2, row


def test_gpu_runs_script_passes_each_unit_its_config_flags_and_gpu(tmp_path):
  """benchmarks/gpu_runs.sh with python3 and nvidia-smi stubbed (one GPU): each unit runs
  its script and config with its own flags, two share the GPU at 0.46 of its memory (three at
  MEM_FRACTION), and
  each workdir comes back tarred without its checkpoints; a bad kind is refused."""
  stub = tmp_path / "bin"
  stub.mkdir()
  (stub / "python3").write_text(
      '#!/bin/bash\necho "ran $* gpu=$CUDA_VISIBLE_DEVICES mem=$XLA_PYTHON_CLIENT_MEM_FRACTION"\n'
      'for a in "$@"; do case $a in --workdir=*) mkdir -p "${a#*=}/checkpoints"; '
      'touch "${a#*=}/summary.json";; esac; done\n')
  (stub / "nvidia-smi").write_text('#!/bin/bash\necho "GPU 0: stub"\n')
  for f in stub.iterdir():
    f.chmod(0o755)
  (tmp_path / "site").mkdir()
  (tmp_path / "site" / ".installed").touch()
  env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
         "RUNS_DIR": str(tmp_path / "runs"), "SITE": str(tmp_path / "site"), "STAGGER": "0",
         "UNITS": "grpo:g1:--config.rl.seed=1 --config.seed=1;context:s1"}
  run = subprocess.run(["bash", "benchmarks/gpu_runs.sh"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
  assert run.returncode == 0, run.stderr
  assert ("ran scripts/grpo.py --config=configs/grpo.py:h200 --workdir="
          f"{tmp_path}/runs/g1 --config.rl.seed=1 --config.seed=1 gpu=0 mem=0.46") in run.stdout
  assert (f"ran scripts/extend_context.py --config=configs/stages.py:h200 --workdir="
          f"{tmp_path}/runs/s1 gpu=0 mem=0.46") in run.stdout
  listing = subprocess.run(["tar", "tzf", str(tmp_path / "out" / "g1.tgz")],
                           capture_output=True, text=True, check=True).stdout.split()
  assert sorted(listing) == ["g1.log", "g1/", "g1/summary.json"]
  three = subprocess.run(["bash", "benchmarks/gpu_runs.sh"], cwd=ROOT, capture_output=True,
                         env={**env, "UNITS": "grpo:a;grpo:b;grpo:c", "MEM_FRACTION": "0.30"},
                         text=True, timeout=120)
  assert three.returncode == 0 and three.stdout.count("gpu=0 mem=0.30") == 3, three.stdout
  bad = subprocess.run(["bash", "benchmarks/gpu_runs.sh"], cwd=ROOT,
                       env={**env, "UNITS": "eval:x:"}, capture_output=True, text=True,
                       timeout=60)
  assert bad.returncode != 0 and "kind must be grpo or context, got 'eval'" in bad.stderr

