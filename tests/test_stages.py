"""Staged context extension (moe_jax/train/stages.py): the handover carries params, router
state and Adam's moments exactly and restarts the schedule; a run killed mid-stage resumes to
the same result as an uninterrupted one; the extrapolation evals are consistent."""

import json
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import flax.linen as nn
import numpy as np
import optax
import pytest

from configs import stages as stages_config
from moe_jax.eval import extrapolation
from moe_jax.infer.workdir import load
from moe_jax.model.transformer import HybridMoE
from moe_jax.parallel.mesh import make_mesh
from moe_jax.train import optim, stages, state as state_lib
from tests.conftest import ROOT, make_small_config, subprocess_env


def _stages(tmp_corpus):
  """Two small stages on a small text corpus: 64 × 4 rows, then 128 × 2 rows."""
  sc = stages_config.get_config("cpu")
  run = make_small_config()
  run.data.source, run.data.paths, run.data.val_percent = "files", tmp_corpus, 20
  run.data.synthetic_fraction = 0.0
  run.eval.every_steps, run.eval.num_batches = 100, 1
  sc.run = run
  sc.stages = ml_collections.ConfigDict({"s64": stages_config._stage(64, 3, 256, 3e-3, 1),
               "s128": stages_config._stage(128, 3, 256, 1e-3, 2)})
  sc.stage_names = "s64,s128"
  return sc


@pytest.fixture(scope="module")
def corpus_glob(tmp_path_factory):
  d = tmp_path_factory.mktemp("corpus")
  rng = np.random.default_rng(0)
  words = ["def", "return", "self", "import", "class", "value", "(", ")", ":", "\n", "    "]
  for i in range(30):
    (d / f"f{i}.py").write_text(" ".join(rng.choice(words, size=400)))
  return str(d / "*.py")


@pytest.fixture(scope="module")
def straight(corpus_glob, tmp_path_factory):
  """Both stages run without interruption."""
  workdir = tmp_path_factory.mktemp("straight")
  sc = _stages(corpus_glob)
  return sc, str(workdir), stages.run_stages(sc, str(workdir), progress=False)


def _params(workdir):
  return load(workdir)[1]


