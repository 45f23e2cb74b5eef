"""Staged context extension as one command: every stage (configs/stages.py), then a control
run straight at the final length with the same tokens, then the extrapolation evals of both.

  python scripts/extend_context.py --config=configs/stages.py:cpu --workdir=workdir/stages

  python scripts/extend_context.py ... --nostaged     # only the control run and its evals

Resumable: run it again after a kill and it continues the unfinished stage (or the control
run) from its last checkpoint and skips what is complete. Writes, in --workdir:
  stages.json               this config (the last invocation's)
  <stage>/, control/        each a normal training workdir (metrics tagged by stage)
  extrapolation.json        one row per (run, eval length)
  extrapolation_partial.json   the rows finished so far, while the evals run
  extrapolation.md          the tables, also printed at the end
  extrapolation.png         loss by length and by position, retrieval, attention entropy,
                            and the train loss against tokens seen
"""

import json
import os

from absl import app, flags, logging
from ml_collections import config_flags

from moe_jax import fields
from moe_jax.data import pipeline
from moe_jax.eval import extrapolation
from moe_jax.infer.workdir import load
from moe_jax.train import compile_cache, stages, xla_flags
from moe_jax.train.loop import train_and_evaluate

_CONFIG = config_flags.DEFINE_config_file("config", "configs/stages.py:cpu", "Stages config.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Stage workdirs and results go here.")
_STAGED = flags.DEFINE_bool("staged", True, "Train the stages (--nostaged: only the control "
                            "run, e.g. in a job or on a machine of its own).")
_CONTROL = flags.DEFINE_bool("control", True, "Also train the control run (final length only).")
_EVAL = flags.DEFINE_bool("eval", True, "Run the extrapolation evals at the end.")


