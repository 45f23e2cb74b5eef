"""The multimodal run against its text-only control (benchmarks/multimodal.md): held-out digit
and chart-QA answer accuracy over training, text bits/byte of both runs, and each MoE layer's
expert load on image patches vs text as a plot.

  python -m benchmarks.multimodal_report --run=workdir/mm --control=workdir/mm_text \\
      --out=benchmarks/multimodal.png
"""

import json
import os

import numpy as np
from absl import app, flags

_RUN = flags.DEFINE_string("run", None, "Workdir of configs/multimodal.py:cpu.")
_CONTROL = flags.DEFINE_string("control", None, "Workdir of :text_control.")
_OUT = flags.DEFINE_string("out", None, "PNG to write.")


def _read(workdir, name):
  with open(os.path.join(workdir, name)) as f:
    return [json.loads(line) for line in f if line.strip()]


def main(argv):
  del argv
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  evals = _read(_RUN.value, "metrics_eval.jsonl")
  control = _read(_CONTROL.value, "metrics_eval.jsonl")
  last = evals[-1]
  layers = sorted({k.split("/")[2] for k in last if k.startswith("digits/moe/")})
  fig, axes = plt.subplots(1, 1 + len(layers), figsize=(5 * (1 + len(layers)), 3.8))
  steps = [e["step"] for e in evals]
  axes[0].plot(steps, [e["digits/accuracy"] for e in evals], "o-", label="digits (held out)")
  axes[0].plot(steps, [e["charts/accuracy"] for e in evals], "s-", label="chart QA (held out)")
  axes[0].set(xlabel="step", ylabel="answer accuracy", ylim=(0, 1), title="image tasks")
  axes[0].legend()
  print("| layer | TV distance: image patches vs stdlib text | patches vs caption text, "
        "digits split | patches vs question text, charts split |")
  print("|---|---|---|---|")
  for ax, layer in zip(axes[1:], layers):
    # Image load from the image splits' patches, text load from the stdlib validation text.
    image = np.add(last[f"digits/moe/{layer}/load_image"], last[f"charts/moe/{layer}/load_image"]) / 2
    text = np.asarray(last[f"moe/{layer}/load_text"])
    x = np.arange(len(text))
    ax.bar(x - 0.2, image, 0.4, label="image patches")
    ax.bar(x + 0.2, text, 0.4, label="stdlib text")
    ax.set(xlabel="expert", ylabel="share of assignments", title=f"{layer}, step {last['step']}")
    ax.legend()
    print(f"| {layer} | {0.5 * np.abs(image - text).sum():.3f} | "
          f"{last[f'digits/moe/{layer}/modality_tv']:.3f} | "
          f"{last[f'charts/moe/{layer}/modality_tv']:.3f} |")
  fig.tight_layout()
  fig.savefig(_OUT.value, dpi=110)
  print()
  print("| run | steps | text bits/byte (stdlib validation) | digits accuracy | chart QA accuracy |")
  print("|---|---|---|---|---|")
  print(f"| multimodal | {last['step']} | {last['bits_per_byte']:.4f} | "
        f"{last['digits/accuracy']:.4f} | {last['charts/accuracy']:.4f} |")
  print(f"| text only, same text tokens | {control[-1]['step']} | "
        f"{control[-1]['bits_per_byte']:.4f} | | |")
  ratio = last["bits_per_byte"] / control[-1]["bits_per_byte"]
  print(f"\ntext bits/byte ratio multimodal / text-only: {ratio:.4f} ({100 * (ratio - 1):+.1f}%)")


if __name__ == "__main__":
  flags.mark_flags_as_required(["run", "control", "out"])   # not at import (tests/test_scripts.py)
  app.run(main)
