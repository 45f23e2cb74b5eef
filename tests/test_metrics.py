"""Metric logs: TensorBoard event files and JSONL lines, written without importing torch."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np

from moe_jax.train import metrics
from tests.conftest import ROOT


def test_writer_writes_scalars_and_histograms(tmp_path):
  w = metrics.MetricWriter(str(tmp_path), "train", {"stage": "s1"})
  w.write(3, {"loss": np.float32(2.5), "moe/load": np.array([0.25, 0.75])})
  w.close()
  (line,) = (tmp_path / "metrics_train.jsonl").read_text().splitlines()
  assert json.loads(line) == {"step": 3, "stage": "s1", "loss": 2.5, "moe/load": [0.25, 0.75]}
  events = list((tmp_path / "tb" / "train").glob("events.out.tfevents.*"))
  assert len(events) == 1 and events[0].stat().st_size > 100


def test_metric_logs_do_not_import_torch(tmp_path):
  """tensorboardX's writer imports torch where it is installed (2.7 s on the H200 machine);
  metrics.py keeps it out, and a later `import torch` still works. A stand-in torch package
  marks a file when imported."""
  fake = tmp_path / "site" / "torch"
  fake.mkdir(parents=True)
  mark = tmp_path / "torch_imported"
  (fake / "__init__.py").write_text(f"open({str(mark)!r}, 'w').close()\nTensor = object\n")
  script = textwrap.dedent(f"""
      import os, sys
      from moe_jax.train import metrics
      w = metrics.MetricWriter({str(tmp_path / 'run')!r}, "train")
      w.write(0, {{"loss": 1.0}})
      w.close()
      assert "torch" not in sys.modules, "metrics imported torch"
      assert not os.path.exists({str(mark)!r}), "torch was imported"
      import torch
      assert os.path.exists({str(mark)!r}), "a later import of torch did not run it"
      print("ok")
  """)
  path = [str(tmp_path / "site"), ROOT] + os.environ.get("PYTHONPATH", "").split(os.pathsep)
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p),
         "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
