"""Training survives faults, each injected for real: an unreadable newest checkpoint, SIGTERM,
a loss spike from a poisoned batch, and a disk that refuses the checkpoint's files."""

import json
import os
import signal
import subprocess
import sys
import time

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from moe_jax.data import pipeline
from moe_jax.model.transformer import HybridMoE
from moe_jax.train import checkpoint, optim, state as state_lib
from moe_jax.train.guard import DivergenceGuard
from moe_jax.train.loop import train_and_evaluate
from tests.conftest import ROOT, make_small_config, subprocess_env


def _config(total_steps, every):
  c = make_small_config()
  c.schedule.total_steps, c.checkpoint.every_steps = total_steps, every
  c.checkpoint.max_to_keep = 10
  return c


def _truncate_files(folder):
  for root, _, files in os.walk(folder):
    for f in files:
      path = os.path.join(root, f)
      with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) // 2)


@pytest.mark.slow
def test_unreadable_newest_checkpoint_falls_back_to_the_previous(tmp_path, capsys):
  c = _config(8, 2)
  ckpts = tmp_path / "checkpoints"
  train_and_evaluate(c, str(tmp_path), progress=False, stop_after=6)   # saves 2, 4, 6
  _truncate_files(ckpts / "6" / "state")
  out = train_and_evaluate(c, str(tmp_path), progress=False)
  assert out["resumed_from"] == 4 and int(out["state"].step) == 8
  assert np.isfinite(out["val_loss"])
  assert "checkpoint step 6 is unreadable" in capsys.readouterr().out
  assert sorted(p.name for p in (tmp_path / "checkpoints_unreadable").iterdir()) == ["6"]
  assert sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) == [2, 4, 6, 8]

  for step in (2, 4, 6, 8):   # nothing readable: a ValueError naming every step tried
    _truncate_files(ckpts / str(step) / "state")
  with pytest.raises(ValueError, match=r"no readable checkpoint .*step 8: .*step 6: .*step 4: "
                                       r".*step 2: "):
    train_and_evaluate(c, str(tmp_path), progress=False)
  assert sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) == [2, 4, 6, 8]


_TRAIN = """
import sys
from moe_jax.train.loop import train_and_evaluate
from tests.test_faults import _config
out = train_and_evaluate(_config(40, 1000), sys.argv[1], progress=False)
print("PREEMPTED", out.get("preempted"))
"""


def test_a_step_already_saved_is_not_saved_again(tmp_path):
  # SIGTERM during the step (or eval) that ended with an interval save asks for that step
  # again at the next boundary; orbax raises StepAlreadyExistsError on a second save.
  manager = checkpoint.make_manager(str(tmp_path), _config(4, 2))
  data = iter(grain.MapDataset.range(10).batch(2))
  state = {"w": np.arange(3.0, dtype=np.float32)}
  assert checkpoint.save(manager, 2, state, data)
  assert not checkpoint.save(manager, 2, {"w": np.zeros(3, np.float32)}, data)
  checkpoint.finish(manager)
  assert manager.all_steps() == [2]
  restored = manager.restore(2, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(state)))
  np.testing.assert_array_equal(restored.state["w"], state["w"])
  manager.close()


