"""RoPE on MLA's shared key dims (model.mla_rope_theta, model/rope.py): the rotation is
RoPE's, scores depend on the offset alone, positions restart with each packed document,
and the model's outputs change with it (the NoPE/RoPE control is a real difference)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import config as config_lib
from moe_jax.infer.generate import inference_model
from moe_jax.model import rope
from moe_jax.train.state import frozen_model_config
from tests.conftest import make_small_config, rel_err


def test_document_positions_restart_at_each_segment():
  seg = jnp.array([[1, 1, 1, 2, 2, 0, 0], [3, 3, 3, 3, 3, 3, 3], [1, 2, 2, 2, 5, 5, 5]])
  np.testing.assert_array_equal(rope.document_positions(seg),
                                [[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 4, 5, 6],
                                 [0, 0, 1, 2, 0, 1, 2]])


def test_rotation_is_ropes_and_scores_depend_on_the_offset_alone():
  rng = np.random.default_rng(0)
  D, theta = 8, 10_000.0
  x = rng.normal(size=(1, 1, D)).astype(np.float32)
  got = np.asarray(rope.rotate(jnp.asarray(x), jnp.array([[5]]), theta))[0, 0]
  # written out: pair (i, i + D/2) turned by 5 · θ^(−2i/D)
  want = np.empty(D)
  for i in range(D // 2):
    a = 5 * theta ** (-2 * i / D)
    want[i] = x[0, 0, i] * np.cos(a) - x[0, 0, i + D // 2] * np.sin(a)
    want[i + D // 2] = x[0, 0, i + D // 2] * np.cos(a) + x[0, 0, i] * np.sin(a)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  q = jnp.asarray(rng.normal(size=(1, 1, 3, D)), jnp.float32)   # heads axis
  k = jnp.asarray(rng.normal(size=(1, 1, D)), jnp.float32)
  score = lambda m, n: float(jnp.sum(rope.rotate(q, jnp.array([[m]]), theta)[0, 0, 0]
                                     * rope.rotate(k, jnp.array([[n]]), theta)[0, 0]))
  assert score(9, 2) == pytest.approx(score(1007, 1000), rel=1e-4)
  assert score(9, 2) != pytest.approx(score(9, 5), rel=1e-2)
  assert float(jnp.linalg.norm(rope.rotate(q, jnp.array([[123]]), theta))) == pytest.approx(
      float(jnp.linalg.norm(q)), rel=1e-5)


def _model(theta):
  c = make_small_config()
  c.model.update({"dtype": "float32", "n_layers": 2, "layer_pattern": "KA",
                  "mla_qk_rope_dim": 4, "mla_rope_theta": theta})
  config_lib.validate(c)
  return inference_model(frozen_model_config(c))


def test_a_packed_document_reads_as_if_it_started_the_row():
  """Row 0 packs documents A (11 tokens) and B (13); row 1 holds B alone. With RoPE at
  document positions B's logits are the same in both; NoPE with the same weights gives
  different logits (the rotation is applied)."""
  rng = np.random.default_rng(1)
  a, b = rng.integers(0, 256, 11), rng.integers(0, 256, 13)
  tokens = np.zeros((2, 24), np.int32)
  tokens[0] = np.concatenate([a, b])
  tokens[1, :13] = b
  seg = np.zeros((2, 24), np.int32)
  seg[0, :11], seg[0, 11:], seg[1, :13] = 1, 2, 1
  batch = {"tokens": tokens, "segment_ids": seg}
  model = _model(10_000.0)
  variables = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), batch))
  logits, _ = jax.jit(model.apply)(variables, batch)
  assert rel_err(logits[0, 11:], logits[1, :13]) < 1e-5
  nope, _ = jax.jit(_model(0.0).apply)(variables, batch)
  assert rel_err(nope[1, :13], logits[1, :13]) > 1e-3
  assert np.isfinite(np.asarray(logits)).all()
