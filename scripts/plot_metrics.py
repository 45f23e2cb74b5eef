"""Plot a run's loss curve from its workdir's metric logs (metrics_train.jsonl, and
metrics_eval.jsonl when present): train loss and validation bits per byte against step.

  python scripts/plot_metrics.py --workdir=workdir/tiny --out=workdir/tiny/loss.png
  python scripts/plot_metrics.py --workdir=benchmarks/runs/long_context_1b_gpu \
      --out=benchmarks/long_context_1b_gpu_loss.png --unigram_bits=4.7601
"""

import json
import os

from absl import app, flags

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory with metrics_*.jsonl.")
_OUT = flags.DEFINE_string("out", None, "PNG to write.")
_TITLE = flags.DEFINE_string("title", "", "Plot title (default: the workdir's name).")
_UNIGRAM = flags.DEFINE_float("unigram_bits", None, "Draw the byte-unigram entropy line.")


def _read(path):
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def main(argv):
  del argv
  import matplotlib  # plotting only: not needed to train
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  train = _read(os.path.join(_WORKDIR.value, "metrics_train.jsonl"))
  evals = _read(os.path.join(_WORKDIR.value, "metrics_eval.jsonl"))
  if not train:
    raise ValueError(f"no metrics_train.jsonl lines in --workdir={_WORKDIR.value!r}")
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss (nats/byte)")
  if evals:
    ax.plot([r["step"] for r in evals], [r["bits_per_byte"] for r in evals], "o-",
            label="validation bits/byte")
  if _UNIGRAM.value is not None:
    ax.axhline(_UNIGRAM.value, color="gray", ls="--", label="byte-unigram entropy (bits/byte)")
  ax.set_xlabel("step")
  ax.set_title(_TITLE.value or os.path.basename(os.path.normpath(_WORKDIR.value)))
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(_OUT.value, dpi=120)
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["workdir", "out"])   # not at import (tests/test_scripts.py)
  app.run(main)
