"""Metric logs: TensorBoard event files (tensorboardX) and a JSONL file, one line per write."""

import json
import os

import numpy as np
from tensorboardX import SummaryWriter


class MetricWriter:
  """Writes scalars to `<workdir>/tb/<name>` and `<workdir>/metrics_<name>.jsonl`."""

  def __init__(self, workdir: str, name: str):
    self._tb = SummaryWriter(os.path.join(workdir, "tb", name))
    self._jsonl = open(os.path.join(workdir, f"metrics_{name}.jsonl"), "a")

  def write(self, step: int, scalars: dict):
    scalars = {k: float(np.asarray(v)) for k, v in scalars.items()}
    for k, v in scalars.items():
      self._tb.add_scalar(k, v, step)
    self._jsonl.write(json.dumps({"step": int(step), **scalars}) + "\n")
    self._jsonl.flush()

  def close(self):
    self._tb.close()
    self._jsonl.close()