@pytest.mark.slow   # 30 s on 2 cores: two trained runs
def test_handover_carries_state_and_a_killed_stage_resumes_exactly(straight, tmp_path):
  sc, workdir, results = straight
  assert [results[n]["step"] for n in ("s64", "s128")] == [3, 3]
  c2 = stages.stage_config(sc, "s128")
  assert (c2.data.seq_len, c2.data.batch_size, c2.log.stage) == (128, 2, "s128")
  model = HybridMoE(state_lib.frozen_model_config(c2))
  tx = optim.make_optimizer(c2)
  example = {k: np.zeros((2, 128), np.int32) for k in ("tokens", "segment_ids")}
  mesh = make_mesh(c2.mesh)
  with jax.set_mesh(mesh):
    fresh, _ = state_lib.create_train_state(model, tx, example, mesh, jax.random.key(1))
    prev_dir = f"{workdir}/s64/checkpoints"
    carried = stages.handover(prev_dir, carry_optimizer=True)(fresh)
    reset = stages.handover(prev_dir, carry_optimizer=False)(fresh)
  prev = load(f"{workdir}/s64")[1]
  for got in (carried, reset):
    assert int(got.step) == 0
    jax.tree.map(np.testing.assert_array_equal, got.params, prev["params"])
    jax.tree.map(np.testing.assert_array_equal, got.router, prev["router"])
  biases = jax.tree.leaves(prev["router"])
  assert biases and any(np.abs(b).max() > 0 for b in biases)   # the balancer state moved
  adam = lambda s: next(x for x in jax.tree.leaves(
      s.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
      if isinstance(x, optax.ScaleByAdamState))
  sched = lambda s: [x.count for x in jax.tree.leaves(
      s.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
      if isinstance(x, optax.ScaleByScheduleState)]
  assert int(adam(carried).count) == 3 and int(adam(reset).count) == 0
  assert np.abs(np.asarray(jax.tree.leaves(adam(carried).nu)[0])).max() > 0
  assert all(np.abs(np.asarray(x)).max() == 0 for x in jax.tree.leaves(adam(reset).nu))
  assert sched(carried) == [0] and sched(reset) == [0]
  # The second stage re-warms: from 0 at its step 0 to its own peak at its warmup's end.
  assert float(optim.learning_rate(c2, 0)) == 0.0
  assert float(optim.learning_rate(c2, 2)) == pytest.approx(1e-3)

  # Killed in the middle of the second stage, run again: the same params as straight
  # through (this shares the straight run, so it is one test, not two: one trained run).
  shutil.copytree(f"{workdir}/s64", tmp_path / "s64")   # the first stage is complete: skipped
  first = stages.run_stages(sc, str(tmp_path), progress=False, stop_after=("s128", 1))
  assert first["s64"]["step"] == 3 and first["s128"]["step"] == 1
  assert not stages.is_complete(str(tmp_path / "s128"), 3)
  again = stages.run_stages(sc, str(tmp_path), progress=False)
  assert again["s128"]["resumed_from"] == 1 and again["s128"]["step"] == 3
  got, want = _params(str(tmp_path / "s128")), _params(f"{workdir}/s128")
  jax.tree.map(np.testing.assert_array_equal, got, want)
  done = stages.run_stages(sc, str(tmp_path), progress=False)   # nothing left: both skipped
  assert done["s128"]["step"] == 3


@pytest.mark.slow
def test_extrapolation_evals():
  c = make_small_config()
  model = extrapolation.inference_model(c.model)
  example = {"tokens": np.zeros((1, 64), np.int32), "segment_ids": np.ones((1, 64), np.int32)}
  variables = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), example))
  variables = {"params": variables["params"], "router": variables.get("router", {})}
  tokens = np.random.default_rng(0).integers(0, 256, size=(2, 256)).astype(np.int32)
  # Chunked inference scores the same tokens as one full forward pass.
  logp, pred, inter, cache = extrapolation.run_chunks(model, variables, tokens, 64,
                                                      capture_last=True)
  logits, _ = model.apply(variables, {"tokens": jnp.asarray(tokens),
                                      "segment_ids": jnp.ones_like(jnp.asarray(tokens))})
  full = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits))[:, :-1],
                            tokens[:, 1:, None], -1)[..., 0]
  np.testing.assert_allclose(logp, full, atol=2e-4)
  np.testing.assert_array_equal(pred, np.asarray(logits.argmax(-1))[:, :-1])
  steps = -np.log(2) * np.repeat(np.arange(1.0, 5.0), 64)[None].repeat(2, 0)   # 1..4 bits
  assert extrapolation.loss_by_position(steps, 4) == pytest.approx([1.0, 2.0, 3.0, 4.0])
  ent = extrapolation.attention_entropy(variables["params"], inter, cache, 16)
  assert set(ent) == {"layer_1/entropy", "layer_1/entropy_normalised"}
  assert 0.0 < ent["layer_1/entropy_normalised"] <= 1.0
  # With the key map zeroed every visible key scores the same: exactly uniform attention.
  zeroed = jax.tree_util.tree_map_with_path(
      lambda p, x: jnp.zeros_like(x) if "k_b" in jax.tree_util.keystr(p) else x,
      variables["params"])
  ent0 = extrapolation.attention_entropy(zeroed, inter, cache, 16)
  assert ent0["layer_1/entropy_normalised"] == pytest.approx(1.0, abs=1e-5)
  wins = extrapolation.document_windows([b"x" * 500, b"y" * 100], 128, 8)
  assert wins.shape == (3, 128) and (wins[:, 1:] == ord("x")).all()
  wins, joined = extrapolation.eval_windows([b"x" * 500, b"y" * 100], 128, 8)
  assert wins.shape == (3, 128) and not joined
  # No document is 512 long: the two joined (502 + 102 ids with BOS/EOS) make one window,
  # the longer first.
  wins, joined = extrapolation.eval_windows([b"y" * 100, b"x" * 500], 512, 8)
  assert joined and wins.shape == (1, 512)
  assert (wins[0, 1:501] == ord("x")).all() and (wins[0, 504:512] == ord("y")).all()
  assert extrapolation.eval_windows([b"x" * 10], 512, 8)[0].shape == (0, 512)


