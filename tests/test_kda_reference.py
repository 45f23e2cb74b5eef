"""Pure-JAX KDA: chunked vs the recurrent spec (fp64), segments, padding, gate and validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import kda, kda_gate, reference
from tests.conftest import rel_err



@pytest.fixture(autouse=True)
def _x64():
  """The spec runs in float64; scoped so other test modules keep JAX's default types."""
  jax.config.update("jax_enable_x64", True)
  yield
  jax.config.update("jax_enable_x64", False)


def _inputs(B, T, H, K, V, seed=0, lower_bound=-5.0, dtype=jnp.float64):
  rng = np.random.default_rng(seed)
  normed = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q, k = normed(rng.normal(size=(B, T, H, K))), normed(rng.normal(size=(B, T, H, K)))
  v = rng.normal(size=(B, T, H, V))
  x = jnp.asarray(rng.normal(size=(B, T, H, K)))
  g = kda_gate(x, jnp.asarray(rng.normal(size=H)), jnp.asarray(rng.normal(size=H * K)),
               lower_bound=lower_bound)
  beta = 1 / (1 + np.exp(-rng.normal(size=(B, T, H))))
  S0 = rng.normal(size=(B, H, K, V))
  cast = lambda a: jnp.asarray(a, dtype)
  return tuple(map(cast, (q, k, v, g, beta))), cast(S0)


@pytest.mark.parametrize("T,chunk", [(1, 16), (17, 16), (63, 32), (65, 64), (130, 32)])
def test_chunked_equals_recurrent_fp64(T, chunk):
  (q, k, v, g, beta), S0 = _inputs(2, T, 3, 16, 8, seed=T)
  o_ref, S_ref = reference.kda_recurrent(q, k, v, g, beta, initial_state=S0)
  o, S = reference.kda_chunked(q, k, v, g, beta, initial_state=S0, chunk_size=chunk)
  assert o.dtype == jnp.float64
  assert rel_err(o, o_ref) < 1e-12 and rel_err(S, S_ref) < 1e-12


def test_chunked_gradients_equal_recurrent():
  (q, k, v, g, beta), S0 = _inputs(1, 40, 2, 8, 8, seed=7)
  w = jnp.asarray(np.random.default_rng(1).normal(size=(1, 40, 2, 8)))
  loss = lambda fn: lambda *a: (fn(*a[:5], initial_state=a[5])[0] * w).sum() + fn(
      *a[:5], initial_state=a[5])[1].sum()
  chunked = lambda *a, **kw: reference.kda_chunked(*a, chunk_size=16, **kw)
  ga = jax.grad(loss(chunked), argnums=range(6))(q, k, v, g, beta, S0)
  gb = jax.grad(loss(reference.kda_recurrent), argnums=range(6))(q, k, v, g, beta, S0)
  for name, a, b in zip(["q", "k", "v", "g", "beta", "S0"], ga, gb):
    assert rel_err(a, b) < 1e-10, name


@pytest.mark.parametrize("impl", ["xla", "recurrent"])
def test_segments_equal_separate_documents(impl):
  """Documents of length 1..30 packed with padding give each document's own output."""
  lengths = [5, 1, 30, 12]
  T = 64
  (q, k, v, g, beta), _ = _inputs(1, T, 2, 16, 16, seed=3)
  seg = np.zeros((1, T), np.int32)
  starts = np.cumsum([0] + lengths[:-1])
  for i, (s, n) in enumerate(zip(starts, lengths)):
    seg[0, s:s + n] = i + 1
  o, S = kda(q, k, v, g, beta, segment_ids=jnp.asarray(seg), output_final_state=True,
             chunk_size=16, implementation=impl)
  for s, n in zip(starts, lengths):
    sl = slice(s, s + n)
    o_doc, S_doc = reference.kda_recurrent(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl])
    assert rel_err(o[:, sl], o_doc) < 1e-12
  assert rel_err(S, S_doc) < 1e-12  # padding leaves the last document's state untouched
  assert float(jnp.abs(o[:, sum(lengths):]).max()) == 0.0


def test_gate_bounds_and_legacy():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 3, 4)) * 10)
  A_log, dt = jnp.zeros(3), jnp.zeros(12)
  g = kda_gate(x, A_log, dt, lower_bound=-2.0)
  assert g.dtype == jnp.float32 or g.dtype == jnp.float64
  assert float(g.min()) >= -2.0 and float(g.max()) <= 0.0
  expected = -2.0 / (1 + np.exp(-np.asarray(x)))
  assert rel_err(g, expected) < 1e-6
  legacy = kda_gate(x, A_log, dt, lower_bound=None)
  assert rel_err(legacy, -np.logaddexp(0, np.asarray(x))) < 1e-6
  for bad in (-8.0, 0.0, 0.5):
    with pytest.raises(ValueError, match=f"lower_bound must be in \\[-5, 0\\).*got {bad}"):
      kda_gate(x, A_log, dt, lower_bound=bad)
  with pytest.raises(ValueError, match="A_log must have shape"):
    kda_gate(x, jnp.zeros(4), dt)


def test_extreme_gates_stay_finite():
  """All gates at the lower bound over a long sequence, and large unbounded legacy gates."""
  (q, k, v, _, beta), S0 = _inputs(1, 300, 2, 16, 16, seed=5)
  for g in (jnp.full(q.shape, -5.0), jnp.full(q.shape, -1e-6), -jnp.abs(q) * 1e3):
    o_ref, S_ref = reference.kda_recurrent(q, k, v, g, beta, initial_state=S0)
    o, S = reference.kda_chunked(q, k, v, g, beta, initial_state=S0, chunk_size=64)
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(S)).all()
    assert rel_err(o, o_ref) < 1e-10 and rel_err(S, S_ref) < 1e-10


def test_fp32_inputs_meet_bound():
  (q, k, v, g, beta), S0 = _inputs(2, 100, 2, 32, 16, seed=9)
  o_ref, _ = reference.kda_recurrent(q, k, v, g, beta, initial_state=S0)
  o, S = kda(*(x.astype(jnp.float32) for x in (q, k, v, g, beta)),
             initial_state=S0.astype(jnp.float32), output_final_state=True, chunk_size=32)
  assert o.dtype == jnp.float32 and S.dtype == jnp.float32
  assert rel_err(o, o_ref) < 1e-4


def test_kda_rejects_bad_input():
  (q, k, v, g, beta), _ = _inputs(1, 8, 2, 4, 4)
  with pytest.raises(ValueError, match=r"g is a log-decay and must be <= 0"):
    kda(q, k, v, -g + 0.1, beta)
  with pytest.raises(ValueError, match=r"k must match q's shape"):
    kda(q, k[:, :4], v, g, beta)
  with pytest.raises(ValueError, match=r"beta must be \[B,T,H\]"):
    kda(q, k, v, g, beta[..., :1])
  with pytest.raises(ValueError, match=r"chunk_size must be one of .*got 48"):
    kda(q, k, v, g, beta, chunk_size=48)
  with pytest.raises(ValueError, match=r"implementation must be None or one of"):
    kda(q, k, v, g, beta, implementation="cuda")
  with pytest.raises(ValueError, match=r"segment_ids must be an integer \[B,T\]"):
    kda(q, k, v, g, beta, segment_ids=jnp.ones((1, 7), jnp.int32))
