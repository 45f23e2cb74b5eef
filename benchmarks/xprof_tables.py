"""Per-op and per-kernel device time of a JAX profiler trace (xprof's hlo_stats and
kernel_stats tools), and the HLO op (named scopes) of each GPU kernel. Best effort: xprof is
optional on the GPU machine."""

import glob
import json
import os
import re


def hlo_op_table(trace_dir: str, title: str, top: int = 25) -> str:
  """Writes hlo_stats.json / kernel_stats.json next to the trace and returns a markdown
  table of the `top` ops by self time."""
  from xprof.convert import raw_to_tool_data
  paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
  tables = {}
  for tool in ("hlo_stats", "kernel_stats"):
    data, _ = raw_to_tool_data.xspace_to_tool_data(paths, tool, {})
    with open(os.path.join(trace_dir, f"{tool}.json"), "w" if isinstance(data, str) else "wb") as f:
      f.write(data)
    tables[tool] = _rows(data)
  rows = tables["hlo_stats"]
  rows.sort(key=lambda r: -(r.get("total_self_time") or 0))
  lines = [f"| HLO op ({title}) | category | n | self µs | framework op |", "|---|---|---|---|---|"]
  for r in rows[:top]:
    lines.append(f"| {r['hlo_op_name']} | {r['category']} | {r['occurrences']} | "
                 f"{r['total_self_time']:.0f} | {str(r['tf_op_name'])[-70:]} |")
  # Per kernel as well: hlo_stats can come back empty on GPU (seen for Pallas-only programs).
  rows = tables["kernel_stats"]
  rows.sort(key=lambda r: -float(r.get("total_duration_us") or 0))
  lines += ["", f"| kernel ({title}) | n | total µs | regs/thread | occupancy % | grid |",
            "|---|---|---|---|---|---|"]
  for r in rows[:top]:
    lines.append(f"| {str(r['kernel_name'])[:60]} | {r['occurrences']} | "
                 f"{float(r['total_duration_us']):.0f} | {r['registers_per_thread']} | "
                 f"{r['occupancy_pct']} | {r['grid_dim']} |")
  total_us = sum(float(r.get("total_duration_us") or 0) for r in rows)
  launches = sum(int(r.get("occurrences") or 0) for r in rows)
  lines.append(f"\nall kernels ({title}): {launches} launches, {total_us:.0f} µs on the device")
  return "\n".join(lines)


def kernels_by_scope(trace_dir: str, hlo_text: str, per: int, top: int = 40) -> tuple[str, int, float]:
  """(markdown, kernel launches, kernel µs) of the trace under `trace_dir`: its kernels
  grouped by the named scope of the HLO op each runs (`scope_groups`), launches and µs
  divided by `per` (e.g. decoded tokens): which module's kernels take a step's time."""
  paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
  groups = scope_groups(tool_rows(paths, "kernel_stats"), hlo_ops(hlo_text))
  lines = [f"| scope | launches per {per} | µs |", "|---|---|---|"]
  for scope, (n, us) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]:
    lines.append(f"| {scope[-110:]} | {n / per:.1f} | {us / per:.1f} |")
  return ("\n".join(lines), sum(n for n, _ in groups.values()),
          sum(us for _, us in groups.values()))


def scope_groups(kernel_rows: list[dict], ops: dict[str, str]) -> dict[str, tuple[int, float]]:
  """scope → (launches, µs) over kernel_stats rows: a kernel's scope is its HLO op's op_name
  without the primitive, the jit/while wrappers and the layer index (`layer_*`), so one
  module's kernels in every layer add up (a jit the op sits in, e.g. take_along_axis's,
  stays part of the scope); a kernel with no op (a Pallas kernel) by its own name."""
  groups = {}
  for r in kernel_rows:
    op = op_of(str(r["kernel_name"]), ops)
    scope = re.sub(r"^.*?/while/body/", "", op).rsplit("/", 1)[0] if op else str(r["kernel_name"])
    scope = re.sub(r"layer_\d+", "layer_*", re.sub(r"jit\([^)]*\)/", "", scope))
    n, us = groups.get(scope, (0, 0.0))
    groups[scope] = (n + int(r.get("occurrences") or 0), us + float(r.get("total_duration_us") or 0))
  return groups


def _rows(data) -> list[dict]:
  """An xprof tool's JSON table as one dict per row, keyed by column id."""
  table = json.loads(data)
  cols = [col["id"] for col in table["cols"]]
  return [dict(zip(cols, [x.get("v") if x else None for x in r["c"]])) for r in table["rows"]]


def tool_rows(paths, tool: str) -> list[dict]:
  """The rows of xprof tool `tool` (e.g. kernel_stats) over the .xplane.pb files `paths`."""
  from xprof.convert import raw_to_tool_data
  data, _ = raw_to_tool_data.xspace_to_tool_data(paths, tool, {})
  return _rows(data)


def kernel_name(name: str) -> str:
  """An HLO instruction name as XLA names the GPU kernel emitted for it."""
  return re.sub(r"[^A-Za-z0-9_]", "_", name)


def hlo_ops(hlo_text: str) -> dict[str, str]:
  """Kernel name → op_name (the named scopes) of the HLO instruction it runs, from the
  compiled step's HLO: on the GPU the profile names every XLA fusion's op "XlaModule", and
  the instruction's metadata is what says whose gradient or norm it computes."""
  ops = {}
  for m in re.finditer(r'^\s*(?:ROOT )?%?([\w.\-]+) = [^\n]*?op_name="([^"]*)"', hlo_text,
                       re.M):
    ops[kernel_name(m.group(1))] = m.group(2)
  return ops


