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


def test_kimi_h200_slice_keeps_the_published_layers_and_fits_one_h200():
  """The slice's layers are the full model's first four, parameter for parameter, and its
  fp32 training state (params, grads, two AdamW moments: 16 B a param) leaves room on one
  H200 (141 GB) that a fifth layer would take."""
  full, cut = kimi_linear_48b.get_config(), kimi_linear_48b.get_config("h200_slice")
  assert (cut.model.n_layers, cut.model.layer_pattern, cut.data.seq_len) == (4, "KKKA", 8192)
  for k in ("d_model", "n_heads", "kda_head_dim", "mla_kv_lora_rank", "vocab_size"):
    assert cut.model[k] == full.model[k]
  assert cut.model.moe.to_dict() == full.model.moe.to_dict()
  c_full, c_cut = params.count(full), params.count(cut)
  for part in ("routed_experts", "router", "shared_experts"):   # 3 of the 26 MoE layers
    assert c_cut["total"][part] * 26 == c_full["total"][part] * 3
  assert c_cut["total"]["dense_ffn"] == c_full["total"]["dense_ffn"]
  state_gb = 16 * c_cut["total_sum"] / 1e9
  per_moe_layer_gb = 16 * c_cut["total"]["routed_experts"] / 3 / 1e9
  assert 95 < state_gb < 110 and state_gb + per_moe_layer_gb > 125   # 102.8, +29.0


def test_trillion_is_about_1t_total_30b_active():
  counts = params.count(trillion.get_config())
  assert abs(counts["total_sum"] / 1e12 - 1) < 0.05    # 1.027 T
  assert abs(counts["active_sum"] / 30e9 - 1) < 0.10   # 32.3 B
