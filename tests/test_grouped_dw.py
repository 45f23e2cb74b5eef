"""The grouped-matmul weight gradient kernel (pallas_kernels/moe/pallas_gpu_grouped_dw.py), in
interpret mode here (natively in the GPU suite): against jax.lax.ragged_dot's VJP, with empty groups,
groups of one row, groups longer than a block, a last block clamped at M, and NaN in the
rows past the groups."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import pallas_gpu_grouped_dw as gdw
from pallas_kernels.moe import reference
from tests.test_kda_triton_lowering import h200  # noqa: F401 — fixture

INTERPRET = jax.default_backend() != "gpu"


def _ref_dw(x, dy, sizes, K, N):
  """reference.ragged_dw, checked against jax.lax.ragged_dot's VJP too."""
  w0 = jnp.zeros((len(sizes), K, N), jnp.float32)
  _, vjp = jax.vjp(lambda w: jax.lax.ragged_dot(x, w, jnp.asarray(sizes)), w0)
  want = reference.ragged_dw(x, dy, jnp.asarray(sizes))
  np.testing.assert_allclose(np.asarray(vjp(dy)[0]), np.asarray(want), rtol=1e-4, atol=1e-4)
  return want


@pytest.mark.parametrize("sizes,M,K,N", [
    ([0, 1, 150, 0, 37], 200, 32, 48),    # empty, 1 row, 3 blocks, a block clamped at M - 64
    ([5, 20], 40, 16, 16),                # M below one block: padded
    ([64, 64, 64], 192, 64, 16),          # groups on block boundaries
])
def test_grouped_dw_matches_ragged_dot_vjp(sizes, M, K, N):
  rng = np.random.default_rng(len(sizes))
  used = sum(sizes)
  x = rng.normal(size=(M, K)).astype(np.float32)
  dy = rng.normal(size=(M, N)).astype(np.float32)
  x[used:], dy[used:] = np.nan, np.nan   # rows past the groups must never reach a sum
  got = gdw.grouped_dw(jnp.asarray(x), jnp.asarray(dy), jnp.asarray(sizes, jnp.int32),
                       interpret=INTERPRET)
  xz, dyz = np.nan_to_num(x, nan=0.0), np.nan_to_num(dy, nan=0.0)
  with jax.default_matmul_precision("highest"):
    ref = _ref_dw(jnp.asarray(xz), jnp.asarray(dyz), sizes, K, N)
  assert got.shape == (len(sizes), K, N) and np.isfinite(np.asarray(got)).all()
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=1e-4)
  assert not np.asarray(got)[np.asarray(sizes) == 0].any()   # empty groups get exact zeros


def test_grouped_dw_rejects_dims_off_16():
  with pytest.raises(ValueError, match="multiples of 16"):
    gdw.grouped_dw(jnp.ones((8, 24)), jnp.ones((8, 16)), jnp.array([8]), interpret=True)


@pytest.mark.parametrize("K,N", [(1024, 1408), (704, 1024)])   # long_context_1b's two dw shapes
def test_grouped_dw_lowers_to_triton(h200, K, N):  # noqa: F811
  args = (jnp.zeros((1000, K), jnp.bfloat16), jnp.zeros((1000, N), jnp.bfloat16),
          jnp.zeros((32,), jnp.int32))
  fn = lambda x, dy, s: gdw.grouped_dw(x, dy, s, interpret=False)
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "grouped_dw" in text


def test_reference_ragged_dot_is_xla_ragged_dot():
  """The spec of the grouped matmul: row blocks times their group's weights, with empty
  groups, and rows past the last group giving zeros (as XLA's ragged_dot writes them)."""
  rng = np.random.default_rng(3)
  sizes = jnp.asarray([3, 0, 5, 1])
  x = jnp.asarray(rng.normal(size=(11, 6)), jnp.float32)        # 2 rows past the groups
  w = jnp.asarray(rng.normal(size=(4, 6, 5)), jnp.float32)
  got = reference.ragged_dot(x, w, sizes)
  np.testing.assert_allclose(np.asarray(got), np.asarray(jax.lax.ragged_dot(x, w, sizes)),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(got[3:8]), np.asarray(x[3:8] @ w[2]), rtol=1e-5,
                             atol=1e-5)
  assert float(jnp.abs(got[9:]).max()) == 0.0
