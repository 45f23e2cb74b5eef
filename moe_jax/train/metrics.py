"""Metric logs: TensorBoard event files (tensorboardX) and a JSONL file, one line per write."""

import json
import os
import sys

import jax
import numpy as np


def _summary_writer_class():
  """tensorboardX.SummaryWriter, imported without torch. tensorboardX's writer imports torch
  when it is installed, only to accept torch tensors (we pass numpy): on the H200 machine
  that was 2.7 s of a 6.2 s import, on the path to every run's first step. A process that
  has imported torch already keeps it."""
  hold_out = "torch" not in sys.modules
  if hold_out:
    sys.modules["torch"] = None   # `import torch` raises ImportError while this is set
  try:
    from tensorboardX import SummaryWriter  # noqa: PLC0415
  finally:
    if hold_out:
      del sys.modules["torch"]    # later imports of torch work as usual
  return SummaryWriter


SummaryWriter = _summary_writer_class()


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
