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
  """7 layers of "KA" after one dense layer: head 0, three scanned periods 1-6, no tail;
  with n_layers 8 the tail is layer 7."""
  c = make_small_config()
  c.model.update({"n_layers": 7, "layer_pattern": "KA", "scan_layers": scan, **model})
  return c


def _batch():
  rng = np.random.default_rng(0)
  seg = np.ones((2, 32), np.int32)
  seg[1, 20:] = 2
  return {"tokens": jnp.asarray(rng.integers(0, 256, (2, 32)), jnp.int32),
          "segment_ids": jnp.asarray(seg), "targets": jnp.asarray(rng.integers(0, 256, (2, 32))),
          "loss_mask": jnp.ones((2, 32), jnp.float32)}


@pytest.mark.parametrize("n_layers", [7, 8])
def test_plan(n_layers):
  p = layer_stack.plan(state_lib.frozen_model_config(_config(True, n_layers=n_layers)))
  assert (p.start, p.period, p.n, p.end) == (1, 2, 3, 7)
  assert layer_stack.plan(state_lib.frozen_model_config(_config(False))).n == 0
  # Depth-dependent residuals are never scanned.
  assert layer_stack.plan(state_lib.frozen_model_config(_config(True, attn_res="full"))).n == 0


@pytest.mark.slow
def test_scanned_train_step_equals_unrolled(tmp_path):
  """The unrolled model's train state, checkpointed in its per-layer layout (the layout
  before scan_layers), restores into the scanned model (head layer 0, two periods 1-4, tail
  5) converted, data position included. Then both take the same train step: same loss and
  routing stats, and params, Adam moments (so gradients) and balancer biases that unstack
  to the unrolled model's. The scanned model's own init has that layout."""
  cs, cf = _config(True, n_layers=6), _config(False, n_layers=6)
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
  expected = layer_stack.convert(cs.model, state_f, to_stacked=True)
  for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(state_s)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(next(fresh)["tokens"], next(it)["tokens"])

  own = jax.eval_shape(scanned.init, jax.random.key(0), batch)
  assert jax.tree.map(lambda a: a.shape, nn.meta.unbox(own["params"])) == jax.tree.map(
      lambda a: a.shape, state_s.params)
  new_f, m_f = jax.jit(lambda s, b: step_lib.train_step(s, b, config=cf))(state_f, batch)
  new_s, m_s = jax.jit(lambda s, b: step_lib.train_step(s, b, config=cs))(state_s, batch)
  assert abs(float(m_f["loss"]) - float(m_s["loss"])) < 1e-5
  layers = [k.removeprefix("moe/").removesuffix("/max_vio") for k in m_f if k.endswith("max_vio")]
  assert layers == [f"layer_{i}" for i in range(1, 6)]
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
  bias = new_s.router["periods"]["block_0"]["ffn"]["bias"]
  assert bias.shape == (2, cs.model.moe.num_experts) and np.abs(np.asarray(bias)).max() > 0
  # Norm scales (stacked to 2-D) are still not decayed.
  mask = optim.decay_mask(state_s.params)
  assert not mask["periods"]["block_0"]["mixer_norm"]["scale"]
  assert mask["periods"]["block_0"]["ffn"]["gate_up"]


def test_scan_body_is_traced_once(monkeypatch):
  """The periods' body (one period of blocks) is traced once per trace of the model: flax's
  scan otherwise traces it a second time to check broadcast variables, which the stack has
  none of (check_constancy_invariants=False; 1 s of the 1B's 7 s trace on CPU)."""
  from moe_jax.model import transformer
  scanned_calls = []
  real = transformer.remat_block
  monkeypatch.setattr(transformer, "remat_block", lambda cfg, scanned: (
      scanned and scanned_calls.append(1)) or real(cfg, scanned))
  cfg = state_lib.frozen_model_config(_config(True, n_layers=7))
  model, batch = HybridMoE(cfg), _batch()
  variables = jax.eval_shape(lambda: nn.meta.unbox(model.init(jax.random.key(0), batch)))
  assert layer_stack.PERIODS in variables["params"]   # the stack really is scanned
  scanned_calls.clear()
  jax.eval_shape(lambda v: model.apply(v, batch), variables)
  assert len(scanned_calls) == 1