def op_of(kernel: str, ops: dict[str, str]) -> str:
  """The HLO op_name of a kernel: its instruction's, or that of the name without XLA's
  trailing kernel index."""
  if kernel in ops:
    return ops[kernel]
  return ops.get(re.sub(r"_\d+$", "", kernel), "")


def trace_events(paths) -> dict:
  """xprof's trace_viewer tool over the .xplane.pb files `paths`: the Chrome trace (a dict
  with "traceEvents")."""
  from xprof.convert import raw_to_tool_data
  data, _ = raw_to_tool_data.xspace_to_tool_data(paths, "trace_viewer", {})
  return json.loads(data)


def device_gaps(trace: dict, steps: int, top: int = 15, min_us: float = 5.0) -> dict:
  """Where the GPU waits: the idle time between kernels on the first GPU's streams (the
  union of the "Stream ..." threads' events, so that overlapping streams count once), per
  step, and the largest idle time grouped by the kernels on either side of each gap of at
  least `min_us`. Also each stream's summed event time and the `top` event names by summed
  time, to set beside kernel_stats (which listed 13.6 ms a step less than the streams'
  busy time on the 1B, benchmarks/train.md), and the memory copies (events named
  Memcpy...) by the HLO op the trace tags them with: on the 1B they were 19.3 ms a step,
  and no unfused copy in the HLO accounts for them. `copy_only_ms_per_step` is the time
  when only copies run (the union of every event less that of the other events): copies
  the rest of the step waits for, where copies that overlap kernels cost no time of their
  own. {} when the trace has no GPU stream."""
  events = trace.get("traceEvents", [])
  gpu = sorted(e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
               and str(e["args"].get("name", "")).startswith("/device:GPU"))
  if not gpu:
    return {}
  streams = {e["tid"]: str(e["args"].get("name", "")) for e in events  # tid -> stream name
             if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("pid") == gpu[0]
             and str(e["args"].get("name", "")).startswith("Stream")}
  on_streams = [e for e in events if e.get("ph") == "X" and e.get("pid") == gpu[0]
                and e.get("tid") in streams]
  kernels = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("name", ""))
                   for e in on_streams)
  if not kernels:
    return {}
  by_stream, by_name, copies, copy_args = {}, {}, {}, set()
  for e in on_streams:
    us, name = float(e.get("dur", 0)), e.get("name", "")[:80]
    by_stream[streams[e["tid"]]] = by_stream.get(streams[e["tid"]], 0.0) + us
    by_name[name] = by_name.get(name, 0.0) + us
    if name.startswith("Memcpy"):
      args = e.get("args", {})
      copy_args.update(args)
      key = (name, str(next((args[k] for k in COPY_OP_ARGS if k in args), "?"))[:160])
      n, t, nbytes = copies.get(key, (0, 0.0, 0))
      copies[key] = (n + 1, t + us, nbytes + _bytes(args))
  busy = idle = 0.0
  groups = {}
  start, end, last = kernels[0][0], kernels[0][1], kernels[0][2]
  for ts, te, name in kernels[1:]:
    if ts > end:                      # a hole in the union
      busy += end - start
      gap = ts - end
      idle += gap
      if gap >= min_us:
        key = (last[:80], name[:80])
        n, us = groups.get(key, (0, 0.0))
        groups[key] = (n + 1, us + gap)
      start, end, last = ts, te, name
    elif te >= end:
      end, last = te, name
  busy += end - start
  ranked = sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]
  not_copies = _union_us([(ts, te) for ts, te, name in kernels if not name.startswith("Memcpy")])
  return {"device_busy_ms_per_step": busy / 1e3 / steps,
          "device_idle_ms_per_step": idle / 1e3 / steps,
          "copy_only_ms_per_step": (busy - not_copies) / 1e3 / steps,
          "top_gaps": [{"ms_per_step": us / 1e3 / steps, "n": n, "before": b, "after": a}
                       for (b, a), (n, us) in ranked],
          "stream_ms_per_step": {k: us / 1e3 / steps for k, us in
                                 sorted(by_stream.items(), key=lambda kv: -kv[1])},
          "top_events": [{"ms_per_step": us / 1e3 / steps, "name": k} for k, us in
                         sorted(by_name.items(), key=lambda kv: -kv[1])[:top]],
          "top_copies": [{"ms_per_step": us / 1e3 / steps, "n_per_step": n / steps,
                          "mb_per_step": nbytes / 1e6 / steps, "kind": kind, "op": op}
                         for (kind, op), (n, us, nbytes) in
                         sorted(copies.items(), key=lambda kv: -kv[1][1])[:top]],
          "copy_arg_names": sorted(copy_args)}


def _union_us(intervals) -> float:
  """The length of the union of (start, end) intervals, sorted by start."""
  total, end = 0.0, float("-inf")
  for ts, te in intervals:
    if te > end:
      total += te - max(ts, end)
      end = te
  return total


# Trace-event arguments that name a copy's HLO op, in order of preference (xprof's GPU
# events carry the op as hlo_op, the thunk's name as long_name), and its size.
COPY_OP_ARGS = ("hlo_op", "long_name", "tf_op", "name")
COPY_BYTES_ARGS = ("num_bytes", "bytes_transferred", "memcpy_bytes")


def _bytes(args: dict) -> int:
  """A copy event's size in bytes from its trace arguments (0 where none says)."""
  for k in COPY_BYTES_ARGS:
    try:
      return int(args[k])
    except (KeyError, TypeError, ValueError):
      continue
  return 0
