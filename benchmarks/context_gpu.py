"""Gathers staged-extension runs (scripts/extend_context.py workdirs) into
benchmarks/context_gpu.json and context_gpu.md (+ .png): one row per (run, seed, eval
length), the schema the long-context record keeps.

  python -m benchmarks.context_gpu --workdirs=/tmp/st_s0,/tmp/st_s1,/tmp/rope_s0 --out=$OUT

A workdir's staged run is `staged` (NoPE) or `rope` (model.mla_rope_theta > 0); its
control run, trained straight at the final length on the same tokens, is `direct` (or
`rope_direct`). The seed is the run config's `seed`. Rows: run, seed, trained_len,
eval_len, passkey_acc (all answer digits right, random key depth), passkey_acc_by_depth,
mqar_acc, passkey_token_acc and mqar_token_acc (the share of answer tokens right: an MQAR
row needs every one of its pairs), bits_per_byte, bits_by_bucket, windows (windows_joined:
the held-out documents joined, no one of them that long), retrieval_rows (per task and
depth, as the eval recorded it), with date, commit and machine. Rows of other (run, seed)
pairs already in --out's JSON are kept.
"""

import json
import os

from absl import app, flags

from benchmarks import provenance

FLAGS = flags.FLAGS


def _last_stage_config(workdir: str) -> dict:
  """The config of the longest stage, or of the control run where it ran alone (--nostaged):
  both train at the final length with the run's seed and model."""
  names = [n for n in os.listdir(workdir) if os.path.isdir(os.path.join(workdir, n))
           and os.path.exists(os.path.join(workdir, n, "config.json"))]
  configs = [json.load(open(os.path.join(workdir, n, "config.json")))
             for n in (sorted(set(names) - {"control"}) or names)]
  if not configs:
    raise ValueError(f"--workdirs: {workdir!r} has no stage or control run with a config.json")
  return max(configs, key=lambda c: c["data"]["seq_len"])


def rows_of(workdir: str, stamp: dict) -> list[dict]:
  """The record rows of one extend_context.py workdir."""
  path = os.path.join(workdir, "extrapolation.json")
  if os.path.exists(path):
    runs = json.load(open(path))
  elif os.path.exists(partial := os.path.join(workdir, "extrapolation_partial.json")):
    # The lengths whose evals finished before the job ended (the longest can outlast it).
    runs = json.load(open(partial))["runs"]
    print(f"{workdir}: evals unfinished; the lengths done: "
          f"{ {run: [r['length'] for r in rs] for run, rs in runs.items()} }")
  else:
    raise ValueError(f"--workdirs: {workdir!r} has no extrapolation.json or "
                     "extrapolation_partial.json (evals not run)")
  c = _last_stage_config(workdir)
  rope = bool(c["model"].get("mla_rope_theta", 0.0))
  names = {"staged": "rope" if rope else "staged", "control": "rope_direct" if rope else "direct"}
  trained = c["data"]["seq_len"]
  out = []
  for run, results in runs.items():
    for r in results:
      depths = {k.split("@")[1].split("/")[0]: v for k, v in r.items()
                if k.startswith("passkey@") and k.endswith("/row_acc")}
      out.append({"run": names[run], "seed": c["seed"], "trained_len": trained,
                  "eval_len": r["length"], "passkey_acc": r.get("passkey/row_acc"),
                  "passkey_acc_by_depth": depths, "mqar_acc": r.get("mqar/row_acc"),
                  # per answer token: MQAR's row needs all of its pairs' answers right
                  "passkey_token_acc": r.get("passkey/token_acc"),
                  "mqar_token_acc": r.get("mqar/token_acc"),
                  "bits_per_byte": r.get("bits_per_byte"),
                  "bits_by_bucket": r.get("bits_by_bucket"),
                  "retrieval_rows": r.get("retrieval_rows"),
                  "windows": r.get("windows"), "windows_joined": r.get("windows_joined"),
                  **stamp})
  return out


def _windows(r: dict) -> str:
  if r.get("windows") is None:
    return "—"
  return f"{r['windows']}" + (" joined" if r.get("windows_joined") else "")