@pytest.mark.slow   # 21 s on 2 cores; test_extrapolation_evals checks the entropy eval
def test_attention_entropy_reads_the_shared_key_dims():
  """With shared (RoPE-turned) key dims (mla_qk_rope_dim), the entropy eval's keys are the
  cache's latents through k_b plus those dims: with k_b zeroed only they score, so
  attention is not uniform; with the queries' matching dims zeroed too, it is exactly."""
  c = make_small_config()
  c.model.update({"n_layers": 2, "layer_pattern": "KA", "mla_qk_rope_dim": 4,
                  "mla_rope_theta": 10_000.0, "dtype": "float32"})
  model = extrapolation.inference_model(c.model)
  example = {"tokens": np.zeros((1, 32), np.int32), "segment_ids": np.ones((1, 32), np.int32)}
  variables = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), example))
  variables = {"params": variables["params"], "router": variables.get("router", {})}
  tokens = np.random.default_rng(0).integers(0, 256, size=(1, 64)).astype(np.int32)
  _, _, inter, cache = extrapolation.run_chunks(model, variables, tokens, 32, capture_last=True)
  ent = extrapolation.attention_entropy(variables["params"], inter, cache, 16)
  assert 0.0 < ent["layer_1/entropy_normalised"] <= 1.0
  zeroed = jax.tree_util.tree_map_with_path(
      lambda p, x: jnp.zeros_like(x) if "k_b" in jax.tree_util.keystr(p) else x,
      variables["params"])
  shared_only = extrapolation.attention_entropy(zeroed, inter, cache, 16)
  assert shared_only["layer_1/entropy_normalised"] < 1.0 - 1e-4
  Dqk = c.model.mla_qk_head_dim
  no_rope_q = jax.tree.map(lambda q: q.at[..., Dqk:].set(0.0), inter)
  uniform = extrapolation.attention_entropy(zeroed, no_rope_q, cache, 16)
  assert uniform["layer_1/entropy_normalised"] == pytest.approx(1.0, abs=1e-5)


def test_stage_config_errors():
  sc = stages_config.get_config("cpu")
  sc.stages.s1k.tokens_per_step = 1000
  with pytest.raises(ValueError, match="stages.s1k.tokens_per_step=1000 must be a multiple"):
    stages.stage_config(sc, "s1k")
  sc.stage_names = "s128,s2k"
  with pytest.raises(ValueError, match="names 's2k', which is not one of stages"):
    stages.stage_names(sc)
  with pytest.raises(ValueError, match="configs/stages.py arg must be one of"):
    stages_config.get_config("tpu")


