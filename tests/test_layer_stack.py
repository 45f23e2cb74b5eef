"""Scanned layers (model/layer_stack.py): the same function and gradients as the unrolled
stack, the layout round trip, and the train step's router update on stacked state."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.data import pipeline
from moe_jax.model import layer_stack
from moe_jax.model.transformer import HybridMoE
from moe_jax.parallel.mesh import make_mesh
from moe_jax.train import checkpoint, optim, state as state_lib, step as step_lib
from tests.conftest import make_small_config, rel_err


def _config(scan: bool, **model):
  """8 MoE layers of "KKA". Scanned: two periods, each the run 0-1 and the single layer 2,
  then the tail run 6-7."""
  c = make_small_config()
  c.model.update({"n_layers": 8, "layer_pattern": "KKA", "scan_layers": scan, **model})
  c.model.moe.first_dense = 0
  return c


def _batch():
  rng = np.random.default_rng(0)
  seg = np.ones((2, 32), np.int32)
  seg[1, 20:] = 2
  return {"tokens": jnp.asarray(rng.integers(0, 256, (2, 32)), jnp.int32),
          "segment_ids": jnp.asarray(seg), "targets": jnp.asarray(rng.integers(0, 256, (2, 32))),
          "loss_mask": jnp.ones((2, 32), jnp.float32)}


def test_plan():
  p = layer_stack.plan(state_lib.frozen_model_config(_config(True)))
  assert (p.start, p.period, p.n, p.end) == (0, 3, 2, 6)
  assert (p.head, p.body, p.tail) == ((), (range(0, 2), range(2, 3)), (range(6, 8),))
  # long_context_1b's stack (16 layers of "KKKA", layer 0 dense): the scan starts at the
  # first A, so that the period is one run of three KDA blocks and one MLA block.
  c = _config(True, n_layers=16, layer_pattern="KKKA")
  c.model.moe.first_dense = 1
  cfg = state_lib.frozen_model_config(c)
  p = layer_stack.plan(cfg)
  assert (p.start, p.n, p.head, p.tail) == (3, 3, (range(0, 1), range(1, 3)), (range(15, 16),))
  assert p.body == (range(3, 4), range(4, 7))
  # The layout before runs: the scan from moe.first_dense, one block a pattern position.
  legacy = layer_stack.plan(cfg, legacy=True)
  assert (legacy.start, legacy.n, legacy.head) == (1, 3, (range(0, 1),))
  assert legacy.body == tuple(range(l, l + 1) for l in range(1, 5))
  assert legacy.tail == tuple(range(l, l + 1) for l in range(13, 16))
  # A start that would cost a period is not taken (13 layers: 3 periods from 1, 2 from 3).
  c.model.n_layers = 13
  p = layer_stack.plan(state_lib.frozen_model_config(c))
  assert (p.start, p.n) == (1, 3)
  assert layer_stack.plan(state_lib.frozen_model_config(_config(False))).n == 0
  # Depth-dependent residuals are never scanned.
  assert layer_stack.plan(state_lib.frozen_model_config(_config(True, attn_res="full"))).n == 0


def test_scanned_train_step_equals_unrolled(tmp_path):
  """The unrolled model's train state, checkpointed in its per-layer layout (the layout
  before scan_layers) and in the scanned layout before runs, restores into the scanned model
  (_config: runs in the head and in the period) converted, data position included. Then both
  take the same train step: same loss and routing stats, and params, Adam moments (so
  gradients) and balancer biases that unstack to the unrolled model's. The scanned model's
  own init has that layout."""
  cs, cf = _config(True), _config(False)
  batch = _batch()
  tx = optim.make_optimizer(cf)
  mesh = make_mesh(cf.mesh)
  flat = HybridMoE(state_lib.frozen_model_config(cf))
  scanned = HybridMoE(state_lib.frozen_model_config(cs))
  state_f, _ = state_lib.create_train_state(flat, tx, batch, mesh, jax.random.key(0))

  srcs = pipeline.sources(cf)
  it = iter(pipeline.train_dataset(srcs["train"], cf))
  next(it)
  manager = checkpoint.make_manager(str(tmp_path / "ckpt"), cf)
  checkpoint.save(manager, 7, state_f, it)
  checkpoint.finish(manager)
  abstract, _, _ = state_lib.train_state_plan(scanned, tx, batch, mesh)
  with pytest.raises(ValueError, match="no readable checkpoint"):  # layouts differ
    checkpoint.restore_latest(manager, abstract, iter(pipeline.train_dataset(
        srcs["train"], cs)), None)
  fresh = iter(pipeline.train_dataset(srcs["train"], cs))
  state_s, step = checkpoint.restore_latest(manager, abstract, fresh, cs.model)
  assert step == 7 and "periods" in state_s.params and "layer_3" not in state_s.params
  assert sorted(state_s.params["periods"]) == ["layer_2", "layers_0_1"]
  assert state_s.params["layers_6_7"]["mixer_norm"]["scale"].shape == (2, cs.model.d_model)
  expected = layer_stack.convert(cs.model, state_f, to_stacked=True)
  for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(state_s)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(next(fresh)["tokens"], next(it)["tokens"])
  legacy = checkpoint.make_manager(str(tmp_path / "legacy"), cs)
  checkpoint.save(legacy, 8, layer_stack.convert(cs.model, state_f, True, legacy=True), it)
  checkpoint.finish(legacy)
  state_l, step = checkpoint.restore_latest(legacy, abstract, iter(pipeline.train_dataset(
      srcs["train"], cs)), cs.model)
  assert step == 8
  for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(state_l)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  own = jax.eval_shape(scanned.init, jax.random.key(0), batch)
  assert jax.tree.map(lambda a: a.shape, nn.meta.unbox(own["params"])) == jax.tree.map(
      lambda a: a.shape, state_s.params)
  new_f, m_f = jax.jit(lambda s, b: step_lib.train_step(s, b, config=cf))(state_f, batch)
  new_s, m_s = jax.jit(lambda s, b: step_lib.train_step(s, b, config=cs))(state_s, batch)
  assert abs(float(m_f["loss"]) - float(m_s["loss"])) < 1e-5
  layers = [k.removeprefix("moe/").removesuffix("/max_vio") for k in m_f if k.endswith("max_vio")]
  assert sorted(layers) == sorted(f"layer_{i}" for i in range(8))
  for k in m_f:
    if k.startswith("moe/"):
      np.testing.assert_allclose(m_s[k], m_f[k], atol=1e-6, err_msg=k)
  back = layer_stack.convert(cs.model, new_s, to_stacked=False)
  for tree_f, tree_b in ((new_f.params, back.params), (new_f.router, back.router),
                         (new_f.opt_state, back.opt_state)):
    assert jax.tree.structure(tree_f) == jax.tree.structure(tree_b)
    for a, b in zip(jax.tree.leaves(tree_f), jax.tree.leaves(tree_b)):
      assert rel_err(a, b) < 1e-4 or np.abs(np.asarray(a) - np.asarray(b)).max() < 1e-7
  # The balancer moved the biases of the scanned layers.
  bias = new_s.router["periods"]["layers_0_1"]["ffn"]["bias"]
  assert bias.shape == (2, 2, cs.model.moe.num_experts) and np.abs(np.asarray(bias)).max() > 0
  # Norm scales (stacked to 2-D or 3-D) are still not decayed.
  mask = optim.decay_mask(state_s.params)
  assert not mask["periods"]["layers_0_1"]["mixer_norm"]["scale"]
  assert not mask["layers_6_7"]["ffn_norm"]["scale"]
  assert mask["periods"]["layer_2"]["ffn"]["gate_up"]
  assert mask["periods"]["layers_0_1"]["ffn"]["gate_up"]