def markdown(rows: list[dict]) -> str:
  depths = sorted({d for r in rows for d in r["passkey_acc_by_depth"]}, key=float)
  head = (["run", "seed", "trained", "eval length", "× trained", "passkey"]
          + [f"passkey @ {d}" for d in depths]
          + ["MQAR", "MQAR answer tokens", "bits/byte", "text windows", "rows per task",
             "date, commit, machine"])
  fmt = lambda v: "—" if v is None else f"{v:.3f}"
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in sorted(rows, key=lambda r: (r["run"], r["seed"], r["eval_len"])):
    lines.append("| " + " | ".join(
        [r["run"], str(r["seed"]), str(r["trained_len"]), str(r["eval_len"]),
         f"{r['eval_len'] / r['trained_len']:g}", fmt(r["passkey_acc"])]
        + [fmt(r["passkey_acc_by_depth"].get(d)) for d in depths]
        + [fmt(r["mqar_acc"]), fmt(r.get("mqar_token_acc")), fmt(r["bits_per_byte"]),
           _windows(r),
           str(r.get("retrieval_rows") or "—"),
           f"{r['date']}, {r['commit']}, {r['machine']}"]) + " |")
  return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(1, 3, figsize=(14, 4))
  runs = sorted({(r["run"], r["seed"]) for r in rows})
  for run, seed in runs:
    rs = sorted((r for r in rows if (r["run"], r["seed"]) == (run, seed)),
                key=lambda r: r["eval_len"])
    x = [r["eval_len"] for r in rs]
    for a, key in zip(ax, ("passkey_acc", "mqar_acc", "bits_per_byte")):
      y = [r[key] for r in rs]
      if any(v is not None for v in y):
        a.plot(x, [float("nan") if v is None else v for v in y], "o-",
               label=f"{run} (seed {seed})")
  for a, title in zip(ax, ("passkey (all digits right)", "MQAR (row)", "held-out bits/byte")):
    a.set(title=title, xlabel="eval length (tokens)")
    if "bits" not in title:
      a.set_ylim(-0.02, 1.02)
    a.set_xscale("log", base=2)
    a.grid(alpha=0.3)
    a.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv):
  del argv
  if not FLAGS.workdirs:
    raise app.UsageError("--workdirs: give at least one extend_context.py workdir")
  stamp = provenance.stamp(FLAGS.machine)
  new = [row for w in FLAGS.workdirs for row in rows_of(w, stamp)]
  rows = provenance.merge_rows(os.path.join(FLAGS.out, "context_gpu.json"), new,
                               lambda r: (r["run"], r["seed"]))
  md = ("# Staged context extension on one GPU\n\n`configs/stages.py:h200` runs "
        "(`scripts/extend_context.py`), gathered by `python -m benchmarks.context_gpu`; each "
        "row names its date, commit and machine. passkey: every answer digit right, key at a "
        "random depth; passkey @ d: the key at depth d of the filler (0 = a whole context "
        "away from the question); MQAR: every answer right; MQAR answer tokens: the share of "
        "answer tokens right (— where a run predates it); each over `rows per task` rows. "
        "bits/byte: held-out text in `text windows` windows of the eval length, inside one "
        "document or, where none is that long, the held-out documents joined.\n\n"
        + markdown(rows) + "\n![curves](context_gpu.png)\n")
  with open(os.path.join(FLAGS.out, "context_gpu.md"), "w") as f:
    f.write(md)
  plot(rows, os.path.join(FLAGS.out, "context_gpu.png"))
  print(md)


def define_flags():
  """At run time, not import: tests import this module beside other tools' flags."""
  flags.DEFINE_list("workdirs", [], "extend_context.py workdirs to gather.")
  flags.DEFINE_string("out", "benchmarks", "Where context_gpu.json/.md/.png go.")
  flags.DEFINE_string("machine", "", "The machine the runs ran on (default: JAX's first "
                      "device).")


if __name__ == "__main__":
  define_flags()
  app.run(main)