def test_context_record_rows_from_extend_context_workdirs(tmp_path):
  """benchmarks/context_gpu.py: a NoPE workdir gives `staged` and `direct` rows, a RoPE one
  `rope` and `rope_direct`, with the seed from the run's config, passkey by depth, and the
  trained length of the last stage; the markdown has a column per depth."""
  from benchmarks import context_gpu
  result = lambda L, acc: {"length": L, "windows": 2, "bits_per_byte": 2.0 + L / 1e4,
                           "passkey/row_acc": acc, "passkey@0/row_acc": acc / 2,
                           "passkey@0.5/row_acc": acc, "mqar/row_acc": 0.25,
                           "mqar/token_acc": 0.75}
  for name, theta, seed in (("nope", 0.0, 1), ("rope", 10000.0, 0)):
    w = tmp_path / name
    for stage, L in (("s2k", 2048), ("s8k", 8192)):
      (w / stage).mkdir(parents=True)
      (w / stage / "config.json").write_text(json.dumps(
          {"seed": seed, "data": {"seq_len": L}, "model": {"mla_rope_theta": theta}}))
    runs = {"staged": [result(8192, 0.9), dict(result(65536, 0.5), windows_joined=True)],
            "control": [result(8192, 0.7)]}
    if name == "nope":   # rows as evaluate_lengths records them; the rope ones predate that
      runs = {run: [dict(r, retrieval_rows=16) for r in rows] for run, rows in runs.items()}
    (w / "extrapolation.json").write_text(json.dumps(runs))
  stamp = {"date": "d", "commit": "c", "machine": "m"}
  rows = context_gpu.rows_of(str(tmp_path / "nope"), stamp) + context_gpu.rows_of(
      str(tmp_path / "rope"), stamp)
  got = {(r["run"], r["seed"], r["eval_len"]): r for r in rows}
  assert set(got) == {("staged", 1, 8192), ("staged", 1, 65536), ("direct", 1, 8192),
                      ("rope", 0, 8192), ("rope", 0, 65536), ("rope_direct", 0, 8192)}
  r = got[("staged", 1, 65536)]
  assert (r["trained_len"], r["passkey_acc"], r["mqar_acc"]) == (8192, 0.5, 0.25)
  assert (r["mqar_token_acc"], r["passkey_token_acc"]) == (0.75, None)
  assert r["passkey_acc_by_depth"] == {"0": 0.25, "0.5": 0.5} and r["machine"] == "m"
  assert (r["windows"], r["windows_joined"], r["retrieval_rows"]) == (2, True, 16)
  assert got[("rope", 0, 8192)]["retrieval_rows"] is None     # rows that did not record it
  md = context_gpu.markdown(rows)
  assert "passkey @ 0 | passkey @ 0.5" in md and "| staged | 1 | 8192 | 65536 | 8 | 0.500 |" in md
  assert "| 0.250 | 0.750 | 8.554 | 2 joined | 16 | d, c, m |" in md
  with pytest.raises(ValueError, match="has no extrapolation.json or"):
    context_gpu.rows_of(str(tmp_path / "nope" / "s2k"), stamp)
  alone = tmp_path / "alone"   # extend_context.py --nostaged: the control run only
  (alone / "control").mkdir(parents=True)
  (alone / "control" / "config.json").write_text(json.dumps(
      {"seed": 2, "data": {"seq_len": 8192}, "model": {}}))
  (alone / "extrapolation.json").write_text(json.dumps({"control": [result(8192, 0.7)]}))
  assert [(r["run"], r["seed"], r["trained_len"]) for r in
          context_gpu.rows_of(str(alone), stamp)] == [("direct", 2, 8192)]
  (alone / "extrapolation.json").unlink()   # a job ended during the evals: the lengths done
  (alone / "extrapolation_partial.json").write_text(json.dumps(
      {"eval": {}, "runs": {"control": [result(8192, 0.7), result(16384, 0.6)]}}))
  assert [(r["eval_len"], r["passkey_acc"]) for r in context_gpu.rows_of(str(alone), stamp)] \
      == [(8192, 0.7), (16384, 0.6)]
  out = tmp_path / "out"   # the command line, as a device call runs it
  run = subprocess.run([sys.executable, "-m", "benchmarks.context_gpu",
                        f"--workdirs={tmp_path / 'nope'},{tmp_path / 'rope'}", f"--out={out}",
                        "--machine=NVIDIA H200"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env=subprocess_env())
  assert run.returncode == 0, run.stderr[-2000:]
  assert len(json.load(open(out / "context_gpu.json"))) == 6
  assert (out / "context_gpu.png").stat().st_size > 0


def test_passkey_accuracy_at_a_fixed_depth():
  """retrieval_accuracy at a fixed key depth keys its numbers `passkey@<depth>/…`; the
  rows it scores hold the key sentence at that depth of the filler."""
  from moe_jax.data import passkey
  c = make_small_config()
  model = extrapolation.inference_model(c.model)
  example = {"tokens": np.zeros((1, 64), np.int32), "segment_ids": np.ones((1, 64), np.int32)}
  variables = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), example))
  variables = {"params": variables["params"], "router": variables.get("router", {})}
  out = extrapolation.retrieval_accuracy(model, variables, "passkey", 128, 2, 64, c.data, 0.5)
  assert set(out) == {"passkey@0.5/token_acc", "passkey@0.5/row_acc"}
  assert all(0.0 <= v <= 1.0 for v in out.values())
  rows = passkey.PasskeyRows(128, depth=0.5, seed=10_000)
  _, at, _ = rows.layout(0)
  n_filler = 128 - 1 - len(passkey._key_sentence(b"00000")) - len(passkey.QUESTION) - 5
  assert at == 1 + round(0.5 * n_filler)