def _lengths(sc) -> list[int]:
  """The eval lengths: multipliers × the last stage's length, above one chunk rounded down
  to whole chunks."""
  last, chunk = sc.stages[stages.stage_names(sc)[-1]].seq_len, sc.eval.chunk
  lengths = [int(float(m) * last) for m in sc.eval.multipliers.split(",")]
  return [L // chunk * chunk if L > chunk else L for L in lengths]


def _curve(run_dir: str) -> tuple[list[int], list[float]]:
  """(tokens seen, train loss) of one workdir's metrics_train.jsonl."""
  c = json.load(open(os.path.join(run_dir, "config.json")))
  per_step = c["data"]["seq_len"] * c["data"]["batch_size"]
  rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics_train.jsonl"))]
  rows = [r for r in rows if "loss" in r]
  return [r["step"] * per_step for r in rows], [r["loss"] for r in rows]


def _table(results: dict, trained: int) -> str:
  tasks = sorted({k.split("/")[0] for rows in results.values() for r in rows for k in r
                  if k.endswith("/row_acc")})
  head = ["run", "length", "× trained", "windows", "bits/byte"] + [
      f"{t} token / row acc" for t in tasks] + ["MLA entropy (normalised)"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for run, rows in results.items():
    for r in rows:
      ent = [v for k, v in r.items() if k.endswith("/entropy_normalised")]
      windows = f"{r['windows']}" + (" (joined)" if r.get("windows_joined") else "")
      cells = [run, str(r["length"]), f"{r['length'] / trained:g}", windows,
               f"{r['bits_per_byte']:.3f}" if "bits_per_byte" in r else "—"]
      cells += [f"{r[t + '/token_acc']:.2f} / {r[t + '/row_acc']:.2f}" for t in tasks]
      cells.append(f"{sum(ent) / len(ent):.3f}" if ent else "—")
      lines.append("| " + " | ".join(cells) + " |")
  lines += ["", "Bits/byte by position bucket (equal spans of each window):", ""]
  for run, rows in results.items():
    for r in rows:
      if "bits_by_bucket" in r:
        lines.append(f"* {run} @ {r['length']}: " + ", ".join(f"{b:.2f}"
                                                             for b in r["bits_by_bucket"]))
  return "\n".join(lines)


def _plot(results: dict, curves: dict, trained: int, path: str):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(2, 2, figsize=(11, 8))
  for run, rows in results.items():
    xs = [r["length"] for r in rows if "bits_per_byte" in r]
    ax[0, 0].plot(xs, [r["bits_per_byte"] for r in rows if "bits_per_byte" in r], "o-",
                  label=run)
    for r in rows:
      if "bits_by_bucket" in r and run == next(iter(results)):
        n = len(r["bits_by_bucket"])
        ax[0, 1].plot([(i + 0.5) / n for i in range(n)], r["bits_by_bucket"],
                      "o-", label=f"{run} @ {r['length']}")
    for task in ("passkey", "mqar"):
      if f"{task}/token_acc" in rows[0]:
        ax[1, 0].plot([r["length"] for r in rows], [r[f"{task}/token_acc"] for r in rows],
                      "o-", label=f"{run}: {task}")
  for run, (tok, loss) in curves.items():
    ax[1, 1].plot(tok, loss, label=run)
  for a in (ax[0, 0], ax[1, 0]):
    a.set_xscale("log", base=2)
    a.axvline(trained, color="gray", ls="--", lw=1)
  ax[0, 0].set(title="held-out bits/byte by eval length", xlabel="length")
  ax[0, 1].set(title="bits/byte by position (staged run)", xlabel="position / window length")
  ax[1, 0].set(title="retrieval token accuracy", xlabel="length", ylim=(-0.02, 1.02))
  ax[1, 1].set(title="train loss (nats/byte)", xlabel="tokens seen")
  for a in ax.flat:
    a.grid(alpha=0.3)
    a.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  if not (_STAGED.value or _CONTROL.value):
    raise app.UsageError("--nostaged --nocontrol leaves nothing to train or evaluate")
  sc, workdir = _CONFIG.value, _WORKDIR.value
  xla_flags.apply_config(sc.run.train, "run.train")   # before jax starts
  compile_cache.enable(sc.run.train.compile_cache_dir)
  names = stages.stage_names(sc)
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "stages.json"), "w") as f:   # what this invocation ran
    f.write(sc.to_json(indent=1))
  runs = {}
  if _STAGED.value:
    out = stages.run_stages(sc, workdir)
    if len(out) < len(names) or out[names[-1]]["step"] < sc.stages[names[-1]].steps:
      return  # stopped (SIGTERM): run again to resume
    runs["staged"] = os.path.join(workdir, names[-1])
  if _CONTROL.value:
    c = stages.control_config(sc)
    control_dir = os.path.join(workdir, "control")
    if not stages.is_complete(control_dir, c.schedule.total_steps):
      print(f"moe_jax: control run: seq_len {c.data.seq_len} × batch {c.data.batch_size}, "
            f"{c.schedule.total_steps} steps", flush=True)
      res = train_and_evaluate(c, control_dir)
      if res["step"] < c.schedule.total_steps:
        return
    runs["control"] = control_dir
  if not _EVAL.value:
    return
  docs = pipeline.text_documents(stages.stage_config(sc, names[-1]))["validation"]
  tasks = tuple(fields.synthetic_tasks(sc.run.data))
  depths = tuple(float(d) for d in sc.eval.get("passkey_depths", "").split(",") if d)
  # Each length's row is kept as it finishes (evals of long lengths can outlast a job), for
  # the same eval settings; a rerun evaluates only the lengths still missing.
  partial = os.path.join(workdir, "extrapolation_partial.json")
  done = json.load(open(partial)) if os.path.exists(partial) else {}
  if done.get("eval") != sc.eval.to_dict():
    done = {"eval": sc.eval.to_dict(), "runs": {}}
  # More retrieval rows at the final stage's length where eval.retrieval_rows_at_trained > 0.
  at_trained = sc.eval.get("retrieval_rows_at_trained", 0)
  rows_at = {L: at_trained if L == sc.stages[names[-1]].seq_len and at_trained > 0
             else sc.eval.retrieval_rows for L in _lengths(sc)}
  for run, run_dir in runs.items():
    rows = done["runs"].setdefault(run, [])
    todo = [L for L in _lengths(sc) if L not in {r["length"] for r in rows}]
    if not todo:
      continue
    c, variables, _ = load(run_dir)
    for row in extrapolation.evaluate_lengths(
        c.model, variables, docs, todo, chunk=sc.eval.chunk, buckets=sc.eval.buckets,
        max_windows=sc.eval.max_windows, retrieval_rows=rows_at,
        entropy_queries=sc.eval.entropy_queries, tasks=tasks, cfg_data=c.data,
        passkey_depths=depths):
      rows.append(row)
      with open(partial, "w") as f:
        json.dump(done, f, indent=1)
  results = {run: sorted(done["runs"][run], key=lambda r: r["length"]) for run in runs}
  with open(os.path.join(workdir, "extrapolation.json"), "w") as f:
    json.dump(results, f, indent=1)
  os.remove(partial)   # complete: a rerun evaluates afresh
  print(report(sc, workdir, results))



def report(sc, workdir: str, results: dict) -> str:
  """Writes extrapolation.md and extrapolation.png for finished runs; returns the table."""
  names = stages.stage_names(sc)
  trained = sc.stages[names[-1]].seq_len
  curves = {}
  if "staged" in results:
    # The staged curve continues across stages: offset each stage by the tokens before it.
    offset, staged = 0, ([], [])
    for name in names:
      tok, loss = _curve(os.path.join(workdir, name))
      staged[0].extend(t + offset for t in tok)
      staged[1].extend(loss)
      offset += sc.stages[name].steps * sc.stages[name].tokens_per_step
    curves["staged"] = staged
  if "control" in results:
    curves["control"] = _curve(os.path.join(workdir, "control"))
  _plot(results, curves, trained, os.path.join(workdir, "extrapolation.png"))
  table = _table(results, trained)
  with open(os.path.join(workdir, "extrapolation.md"), "w") as f:
    f.write(table + "\n")
  return table


if __name__ == "__main__":
  flags.mark_flag_as_required("workdir")   # not at import (tests/test_scripts.py)
  app.run(main)
