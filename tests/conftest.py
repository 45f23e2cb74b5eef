"""Shared test helpers: small configs, a relative-error measure, a call counter."""

import numpy as np
import pytest

from configs import tiny


def rel_err(a, b) -> float:
  """‖a − b‖ / ‖b‖ in float64."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def count_calls(monkeypatch, module, name) -> list:
  """Replaces module.name by a wrapper that appends to the returned list on every call (at
  trace time under jit): a test can assert that a kernel path was taken."""
  calls, real = [], getattr(module, name)
  monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
  return calls


@pytest.fixture
def small_config():
  return make_small_config()


def make_small_config():
  """The tiny config shrunk further so a step compiles and runs in about a second."""
  c = tiny.get_config()
  c.model.d_model = 64
  c.model.n_heads = 2
  c.model.n_layers = 2
  c.model.layer_pattern = "KA"
  c.model.kda_head_dim = 16
  c.model.kda_chunk_size = 16
  c.model.mla_q_lora_rank = 32
  c.model.mla_kv_lora_rank = 32
  c.model.mla_qk_head_dim = 16
  c.model.mla_v_head_dim = 16
  c.model.ffn_hidden = 128
  c.data.seq_len = 64
  c.data.batch_size = 4
  c.schedule.warmup_steps = 2
  c.eval.num_batches = 2
  c.checkpoint.every_steps = 3
  c.log.every_steps = 1
  return c