def test_h200_stages_validate_and_the_rope_control_has_the_same_parameters():
  """configs/stages.py:h200: every stage and the direct control validate; 100–300 M active
  parameters; its RoPE control turns existing dims, so the parameters are the same."""
  from moe_jax import config as config_lib, params
  sc = stages_config.get_config("h200")
  for name in stages.stage_names(sc):
    config_lib.validate(stages.stage_config(sc, name))
  control = config_lib.validate(stages.control_config(sc))
  assert control.data.seq_len == 32768
  nope = params.count(stages.stage_config(sc, "s2k"))
  assert 100e6 <= nope["active_sum"] <= 300e6
  sc.run.model.mla_rope_theta = 10000.0
  rope = params.count(config_lib.validate(stages.stage_config(sc, "s2k")))
  assert rope == nope


@pytest.mark.slow   # a minute on 2 cores: three stages, the control run and the evals
def test_extend_context_command_end_to_end(tmp_path):
  """scripts/extend_context.py, as a device job runs it: every stage, the control, the evals
  of both (more retrieval rows at the trained length), its settings in stages.json;
  benchmarks/context_gpu gathers the workdir. Then --nostaged, with evals resumed from the
  rows an interrupted invocation left."""
  w = tmp_path / "w"
  steps = [f"--config.stages.{s}.{k}={v}" for s in ("s128", "s512", "s1k")
           for k, v in (("steps", 2), ("warmup_steps", 1))]
  evals = ["--config.eval.multipliers=1,2", "--config.eval.retrieval_rows=2",
           "--config.eval.retrieval_rows_at_trained=3", "--config.eval.max_windows=1",
           "--config.eval.passkey_depths=0.5", "--config.eval.entropy_queries=16"]
  command = [sys.executable, "scripts/extend_context.py", "--config=configs/stages.py:cpu",
             f"--workdir={w}", *steps, *evals]
  run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=subprocess_env())
  assert run.returncode == 0, run.stderr[-3000:]
  settings = json.load(open(w / "stages.json"))["eval"]
  assert (settings["retrieval_rows"], settings["retrieval_rows_at_trained"]) == (2, 3)
  assert not (w / "extrapolation_partial.json").exists()
  results = json.load(open(w / "extrapolation.json"))
  assert set(results) == {"staged", "control"}
  for rows in results.values():
    assert [r["length"] for r in rows] == [1024, 2048]
    assert [(r["windows"], r["windows_joined"]) for r in rows] == [(1, False), (1, False)]
    assert all(np.isfinite(r["bits_per_byte"]) and 0 <= r["passkey@0.5/row_acc"] <= 1
               for r in rows)
    # Row accuracy over 3 rows at 1024 (the trained length), over 2 at 2048.
    assert rows[0]["mqar/row_acc"] in (0, 1 / 3, 2 / 3, 1)
    assert rows[1]["mqar/row_acc"] in (0, 0.5, 1)
  out = tmp_path / "out"
  run = subprocess.run([sys.executable, "-m", "benchmarks.context_gpu", f"--workdirs={w}",
                        f"--out={out}", "--machine=cpu"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env=subprocess_env())
  assert run.returncode == 0, run.stderr[-2000:]
  rows = json.load(open(out / "context_gpu.json"))
  assert {(r["run"], r["eval_len"], r["retrieval_rows"]) for r in rows} == {
      ("staged", 1024, 3), ("staged", 2048, 2), ("direct", 1024, 3), ("direct", 2048, 2)}
  # --nostaged: the control run alone (complete here, so only its evals run), resuming from
  # the rows an interrupted invocation with the same eval settings left: 1024 is kept, 2048
  # evaluated.
  shutil.rmtree(w / "s128")
  kept = dict(results["control"][0], marker=True)
  (w / "extrapolation_partial.json").write_text(json.dumps(
      {"eval": settings, "runs": {"control": [kept]}}))
  run = subprocess.run(command + ["--nostaged"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=subprocess_env())
  assert run.returncode == 0, run.stderr[-3000:]
  assert "moe_jax: stage" not in run.stdout
  again = json.load(open(w / "extrapolation.json"))
  assert list(again) == ["control"] and [r["length"] for r in again["control"]] == [1024, 2048]
  assert again["control"][0].get("marker") and "marker" not in again["control"][1]
  assert not (w / "extrapolation_partial.json").exists()
