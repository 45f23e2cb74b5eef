"""The Pallas prefill kernel (interpret mode) against attention that materialises every
score; and its Triton lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import cached_attention as ca
from tests.conftest import rel_err
from tests.test_kda_triton_lowering import h200  # noqa: F401 — fixture


@pytest.mark.parametrize("B,T,H,D,Dv,S,q_start,kv_len", [
    # Rows at different offsets; a cache whose length is not a multiple of the key block
    # (the last block overlaps the one before); a row that sees nothing (zeros).
    (3, 40, 2, 32, 16, 300, [0, 100, 251], [40, 140, 260]),
    (2, 130, 1, 64, 64, 200, [0, 70], [130, 0]),
    (1, 5, 2, 16, 16, 20, [3], [8]),        # cache shorter than one key block
])
def test_equals_materialised_attention(B, T, H, D, Dv, S, q_start, kv_len):
  kq, kk, kv = jax.random.split(jax.random.key(B * T + S), 3)
  q = jax.random.normal(kq, (B, T, H, D))
  k = jax.random.normal(kk, (B, S, H, D))
  v = jax.random.normal(kv, (B, S, H, Dv))
  q_start, kv_len = jnp.array(q_start), jnp.array(kv_len)
  got = ca.cached_attention(q, k, v, q_start, kv_len, interpret=True)
  ref = ca.cached_attention_reference(q, k, v, q_start, kv_len)
  assert got.shape == (B, T, H, Dv) and np.isfinite(np.asarray(got)).all()
  assert rel_err(got, ref) < 1e-5
  # Row b's queries past its filled length see exactly the keys below kv_len.
  for b in range(B):
    if int(kv_len[b]) == 0:
      assert float(jnp.abs(got[b]).max()) == 0.0


def test_bf16_matches_fp32_reference():
  q, k, v = (jax.random.normal(key, shape) for key, shape in zip(
      jax.random.split(jax.random.key(1), 3), [(1, 64, 2, 64), (1, 256, 2, 64), (1, 256, 2, 64)]))
  q_start, kv_len = jnp.array([150]), jnp.array([214])
  ref = ca.cached_attention_reference(q, k, v, q_start, kv_len)
  bf = lambda x: x.astype(jnp.bfloat16)
  got = ca.cached_attention(bf(q), bf(k), bf(v), q_start, kv_len, interpret=True)
  assert got.dtype == jnp.bfloat16 and rel_err(got.astype(jnp.float32), ref) < 1e-2


def test_mismatched_shapes_raise():
  q = jnp.zeros((1, 8, 2, 16))
  with pytest.raises(ValueError, match="cached_attention: k .* must be"):
    ca.cached_attention(q, jnp.zeros((1, 32, 3, 16)), jnp.zeros((1, 32, 3, 16)),
                        jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32))


def test_lowers_to_triton(h200):  # noqa: F811
  args = (jnp.zeros((1, 256, 2, 64), jnp.bfloat16), jnp.zeros((1, 1000, 2, 64), jnp.bfloat16),
          jnp.zeros((1, 1000, 2, 64), jnp.bfloat16), jnp.zeros(1, jnp.int32),
          jnp.ones(1, jnp.int32))
  fn = lambda *a: ca.cached_attention(*a, interpret=False)
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "cached_attention" in text
