"""Curves and a table of GRPO runs side by side (benchmarks/grpo.md): reward, sampled
accuracy, held-out pass@1 per task (greedy and sampled), routing mismatch, clip fraction.

  python -m benchmarks.grpo_report --runs="replay on=workdir/grpo,replay off=workdir/grpo_noreplay" \
      --out=benchmarks/grpo.png
"""

import json
import os

import numpy as np
from absl import app, flags

_RUNS = flags.DEFINE_string("runs", None, "label=workdir, comma-separated.")
_OUT = flags.DEFINE_string("out", None, "PNG to write.")
_SMOOTH = flags.DEFINE_integer("smooth", 10, "Moving-average window for per-step curves.")


def _read(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _smooth(x, n):
  x = np.asarray(x, np.float64)
  if n <= 1 or len(x) < n:
    return x
  return np.convolve(x, np.ones(n) / n, mode="valid")


def main(argv):
  del argv
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  runs = [part.split("=", 1) for part in _RUNS.value.split(",")]
  fig, axes = plt.subplots(1, 5, figsize=(25, 4))
  rows = ["| run | steps | greedy pass@1, start → end | sampled pass@1, start → end | "
          "train accuracy, first 10 → last 10 steps | route mismatch, first pass (mean) | "
          "last pass (mean) | clip fraction (mean) | warm-up s | GRPO s |",
          "|---|---|---|---|---|---|---|---|---|---|"]
  for label, workdir in runs:
    train = _read(os.path.join(workdir, "metrics_grpo.jsonl"))
    evals = _read(os.path.join(workdir, "metrics_grpo_eval.jsonl"))
    with open(os.path.join(workdir, "summary.json")) as f:
      summary = json.load(f)
    steps = [m["step"] for m in train]
    n = _SMOOTH.value
    axes[0].plot(steps[n - 1:] if len(steps) >= n else steps,
                 _smooth([m["reward/mean"] for m in train], n), label=label)
    for ax, prefix in ((axes[1], "pass@1/"), (axes[2], "pass@1_sampled/")):
      for k in sorted(k for k in evals[0] if k.startswith(prefix) and not k.endswith("/mean")):
        ax.plot([e["step"] for e in evals], [e[k] for e in evals], "o-",
                label=f"{label}: {k.removeprefix(prefix)}")
    if "route_mismatch/last_pass" in train[0]:
      axes[3].plot(steps, [m["route_mismatch/first_pass"] for m in train], label=f"{label}: first pass")
      axes[3].plot(steps, [m["route_mismatch/last_pass"] for m in train], label=f"{label}: last pass")
    axes[4].plot(steps, [m["clip_fraction"] for m in train], label=label)
    start, end = summary["start"], summary.get("final", summary.get("latest"))

    def fmt(prefix):
      keys = sorted(k for k in start if k.startswith(prefix) and not k.endswith("/mean"))
      return ", ".join(f"{k.removeprefix(prefix)} {start[k]:.3f} → {end[k]:.3f}"
                       for k in keys) or "—"
    acc = [m["accuracy"] for m in train]
    mean = lambda k: np.mean([m[k] for m in train]) if k in train[0] else float("nan")
    rows.append(f"| {label} | {steps[-1]} | {fmt('pass@1/')} | {fmt('pass@1_sampled/')} | "
                f"{np.mean(acc[:10]):.3f} → {np.mean(acc[-10:]):.3f} | "
                f"{mean('route_mismatch/first_pass'):.4f} | {mean('route_mismatch/last_pass'):.4f} | "
                f"{mean('clip_fraction'):.4f} | {summary.get('warmup_s', float('nan')):.0f} | "
                f"{summary.get('grpo_s', float('nan')):.0f} |")
  for ax, title in zip(axes, (f"reward (mean over rollouts, {_SMOOTH.value}-step average)",
                              "held-out pass@1 (greedy)", "held-out pass@1 (sampled, mean of n)",
                              "routing mismatch (rollout vs training pass)", "clip fraction")):
    ax.set_title(title)
    ax.set_xlabel("GRPO step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(_OUT.value, dpi=110)
  print("\n".join(rows))


if __name__ == "__main__":
  flags.mark_flags_as_required(["runs", "out"])   # not at import (tests/test_scripts.py)
  app.run(main)
