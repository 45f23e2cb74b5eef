"""The few-rows matmul kernel (decode projections): equals XLA's dot in interpret mode, with
XLA's gradients, takes DenseGeneral's contractions, falls back where it does not fit, lowers
to Triton."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.matmul import pallas_gpu_few_rows as few_rows, reference
from tests.conftest import count_calls, rel_err
from tests.test_kda_triton_lowering import h200  # noqa: F401 — fixture


def _normal(shape, seed, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


@pytest.mark.parametrize("M,K,N,dtype,bound", [(1, 1024, 256, jnp.float32, 1e-5),
                                               (8, 704, 96, jnp.float32, 1e-5),
                                               (16, 128, 1024, jnp.bfloat16, 1e-2)])
def test_matmul_equals_xla(M, K, N, dtype, bound):
  x, w = _normal((M, K), M, dtype), _normal((K, N), K, dtype)
  got = few_rows.matmul(x, w, interpret=True)
  ref = reference.matmul(x, w)
  assert got.shape == (M, N) and got.dtype == dtype
  assert rel_err(got, ref) < bound


def test_gradients_are_xlas():
  """The kernel is the forward; dx and dw come from XLA's products (fp32): a loss through a
  3-row projection has the gradients of lax.dot's."""
  x, w, dy = _normal((3, 128), 1), _normal((128, 64), 2), _normal((3, 64), 3)
  loss = lambda f: lambda x, w: jnp.sum(f(x, w) * dy)
  got = jax.grad(loss(functools.partial(few_rows.matmul, interpret=True)), (0, 1))(x, w)
  want = jax.grad(loss(reference.matmul), (0, 1))(x, w)
  for g, r in zip(got, want):
    assert g.shape == r.shape and rel_err(g, r) < 1e-5


def test_dot_general_takes_dense_general_contractions(monkeypatch):
  """o_proj-like: [B, T, H, Dh] · [H, Dh, D] over (H, Dh); 3 rows use the kernel, 40 rows
  and a 100-column output fall back to XLA; all equal lax.dot_general."""
  dg = functools.partial(few_rows.dot_general, interpret=True)
  calls = count_calls(monkeypatch, few_rows, "matmul")
  for B, T, D in [(3, 1, 64), (4, 10, 64), (3, 1, 100)]:
    x, w = _normal((B, T, 4, 64), B * T), _normal((4, 64, D), D)
    dn = (((2, 3), (0, 1)), ((), ()))
    got = dg(x, w, dn)
    assert got.shape == (B, T, D)
    assert rel_err(got, jax.lax.dot_general(x, w, dn)) < 1e-5
  assert len(calls) == 1   # only the first fits: ≤ 16 rows, N % 32 == 0


def test_matmul_rejects_shapes_it_cannot_take():
  with pytest.raises(ValueError, match=r"few_rows.matmul needs .*got x \(17, 64\)"):
    few_rows.matmul(jnp.ones((17, 64)), jnp.ones((64, 32)), interpret=True)
  with pytest.raises(ValueError, match=r"K % 64 == 0"):
    few_rows.matmul(jnp.ones((2, 48)), jnp.ones((48, 32)), interpret=True)


@pytest.mark.parametrize("K,N", [(1024, 704), (704, 1024)])
def test_matmul_lowers_to_triton(h200, K, N):  # noqa: F811
  fn = lambda x, w: few_rows.matmul(x, w, interpret=False)
  args = (jnp.zeros((4, K), jnp.bfloat16), jnp.zeros((K, N), jnp.bfloat16))
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "few_rows_matmul" in text


def test_k_splits_fill_the_grid():
  """[1024, 1024]: 32 column blocks × 8 K splits; K = 704 (11 steps) can only split by 11
  (352 programs) or not at all (32); a wide N is not split."""
  assert few_rows.k_splits(1024, 1024) == 8
  assert few_rows.k_splits(704, 1024) == 11
  assert few_rows.k_splits(704, 64) == 11
  assert few_rows.k_splits(1024, 8192) == 1