@pytest.mark.slow
def test_sigterm_checkpoints_at_the_step_and_resumes_exactly(tmp_path):
  workdir = tmp_path / "preempted"
  proc = subprocess.Popen([sys.executable, "-c", _TRAIN, str(workdir)], cwd=ROOT,
                          env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
  metrics = workdir / "metrics_train.jsonl"
  deadline = time.time() + 300
  while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
    assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:]
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  stdout, stderr = proc.communicate(timeout=300)
  assert proc.returncode == 0, stderr[-3000:]
  stopped = int(stdout.split("PREEMPTED ")[1].split()[0])
  assert 3 <= stopped < 40
  steps = [int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()]
  assert steps == [stopped]

  resumed = train_and_evaluate(_config(40, 1000), str(workdir), progress=False)
  straight = train_and_evaluate(_config(40, 1000), str(tmp_path / "straight"), progress=False)
  assert resumed["resumed_from"] == stopped and int(resumed["state"].step) == 40
  for a, b in zip(jax.tree.leaves(resumed["state"].params),
                  jax.tree.leaves(straight["state"].params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
  assert resumed["val_loss"] == pytest.approx(straight["val_loss"], rel=1e-6)


def _poison(monkeypatch, is_bad):
  """Batches whose index passes `is_bad` get every target set to BOS (never a target in the
  corpus): a finite loss far above the healthy one."""
  real = pipeline.train_dataset

  def poisoned(source, c):
    def poison(i, batch):
      if not is_bad(i):
        return batch
      return {**batch, "targets": np.full_like(batch["targets"], 256),
              "loss_mask": np.ones_like(batch["loss_mask"])}
    return real(source, c).map_with_index(poison)

  monkeypatch.setattr(pipeline, "train_dataset", poisoned)


def _guarded(total_steps, max_rollbacks):
  c = _config(total_steps, 4)
  c.train.guard.update(enabled=True, spike_factor=1.25, ema_steps=2, warmup_steps=3,
                       skip_batches=1, max_rollbacks=max_rollbacks)
  return c


@pytest.mark.slow
def test_loss_spike_rolls_back_and_skips_the_batch(tmp_path, monkeypatch, capsys):
  _poison(monkeypatch, lambda i: i == 9)          # batch 9 trains step 10
  out = train_and_evaluate(_guarded(14, 2), str(tmp_path), progress=False)
  assert int(out["state"].step) == 14 and np.isfinite(out["val_loss"])
  rows = [json.loads(line) for line in open(tmp_path / "metrics_train.jsonl")]
  events = [r for r in rows if "guard/rollbacks" in r]
  assert [(e["step"], e["guard/rollback_to"], e["guard/skipped_batches"]) for e in events] == [
      (10, 8, 3)]                                 # batches 8, 9 (the poisoned one) and 10
  assert "rolled back to step 8 and skipped 3 batches" in capsys.readouterr().out
  # Steps 9-14 re-trained on clean batches, all well below the spike.
  after = [r["loss"] for r in rows[rows.index(events[0]) + 1:]]
  assert len(after) == 6 and max(after) < 0.8 * events[0]["guard/loss"]


def test_guard_counts_skipped_updates_in_a_row_from_the_restored_count():
  """A resumed run's count starts where the checkpoint left it: not a skip by itself."""
  g = _guarded(14, 1).train.guard
  g.update(max_skipped=3, warmup_steps=100)
  guard = DivergenceGuard(g)
  totals = [5, 5, 6, 7, 7, 8, 9, 10]              # skips at 3-4, then 6-8 (three in a row)
  fired = [guard.observe(i + 1, 4.0, t) for i, t in enumerate(totals)]
  assert [f is not None for f in fired] == [False] * 7 + [True]
  assert fired[-1].reason == "3 skipped (non-finite) updates in a row"


@pytest.mark.slow   # 15 s on 2 cores: rollbacks trained until the guard stops
def test_divergence_guard_stops_after_max_rollbacks(tmp_path, monkeypatch):
  _poison(monkeypatch, lambda i: i >= 9)    # every batch from 9 on: step 10, then step 9 again
  with pytest.raises(RuntimeError, match=r"divergence guard: loss .* at step 9, after 1 "
                                         r"rollbacks already \(train\.guard\.max_rollbacks\)"):
    train_and_evaluate(_guarded(14, 1), str(tmp_path), progress=False)


_FULL_DISK = """
import resource, signal, sys
from moe_jax.train import checkpoint
from moe_jax.train.loop import train_and_evaluate
from tests.test_faults import _config
train_and_evaluate(_config(8, 2), sys.argv[1], progress=False, stop_after=4)   # saves 2, 4
# Files may no longer grow past 256 KB, as on a full disk. (Mode bits would not stop root.)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 18, 1 << 18))
try:
  train_and_evaluate(_config(8, 2), sys.argv[1], progress=False)
except checkpoint.CheckpointSaveError as e:
  print("SAVE_ERROR", e)
"""


@pytest.mark.slow
def test_failed_save_stops_with_a_clear_error_and_keeps_earlier_checkpoints(tmp_path):
  proc = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path)], cwd=ROOT,
                        env=subprocess_env(), capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  # The async save of step 6 fails; the run stops at the next save, having written nothing.
  assert ("SAVE_ERROR saving a checkpoint (step 8, or an asynchronous save before it) in"
          in proc.stdout), proc.stdout
  assert "File too large" in proc.stdout and "Earlier checkpoints are untouched" in proc.stdout
  steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
  assert steps == [2, 4]
  c = _config(8, 2)
  example = {"tokens": np.zeros((1, 16), np.int32), "segment_ids": np.ones((1, 16), np.int32)}
  abstract = state_lib.abstract_train_state(
      HybridMoE(state_lib.frozen_model_config(c)), optim.make_optimizer(c), example,
      jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  for step in (2, 4):
    restored, got = checkpoint.restore_state(str(tmp_path / "checkpoints"), abstract, step)
    assert got == step and int(restored.step) == step
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(restored.params))
