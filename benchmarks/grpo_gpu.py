"""Gathers GRPO runs (scripts/grpo.py workdirs) into benchmarks/grpo_gpu.json and
grpo_gpu.md: one row per (task, seed, replay), the schema the post-training record keeps.

  python -m benchmarks.grpo_gpu --workdirs=/tmp/g_s0,/tmp/g_s0_noreplay,/tmp/g_s1 --out=$OUT

Per run (its config.json and summary.json) and task: seed (rl.seed), replay
(rl.routing_replay), n_heldout (held-out problems of that task: pass@1 draws them in turn
over the tasks), greedy and sampled pass@1 before and after GRPO, and from
metrics_grpo.jsonl the means over GRPO steps of route_mismatch (the training forward's own
top-k against the rollout's, on each batch's first pass), kl_rollout (the same pass's k3 KL
from the rollout policy) and clip_fraction; warmup_steps (where the warm-up's pass@1 checks
stopped it, rl.warmup_check_every); for tool tasks the greedy episodes that made the call
the problem needs (greedy_right_call_before/after); with date, commit and machine. Rows of other
(task, seed, replay) already in --out's JSON are kept. Curves: benchmarks/grpo_report.py.
"""

import json
import os

import numpy as np
from absl import app, flags

from benchmarks import provenance

FLAGS = flags.FLAGS


def _mean(rows: list[dict], key: str):
  vals = [r[key] for r in rows if key in r]
  return float(np.mean(vals)) if vals else None


def rows_of(workdir: str, stamp: dict) -> list[dict]:
  """The record rows of one finished scripts/grpo.py workdir."""
  c = json.load(open(os.path.join(workdir, "config.json")))
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  if "final" not in summary:
    raise ValueError(f"--workdirs: {workdir!r} has not finished (no final pass@1 in "
                     "summary.json)")
  train = [json.loads(line) for line in open(os.path.join(workdir, "metrics_grpo.jsonl"))
           if line.strip()]
  tasks = [t.strip() for t in c["data"]["tasks"].split(",") if t.strip()]
  n_eval = c["rl"]["eval_prompts"]
  before, after = summary["start"], summary["final"]
  gaps = {"route_mismatch": _mean(train, "route_mismatch/first_pass"),
          "kl_rollout": _mean(train, "kl_rollout/first_pass"),
          "clip_fraction": _mean(train, "clip_fraction")}
  return [{"task": t, "seed": c["rl"]["seed"], "replay": bool(c["rl"]["routing_replay"]),
           "n_heldout": len(range(i, n_eval, len(tasks))), "grpo_steps": summary["step"],
           # where the warm-up's pass@1 checks stopped it (None: its whole schedule ran)
           "warmup_steps": (summary.get("warmup_checks") or {}).get("stopped_at"),
           "greedy_pass1_before": before[f"pass@1/{t}"],
           "greedy_pass1_after": after[f"pass@1/{t}"],
           "sampled_pass1_before": before.get(f"pass@1_sampled/{t}"),
           "sampled_pass1_after": after.get(f"pass@1_sampled/{t}"),
           # tool tasks: greedy episodes that made the call the problem needs
           "greedy_right_call_before": before.get(f"right_call/{t}"),
           "greedy_right_call_after": after.get(f"right_call/{t}"),
           # an imperfect teacher's warm-up: greedy pass@1 on the prompts it gets wrong at
           # data.demo_mistake_rate, and the share of those episodes that are its mistake
           "demo_mistake_rate": c["data"].get("demo_mistake_rate", 0.0),
           "greedy_mistake_class_before": before.get(f"pass@1_mistake_class/{t}"),
           "greedy_mistake_class_after": after.get(f"pass@1_mistake_class/{t}"),
           "wrote_mistake_before": before.get(f"wrote_mistake/{t}"),
           "wrote_mistake_after": after.get(f"wrote_mistake/{t}"),
           **gaps, "workdir": os.path.basename(os.path.normpath(workdir)), **stamp}
          for i, t in enumerate(tasks)]


def markdown(rows: list[dict]) -> str:
  def f(v, digits=3):
    return "—" if v is None else f"{v:.2e}" if digits == "e" else f"{v:.{digits}f}"
  def span(r, key):
    a, b = r.get(f"{key}_before"), r.get(f"{key}_after")
    return "—" if a is None else f"{f(a)} → {f(b)}"
  lines = ["| task | seed | replay | held out | greedy pass@1 before → after (Δ) | "
           "sampled before → after | right call (greedy) before → after | teacher's mistake "
           "class: greedy pass@1 | wrote the mistake | route mismatch | KL from rollout | "
           "clip fraction | date, commit, machine |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in sorted(rows, key=lambda r: (r["task"], r["seed"], not r["replay"])):
    d = r["greedy_pass1_after"] - r["greedy_pass1_before"]
    lines.append(
        f"| {r['task']} | {r['seed']} | {'on' if r['replay'] else 'off'} | {r['n_heldout']} | "
        f"{f(r['greedy_pass1_before'])} → {f(r['greedy_pass1_after'])} ({d:+.3f}) | "
        f"{f(r['sampled_pass1_before'])} → {f(r['sampled_pass1_after'])} | "
        f"{span(r, 'greedy_right_call')} | {span(r, 'greedy_mistake_class')} | "
        f"{span(r, 'wrote_mistake')} | {f(r['route_mismatch'], 4)} | {f(r['kl_rollout'], 'e')} | "
        f"{f(r['clip_fraction'])} | {r.get('date')}, {r.get('commit')}, {r.get('machine')} |")
  return "\n".join(lines) + "\n"


def main(argv):
  del argv
  if not FLAGS.workdirs:
    raise app.UsageError("--workdirs: give at least one scripts/grpo.py workdir")
  stamp = provenance.stamp(FLAGS.machine)
  new = [row for w in FLAGS.workdirs for row in rows_of(w, stamp)]
  rows = provenance.merge_rows(os.path.join(FLAGS.out, "grpo_gpu.json"), new,
                               lambda r: (r["task"], r["seed"], r["replay"]))
  md = ("# GRPO on one GPU\n\n`configs/grpo.py:h200` runs, gathered by "
        "`python -m benchmarks.grpo_gpu`. Means over GRPO steps of each batch's first pass: "
        "route mismatch (the training forward's own top-k against the rollout's), KL from "
        "the rollout policy (k3), clip fraction. Curves: `grpo_gpu.png` (`python -m "
        "benchmarks.grpo_report`); each run's setting and per-step tables: `grpo.md`.\n\n"
        + markdown(rows) + "\n![curves](grpo_gpu.png)\n")
  with open(os.path.join(FLAGS.out, "grpo_gpu.md"), "w") as fh:
    fh.write(md)
  print(md)


def define_flags():
  """At run time, not import: tests import this module beside other tools' flags."""
  flags.DEFINE_list("workdirs", [], "scripts/grpo.py workdirs to gather.")
  flags.DEFINE_string("out", "benchmarks", "Where grpo_gpu.json and .md go.")
  flags.DEFINE_string("machine", "", "The machine the runs ran on (default: JAX's first "
                      "device).")


if __name__ == "__main__":
  define_flags()
  app.run(main)
