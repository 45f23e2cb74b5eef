"""Parameter accounting: components add up, and the published-shape configs hit their sizes."""

import flax.linen as nn
import jax
import numpy as np

from configs import kimi_linear_48b, trillion
from moe_jax import params
from moe_jax.model.transformer import HybridMoE
from moe_jax.train.state import frozen_model_config
from tests.conftest import make_small_config


def test_counts_match_the_initialised_model():
  c = make_small_config()
  c.model.n_layers, c.model.layer_pattern = 3, "KKA"
  counts = params.count(c)
  batch = {"tokens": np.ones((1, 16), np.int32), "segment_ids": np.ones((1, 16), np.int32)}
  init = jax.jit(HybridMoE(frozen_model_config(c)).init)
  real = nn.meta.unbox(init(jax.random.key(0), batch)["params"])
  assert counts["total_sum"] == sum(x.size for x in jax.tree.leaves(real))
  m = c.model
  moe_layers = m.n_layers - m.moe.first_dense
  per_expert = 3 * m.d_model * m.moe.expert_hidden
  assert counts["total"]["routed_experts"] == moe_layers * m.moe.num_experts * per_expert
  assert counts["active"]["routed_experts"] == moe_layers * m.moe.top_k * per_expert
  assert counts["total"]["router"] == moe_layers * m.d_model * m.moe.num_experts
  assert counts["active"]["embedding"] == m.d_model  # one row is looked up per token
  assert (counts["total_sum"] - counts["active_sum"]
          == counts["total"]["routed_experts"] - counts["active"]["routed_experts"]
          + counts["total"]["embedding"] - m.d_model)


def test_kimi_linear_48b_is_48b_total_3b_active():
  counts = params.count(kimi_linear_48b.get_config())
  assert abs(counts["total_sum"] / 48e9 - 1) < 0.05    # 49.2 B
  assert abs(counts["active_sum"] / 3e9 - 1) < 0.05    # 3.14 B


def test_trillion_is_about_1t_total_30b_active():
  counts = params.count(trillion.get_config())
  assert abs(counts["total_sum"] / 1e12 - 1) < 0.05    # 1.027 T
  assert abs(counts["active_sum"] / 30e9 - 1) < 0.10   # 32.3 B
