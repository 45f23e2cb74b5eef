"""Training: loss goes down, resume is exact, non-finite gradients are skipped and counted."""

import json
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.data import pipeline
from moe_jax.model.transformer import HybridMoE
from moe_jax.parallel.mesh import make_mesh
from moe_jax.train import optim, schedule, state as state_lib, step as step_lib
from moe_jax.train.loop import train_and_evaluate
from tests.conftest import FAST_CPU_COMPILE, ROOT, subprocess_env, xla_flags_without


_TINY_RUN = """
import json, sys
from configs import tiny
from moe_jax.train.loop import train_and_evaluate
c = tiny.get_config()
c.schedule.total_steps = 30
c.log.every_steps = 1
c.eval.num_batches = 4
out = train_and_evaluate(c, sys.argv[1], progress=False)
print("OUT", json.dumps({k: out[k] for k in ("history", "max_vio_history", "val_bits_per_byte",
                                               "unigram_entropy_bits")}))
"""


@pytest.mark.slow
def test_tiny_training_lowers_loss(tmp_path):
  """30 steps of the real `tiny` (MoE) config (only logging/eval cadence changed). In a
  subprocess with XLA's optimised CPU code: its time is in running (0.9 s a step against
  2.3 at conftest's fast-compile flags; 94 → 72 s alone)."""
  env = subprocess_env(XLA_FLAGS=xla_flags_without(*FAST_CPU_COMPILE))
  proc = subprocess.run([sys.executable, "-c", _TINY_RUN, str(tmp_path)], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads([l for l in proc.stdout.splitlines() if l.startswith("OUT ")][0][4:])
  losses = [l for _, l in out["history"]]
  assert len(losses) == 30 and np.isfinite(losses).all()
  first, last = np.mean(losses[:3]), np.mean(losses[-3:])
  assert first > 5.0          # ≈ ln(259) or worse at init
  assert last < first - 2.5   # 30 steps remove at least 2.5 nats/token
  assert out["val_bits_per_byte"] < out["unigram_entropy_bits"]  # already beats byte unigrams
  assert (tmp_path / "tb" / "train").is_dir() and (tmp_path / "metrics_eval.jsonl").exists()
  # MoE layers (tiny: 3 of 4). The router's own learning first skews the load (without a
  # balancer MaxVio climbs from 0.9 to ≈2 in these 30 steps); the loss_free bias then pulls
  # it back (≈0.1 by step 300 of `make train`). Without a balancer the last five steps sit at
  # the peak (ratio ≈ 1); with it they end at 0.48 of the peak on CPU, below where they
  # started. On the H200 the routing takes another path each run (its reductions are not
  # deterministic): four runs ended at 0.51–0.71 of the peak, and at 0.69–1.01 of the first
  # five steps (benchmarks/gpu_tests.md), so only the CPU run is held to the start.
  vio = [v for _, v in out["max_vio_history"]]
  assert len(vio) == 30 and np.isfinite(vio).all()
  assert np.mean(vio[-5:]) < 0.75 * max(vio)
  if jax.default_backend() == "cpu":
    assert np.mean(vio[-5:]) < np.mean(vio[:5])


def _with_probe(c):
  c = c.copy_and_resolve_references()
  c.log.route_fluctuation = True
  return c


def test_route_probe_counts_changed_top_k_sets(small_config):
  """RouteProbe: 0 for unchanged params, > 0 once the router moves, None across a gap."""
  from types import SimpleNamespace
  from moe_jax.train.probe import RouteProbe
  c = small_config
  model = HybridMoE(state_lib.frozen_model_config(c))
  batch = next(iter(pipeline.eval_dataset(pipeline.sources(c)["validation"], c)))
  variables = jax.jit(model.init)(jax.random.key(0), batch)
  params, router = nn.meta.unbox(variables["params"]), variables["router"]
  probe = RouteProbe(model.apply, SimpleNamespace(params=None, router=None), None, batch)
  s = SimpleNamespace(params=params, router=router)
  assert probe.observe(4, s) is None and probe.observe(5, s) == 0.0
  moved = jax.tree_util.tree_map_with_path(
      lambda path, p: p + 0.5 * jax.random.normal(jax.random.key(1), p.shape)
      if path[-1].key == "router_kernel" else p, params)
  f = probe.observe(6, SimpleNamespace(params=moved, router=router))
  assert 0.05 < f <= 1.0
  assert probe.observe(8, s) is None


@pytest.mark.slow
def test_resume_is_exact(small_config, tmp_path):
  """3 steps, checkpoint, fresh objects restore and run 3 more == 6 straight steps."""
  c = small_config
  c.checkpoint.every_steps = 100  # only the stop_after / final checkpoints are written
  c.schedule.total_steps = 6
  # The straight run also takes the routing-fluctuation probe: it must not change training.
  straight = train_and_evaluate(_with_probe(c),
      str(tmp_path / "straight"), progress=False)
  fluct = straight["route_fluctuation_history"]
  assert [s for s, _ in fluct] == [2, 3, 4, 5, 6] and all(0.0 <= f <= 1.0 for _, f in fluct)
  first = train_and_evaluate(c, str(tmp_path / "resumed"), progress=False, stop_after=3)
  assert first["resumed_from"] is None and int(first["state"].step) == 3
  assert sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir()) == ["3"]
  resumed = train_and_evaluate(c, str(tmp_path / "resumed"), progress=False)
  assert resumed["resumed_from"] == 3 and int(resumed["state"].step) == 6
  np.testing.assert_allclose(
      [l for s, l in resumed["history"]], [l for s, l in straight["history"] if s > 3], rtol=1e-6)
  for a, b in zip(jax.tree.leaves(resumed["state"].params), jax.tree.leaves(straight["state"].params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
  for a, b in zip(jax.tree.leaves(resumed["state"].opt_state),
                  jax.tree.leaves(straight["state"].opt_state)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)


@pytest.mark.slow
def test_split_step_equals_one_program_and_skips_a_nonfinite_gradient(small_config):
  """The two-program step (train.split_step, what train.py runs) against the one-program
  step on a good batch; then a NaN gradient is skipped and counted, and training goes on."""
  c = small_config
  mesh = make_mesh(c.mesh)
  srcs = pipeline.sources(c)
  batches = iter(pipeline.train_dataset(srcs["train"], c))
  batch = next(batches)
  model = HybridMoE(state_lib.frozen_model_config(c))
  state, shardings = state_lib.create_train_state(model, optim.make_optimizer(c), batch, mesh,
                                                  jax.random.key(0))
  batch_sh = state_lib.batch_sharding(mesh)
  want, want_m = step_lib.jit_train_step(c, shardings, batch_sh)(jax.tree.map(jnp.copy, state),
                                                                  batch)
  train_step = step_lib.SplitStep(*step_lib.jit_step_halves(c, shardings, batch_sh))
  state, m = train_step(state, batch)  # one good step so the moments are non-trivial
  assert int(m["skipped_updates"]) == 0 and int(state.step) == 1
  assert sorted(m) == sorted(want_m)
  for k in m:
    np.testing.assert_allclose(np.asarray(m[k]), np.asarray(want_m[k]), rtol=1e-5, atol=1e-7,
                               err_msg=k)
  for a, b in zip(jax.tree.leaves((state.params, state.opt_state, state.router)),
                  jax.tree.leaves((want.params, want.opt_state, want.router))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
  before = jax.device_get(state)

  bad = dict(next(batches))
  bad["loss_mask"] = bad["loss_mask"].copy()
  bad["loss_mask"][0, 0] = np.nan
  state, m = train_step(state, bad)
  assert not np.isfinite(float(m["grad_norm"]))
  assert int(m["skipped_updates"]) == 1 and int(state.step) == 2
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(before.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  mu = lambda s: jax.tree.leaves(s.opt_state.inner_state[1][0].mu)
  for a, b in zip(mu(state), mu(before)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  state, m = train_step(state, next(batches))  # training continues with finite gradients
  assert int(m["skipped_updates"]) == 1 and np.isfinite(float(m["loss"]))
  changed = [not np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(before.params))]
  assert all(changed)


@pytest.mark.slow   # a training run (19 s on 2 cores); make test checks the MQAR rows in test_data
def test_mqar_source_trains(small_config, tmp_path):
  c = small_config
  c.data.source, c.data.seq_len, c.data.mqar_num_pairs = "mqar", 64, 8
  c.schedule.total_steps = 4
  out = train_and_evaluate(c, str(tmp_path), progress=False)
  assert out["unigram_entropy_bits"] is None
  assert 0.0 <= out["val_accuracy"] <= 1.0 and 0 < out["val_loss"] < 20


def test_schedules(small_config):
  s = small_config.schedule
  s.total_steps, s.warmup_steps, s.final_lr_fraction = 100, 10, 0.1
  for kind in ("cosine", "wsd"):
    s.kind = kind
    lr = schedule.make_schedule(s, 1.0)
    assert float(lr(0)) == 0.0 and abs(float(lr(10)) - 1.0) < 1e-6
    assert abs(float(lr(100)) - 0.1) < 1e-6
  s.kind, s.decay_fraction = "wsd", 0.2
  lr = schedule.make_schedule(s, 1.0)
  assert abs(float(lr(79)) - 1.0) < 1e-6 and abs(float(lr(90)) - 0.55) < 1e-6  # stable, then linear
