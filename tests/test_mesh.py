"""Mesh construction, and data/fsdp-sharded training equal to one device."""

import json
import subprocess
import sys

import ml_collections
import pytest

from moe_jax.parallel.mesh import axis_sizes
from tests.conftest import ROOT, cpu_devices_env


def _mesh_cfg(**sizes):
  return ml_collections.ConfigDict({"data": -1, "fsdp": 1, "expert": 1, "sequence": 1,
                                    "tensor": 1, **sizes})


def test_axis_sizes():
  assert axis_sizes(_mesh_cfg(), 8) == (8, 1, 1, 1, 1)
  assert axis_sizes(_mesh_cfg(fsdp=2, tensor=2), 8) == (2, 2, 1, 1, 2)
  assert axis_sizes(_mesh_cfg(data=2, expert=4), 8) == (2, 1, 4, 1, 1)
  with pytest.raises(ValueError, match="fixed axes \\(3\\) must divide the device count 8"):
    axis_sizes(_mesh_cfg(fsdp=3), 8)
  with pytest.raises(ValueError, match="has 4 devices, but 8 are available"):
    axis_sizes(_mesh_cfg(data=2, fsdp=2), 8)


_RUN = """
import json, sys
from tests.conftest import make_small_config
from moe_jax.train.loop import train_and_evaluate
c = make_small_config()
c.schedule.total_steps = 5
c.checkpoint.every_steps = 100
c.mesh.data, c.mesh.fsdp, c.mesh.expert, c.mesh.sequence = (int(a) for a in sys.argv[1:5])
out = train_and_evaluate(c, sys.argv[5], progress=False)
print("LOSSES", json.dumps([l for _, l in out["history"]]))
"""


def _losses(tmp_path, data, fsdp, devices, expert=1, sequence=1):
  env = cpu_devices_env(devices)
  proc = subprocess.run([sys.executable, "-c", _RUN, str(data), str(fsdp), str(expert),
                         str(sequence), str(tmp_path / f"{data}x{fsdp}x{expert}x{sequence}")],
                        env=env,
                        capture_output=True, text=True, cwd=ROOT, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("LOSSES")][0]
  return json.loads(line.split(" ", 1)[1])


_RUN_PROCESS = """
import json, sys
from moe_jax.parallel import distributed
assert distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
from tests.conftest import make_small_config
from moe_jax.train.loop import train_and_evaluate
c = make_small_config()
c.schedule.total_steps = 5
c.checkpoint.every_steps = 100
c.mesh.data, c.mesh.fsdp, c.mesh.expert = (int(a) for a in sys.argv[4:7])
first = train_and_evaluate(c, sys.argv[3], progress=False, stop_after=3)
second = train_and_evaluate(c, sys.argv[3], progress=False)
print("LOSSES", json.dumps([l for _, l in first["history"] + second["history"]]),
      second["resumed_from"])
"""


def _two_process_losses(tmp_path, data=2, fsdp=2, expert=1):
  """A data × fsdp × expert mesh over two processes of two CPU devices each
  (jax.distributed, gloo); each trains steps 1-3, checkpoints (orbax, both processes), then
  resumes to step 5."""
  import socket
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  workdir = tmp_path / f"two_processes_{data}x{fsdp}x{expert}"
  procs = [subprocess.Popen([sys.executable, "-c", _RUN_PROCESS, f"localhost:{port}", str(i),
                             str(workdir), str(data), str(fsdp), str(expert)],
                            env=cpu_devices_env(2), cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
  outs = [p.communicate(timeout=600) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  lines = [[l for l in out.splitlines() if l.startswith("LOSSES")][0] for out, _ in outs]
  assert lines[0] == lines[1]   # both processes see the same global losses
  losses, resumed_from = lines[0].split(" ", 1)[1].rsplit(" ", 1)
  assert resumed_from == "3"
  # Process 0 alone wrote the metrics: one line per logged step, steps 1-5.
  steps = [json.loads(l)["step"] for l in open(workdir / "metrics_train.jsonl")]
  assert steps == [1, 2, 3, 4, 5]
  return json.loads(losses)


@pytest.mark.slow
def test_sharded_training_equals_one_device(tmp_path):
  """On fake CPU devices, the same 5 losses as one device (the small config has an MoE
  layer) from: data=2 × fsdp=2 over two processes (each loading its half of every batch,
  stopped at step 3 and resumed from the checkpoint both wrote), and expert=2 × sequence=4
  on 8 (experts sharded, tokens moved by all-to-all; time sharded: ring attention for MLA,
  state passing for KDA; one run for both, as each alone took as long), and expert=4 over
  the two processes (the all-to-all crossing them)."""
  one = _losses(tmp_path, 1, 1, 1)
  assert len(one) == 5
  two = _two_process_losses(tmp_path)
  assert len(two) == 5
  for a, b in zip(one, two):
    assert abs(a - b) <= 1e-4 * abs(b), ("two processes", one, two)
  sharded = _losses(tmp_path, 1, 1, 8, expert=2, sequence=4)
  assert len(sharded) == 5
  for a, b in zip(one, sharded):
    assert abs(a - b) <= 1e-4 * abs(b), ("expert=2 × sequence=4", one, sharded)
  # Expert parallelism across the two processes: the expert axis spans all four devices,
  # so the dropless all-to-all rounds cross processes (gloo).
  across = _two_process_losses(tmp_path, data=1, fsdp=1, expert=4)
  for a, b in zip(one, across):
    assert abs(a - b) <= 1e-4 * abs(b), ("expert=4 over two processes", one, across)
