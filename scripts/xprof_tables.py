"""Per-op device time of a JAX profiler trace, from xprof's hlo_stats tool (best effort:
xprof is optional on the GPU machine)."""

import glob
import json
import os


def hlo_op_table(trace_dir: str, title: str, top: int = 25) -> str:
  """Writes hlo_stats.json / kernel_stats.json next to the trace and returns a markdown
  table of the `top` ops by self time."""
  from xprof.convert import raw_to_tool_data
  paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
  for tool in ("hlo_stats", "kernel_stats"):
    data, _ = raw_to_tool_data.xspace_to_tool_data(paths, tool, {})
    with open(os.path.join(trace_dir, f"{tool}.json"), "w" if isinstance(data, str) else "wb") as f:
      f.write(data)
  table = json.loads(open(os.path.join(trace_dir, "hlo_stats.json")).read())
  cols = [c["id"] for c in table["cols"]]
  rows = [dict(zip(cols, [x.get("v") if x else None for x in r["c"]])) for r in table["rows"]]
  rows.sort(key=lambda r: -(r.get("total_self_time") or 0))
  lines = [f"| HLO op ({title}) | category | n | self µs | framework op |", "|---|---|---|---|---|"]
  for r in rows[:top]:
    lines.append(f"| {r['hlo_op_name']} | {r['category']} | {r['occurrences']} | "
                 f"{r['total_self_time']:.0f} | {str(r['tf_op_name'])[-70:]} |")
  # Per kernel as well: hlo_stats can come back empty on GPU (seen for Pallas-only programs).
  table = json.loads(open(os.path.join(trace_dir, "kernel_stats.json")).read())
  cols = [c["id"] for c in table["cols"]]
  rows = [dict(zip(cols, [x.get("v") if x else None for x in r["c"]])) for r in table["rows"]]
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
