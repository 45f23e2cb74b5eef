"""Metric logs: TensorBoard event files (tensorboardX) and a JSONL file, one line per write."""

import json
import os

import jax
import numpy as np
from tensorboardX import SummaryWriter


class MetricWriter:
  """Writes scalars to `<workdir>/tb/<name>` and `<workdir>/metrics_<name>.jsonl`.

  A vector value (e.g. an MoE layer's load per expert) becomes a TensorBoard histogram
  and a list in the JSONL line.
  """

  def __init__(self, workdir: str, name: str, tags: dict | None = None):
    self._tags = dict(tags or {})   # e.g. {"stage": "s1k"}: added to every JSONL line
    self._on = jax.process_index() == 0   # one writer in a multi-process run
    if self._on:
      self._tb = SummaryWriter(os.path.join(workdir, "tb", name))
      self._jsonl = open(os.path.join(workdir, f"metrics_{name}.jsonl"), "a")

  def write(self, step: int, scalars: dict):
    if not self._on:
      return
    row = {}
    for k, v in scalars.items():
      v = np.asarray(v, np.float64)
      if v.ndim:
        self._tb.add_histogram(k, v, step)
        row[k] = v.tolist()
      else:
        self._tb.add_scalar(k, float(v), step)
        row[k] = float(v)
    self._jsonl.write(json.dumps({"step": int(step), **self._tags, **row}) + "\n")
    self._jsonl.flush()

  def close(self):
    if not self._on:
      return
    self._tb.close()
    self._jsonl.close()
