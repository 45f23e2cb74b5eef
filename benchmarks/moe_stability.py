"""The routing-stability experiment: standard vs latent MoE, each with and without
the routing kit (configs/experiments/moe_stability.py), over several seeds, on CPU.

  python -m benchmarks.moe_stability --out=benchmarks      # 4 arms × 3 seeds × 200 steps
  python -m benchmarks.moe_stability --out=benchmarks --lr=3e-2

Writes <out>/moe_stability_lr<lr>.json (every run's curves), appends a table to
<out>/moe_stability.md and draws <out>/moe_stability_lr<lr>.png (loss, routing fluctuation
and MaxVio per arm, mean over seeds).
"""

import json
import math
import os
import statistics
import tempfile
import time

from absl import app, flags

from configs.experiments import moe_stability
from moe_jax.train.loop import train_and_evaluate

_ARMS = flags.DEFINE_list("arms", list(moe_stability.ARMS), "Arms (configs/experiments/moe_stability.py).")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds (config.seed) per arm.")
_STEPS = flags.DEFINE_integer("steps", 200, "Train steps per run.")
_LOG_EVERY = flags.DEFINE_integer("log_every", 5, "Steps between logged points.")
_LR = flags.DEFINE_float("lr", None, "Learning rate (default: the config's, 1e-2).")
_OUT = flags.DEFINE_string("out", "benchmarks", "Where moe_stability.{json,md,png} go.")
_FROM_JSON = flags.DEFINE_string("from_json", None, "Only report: the table and plot of the "
                                 "runs in this JSON (of --arms), e.g. after an interrupted run.")


def run(arm: str, seed: int) -> dict:
  c = moe_stability.get_config(arm)
  c.seed = seed
  c.schedule.total_steps = c.eval.every_steps = c.checkpoint.every_steps = _STEPS.value
  c.log.every_steps = _LOG_EVERY.value
  if _LR.value:
    c.optim.learning_rate = _LR.value
  t = time.time()
  workdir = tempfile.mkdtemp(prefix=f"stab_{arm}_{seed}_")
  r = train_and_evaluate(c, workdir, progress=False)
  with open(os.path.join(workdir, "metrics_train.jsonl")) as f:
    logged = [json.loads(line) for line in f]
  return {"arm": arm, "seed": seed, "lr": c.optim.learning_rate, "wall_s": time.time() - t,
          "val_bits_per_byte": r["val_bits_per_byte"], "skipped_updates": r["skipped_updates"],
          "loss": r["history"], "max_vio": r["max_vio_history"],
          "fluctuation": r["route_fluctuation_history"],
          "router_grad_norm": [(m["step"], m["router_grad_norm"]) for m in logged
                               if "router_grad_norm" in m]}


def _mean(points, lo, hi):
  vals = [v for s, v in points if lo <= s <= hi]
  return statistics.mean(vals) if vals else float("nan")


def _spike(points):
  """Largest rise of the train loss above its running minimum after step 50."""
  best, worst = float("inf"), 0.0
  for s, v in points:
    if s > 50:
      worst = max(worst, v - best)
    best = min(best, v)
  return worst


def summary(runs: list[dict]) -> str:
  steps = _STEPS.value
  rows = ["| arm | seeds | final val bits/byte | fluctuation, steps ≤ 50 | fluctuation, last 50 "
          "| MaxVio, last 50 | MaxVio peak | worst loss rise after step 50 | skipped updates "
          "| router grad norm, max |",
          "|---|---|---|---|---|---|---|---|---|---|"]
  for arm in _ARMS.value:
    rs = [r for r in runs if r["arm"] == arm]
    col = lambda f: [f(r) for r in rs]
    fmt = lambda xs, d=3: (f"{statistics.mean(xs):.{d}f} ± {statistics.stdev(xs):.{d}f}"
                           if len(xs) > 1 else f"{xs[0]:.{d}f}")
    rows.append(
        f"| {arm} | {len(rs)} | {fmt(col(lambda r: r['val_bits_per_byte']), 4)} | "
        f"{fmt(col(lambda r: _mean(r['fluctuation'], 0, 50)))} | "
        f"{fmt(col(lambda r: _mean(r['fluctuation'], steps - 50, steps)))} | "
        f"{fmt(col(lambda r: _mean(r['max_vio'], steps - 50, steps)))} | "
        f"{fmt(col(lambda r: max(v for _, v in r['max_vio'])))} | "
        f"{fmt(col(lambda r: _spike(r['loss'])))} | "
        f"{sum(col(lambda r: r['skipped_updates']))} | "
        + (fmt(col(lambda r: max(v for _, v in r["router_grad_norm"] if math.isfinite(v))))
           if all(r.get("router_grad_norm") for r in rs) else "—") + " |")
  per_seed = ["", "Final validation bits/byte per seed:", ""]
  for arm in _ARMS.value:
    per_seed.append(f"* {arm}: " + ", ".join(
        f"seed {r['seed']} {r['val_bits_per_byte']:.4f}" for r in runs if r["arm"] == arm))
  return "\n".join(rows + per_seed) + "\n"


def plot(runs: list[dict], path: str):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  for arm in _ARMS.value:
    rs = [r for r in runs if r["arm"] == arm]
    for ax, key in zip(axes, ("loss", "fluctuation", "max_vio")):
      steps = [s for s, _ in rs[0][key]]
      mean = [statistics.mean(dict(r[key]).get(s, float("nan")) for r in rs) for s in steps]
      ax.plot(steps, mean, label=arm)
  for ax, title in zip(axes, ("train loss", "routing fluctuation (top-k sets changed per step)",
                              "MaxVio (mean over MoE layers)")):
    ax.set_title(title)
    ax.set_xlabel("step")
  axes[0].set_ylim(top=4.0)
  axes[0].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv):
  del argv
  os.makedirs(_OUT.value, exist_ok=True)
  if _FROM_JSON.value:
    with open(_FROM_JSON.value) as f:
      runs = [r for r in json.load(f) if r["arm"] in _ARMS.value]
    return report(runs)
  runs = []
  for arm in _ARMS.value:
    for seed in map(int, _SEEDS.value):
      runs.append(run(arm, seed))
      r = runs[-1]
      print(f"{arm} seed {seed}: {r['val_bits_per_byte']:.4f} bits/byte, "
            f"{r['skipped_updates']} skipped, {r['wall_s']:.0f} s", flush=True)
      with open(os.path.join(_OUT.value, f"moe_stability_lr{r['lr']:g}.json"), "w") as f:
        json.dump(runs, f)
  report(runs)


def report(runs):
  md = summary(runs)
  seeds = len({r["seed"] for r in runs})
  with open(os.path.join(_OUT.value, "moe_stability.md"), "a") as f:
    f.write(f"\n## {time.strftime('%Y-%m-%d')}: {seeds} seeds × {_STEPS.value} steps, "
            f"learning rate {runs[0]['lr']:g}, arms {', '.join(_ARMS.value)}\n\n" + md)
  plot(runs, os.path.join(_OUT.value, f"moe_stability_lr{runs[0]['lr']:g}.png"))
  print(md)


if __name__ == "__main__":
  app.run(main)
