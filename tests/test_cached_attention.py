"""The Pallas inference attention kernels (interpret mode) against attention that
materialises every score — prefill over the cache, and split-cache latent decode — and their
Triton lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import pallas_gpu_cached as ca
from pallas_kernels.attention import pallas_gpu_latent_decode as ld
from pallas_kernels.attention import reference
from pallas_kernels.attention import pallas_tpu_cached as tca
from tests.conftest import rel_err
from tests.test_kda_triton_lowering import h200  # noqa: F401 — fixture


@pytest.mark.parametrize("B,T,H,D,Dv,S,q_start,kv_len", [
    # Rows at different offsets; a cache whose length is not a multiple of the key block
    # (the last block overlaps the one before); a row that sees nothing (zeros).
    (3, 40, 2, 32, 16, 300, [0, 100, 251], [40, 140, 260]),
    (2, 130, 1, 64, 64, 200, [0, 70], [130, 0]),
    (1, 5, 2, 16, 16, 20, [3], [8]),        # cache shorter than one key block
    (2, 33, 2, 24, 40, 90, [10, 0], [43, 33]),   # head dims that are not tiles: padded
    (2, 40, 2, 48, 32, 150, [0, 90], [40, 120]),   # two tiles (32 + 16): split, not padded
])
@pytest.mark.parametrize("kernel", ["gpu", "tpu"])
def test_equals_materialised_attention(kernel, B, T, H, D, Dv, S, q_start, kv_len):
  """The GPU kernel (interpret mode) and the Mosaic TPU kernel (TPU interpreter)."""
  kq, kk, kv = jax.random.split(jax.random.key(B * T + S), 3)
  q = jax.random.normal(kq, (B, T, H, D))
  k = jax.random.normal(kk, (B, S, H, D))
  v = jax.random.normal(kv, (B, S, H, Dv))
  q_start, kv_len = jnp.array(q_start), jnp.array(kv_len)
  if kernel == "gpu":
    got = ca.cached_attention(q, k, v, q_start, kv_len, interpret=True)
  else:
    got = tca.cached_attention(q, k, v, q_start, kv_len)
  ref = reference.cached_attention(q, k, v, q_start, kv_len)
  assert got.shape == (B, T, H, Dv) and np.isfinite(np.asarray(got)).all()
  assert rel_err(got, ref) < 1e-5
  # Row b's queries past its filled length see exactly the keys below kv_len.
  for b in range(B):
    if int(kv_len[b]) == 0:
      assert float(jnp.abs(got[b]).max()) == 0.0


def _reference_lse(q, k, q_start, kv_len, scale):
  s = jnp.einsum("bthd,bshd->bths", q, k) * scale
  pos = q_start[:, None] + jnp.arange(q.shape[1])
  j = jnp.arange(k.shape[1])
  visible = (j <= pos[..., None]) & (j < kv_len[:, None, None])
  return jax.nn.logsumexp(jnp.where(visible[:, :, None], s, -jnp.inf), -1)


def test_log_sum_exp_output():
  """return_lse: each query's log Σ exp of its visible scaled scores, -inf where it sees
  nothing (row 1 before its first key, row 2 with an empty cache); the output unchanged."""
  B, T, H, D, S = 3, 40, 2, 32, 300
  kq, kk, kv = jax.random.split(jax.random.key(7), 3)
  q = jax.random.normal(kq, (B, T, H, D))
  k = jax.random.normal(kk, (B, S, H, D))
  v = jax.random.normal(kv, (B, S, H, D))
  q_start, kv_len = jnp.array([0, -10, 5]), jnp.array([40, 200, 0])
  o, lse = ca.cached_attention(q, k, v, q_start, kv_len, return_lse=True, interpret=True)
  ref = _reference_lse(q, k, q_start, kv_len, D ** -0.5)
  assert lse.shape == (B, T, H) and lse.dtype == jnp.float32
  finite = np.isfinite(np.asarray(ref))
  assert (np.isfinite(np.asarray(lse)) == finite).all() and not finite[2].any()
  assert not finite[1, :10].any() and finite[1, 10:].all()
  assert np.abs(np.asarray(lse)[finite] - np.asarray(ref)[finite]).max() < 1e-4
  assert rel_err(o, reference.cached_attention(q, k, v, q_start, kv_len)) < 1e-5


@pytest.mark.parametrize("window", [64, 100])
def test_prefill_over_latents_in_windows(window, monkeypatch):
  """ops.latent_cache_attention's GPU prefill over a cache longer than a window: window by
  window, merged by log-sum-exp (interpret mode), equals attention over the fully expanded
  cache. Rows at different lengths, one whose filled length ends mid-window, a last window
  past the cache's end (300 is not a multiple of either window), and queries that precede a
  window (they see none of it)."""
  from pallas_kernels.attention import ops, xla_cached
  monkeypatch.setattr(xla_cached, "EXPAND_BLOCK", window)
  B, T, H, R, Dqk, Dv, S = 2, 40, 2, 32, 24, 16, 300
  ks = jax.random.split(jax.random.key(window), 4)
  q = jax.random.normal(ks[0], (B, T, H, Dqk)) * Dqk ** -0.5
  ckv = jax.random.normal(ks[1], (B, S, R))
  w_kb = jax.random.normal(ks[2], (R, H, Dqk)) * R ** -0.5
  w_vb = jax.random.normal(ks[3], (R, H, Dv)) * R ** -0.5
  length, filled = jnp.array([230, 50]), jnp.array([270, 90])
  got = jax.jit(lambda *a: ops.latent_cache_attention(*a, implementation="gpu"))(
      q, ckv, w_kb, w_vb, length, filled)
  k = jnp.einsum("bsr,rhd->bshd", ckv, w_kb)
  v = jnp.einsum("bsr,rhd->bshd", ckv, w_vb)
  ref = reference.cached_attention(q, k, v, length, filled, scale=1.0)
  assert got.shape == (B, T, H, Dv) and np.isfinite(np.asarray(got)).all()
  assert rel_err(got, ref) < 1e-5


def test_split_head_dim_equals_padded(monkeypatch):
  """Kimi's 192-wide query/key heads as two products (128 + 64) give the padded kernel's
  output and log-sum-exp; 24 = 16 + 8 is not two tiles and stays padded."""
  assert ca.head_split(192) == (128, 64) and ca.head_split(48) == (32, 16)
  assert ca.head_split(24) is None and ca.head_split(128) is None
  B, T, H, D, Dv, S = 1, 70, 2, 192, 128, 200
  kq, kk, kv = jax.random.split(jax.random.key(3), 3)
  q, k = jax.random.normal(kq, (B, T, H, D)), jax.random.normal(kk, (B, S, H, D))
  v = jax.random.normal(kv, (B, S, H, Dv))
  args = (q, k, v, jnp.array([100]), jnp.array([150]))
  split = ca.cached_attention(*args, return_lse=True, interpret=True)
  monkeypatch.setattr(ca, "SPLIT_HEAD_DIM", False)
  assert ca.head_split(192) is None
  padded = ca.cached_attention(*args, return_lse=True, interpret=True)
  ref = reference.cached_attention(*args)
  for a, b in zip(split, padded):
    assert rel_err(a, b) < 1e-6
  assert rel_err(split[0], ref) < 1e-5


def test_bf16_matches_fp32_reference():
  q, k, v = (jax.random.normal(key, shape) for key, shape in zip(
      jax.random.split(jax.random.key(1), 3), [(1, 64, 2, 64), (1, 256, 2, 64), (1, 256, 2, 64)]))
  q_start, kv_len = jnp.array([150]), jnp.array([214])
  ref = reference.cached_attention(q, k, v, q_start, kv_len)
  bf = lambda x: x.astype(jnp.bfloat16)
  got = ca.cached_attention(bf(q), bf(k), bf(v), q_start, kv_len, interpret=True)
  assert got.dtype == jnp.bfloat16 and rel_err(got.astype(jnp.float32), ref) < 1e-2


def test_mismatched_shapes_raise():
  q = jnp.zeros((1, 8, 2, 16))
  with pytest.raises(ValueError, match="cached_attention: k .* must be"):
    ca.cached_attention(q, jnp.zeros((1, 32, 3, 16)), jnp.zeros((1, 32, 3, 16)),
                        jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32))


@pytest.mark.parametrize("D,Dv,lse", [(64, 64, False), (24, 40, False), (192, 128, True)])
def test_lowers_to_triton(h200, D, Dv, lse):  # noqa: F811
  args = (jnp.zeros((1, 256, 2, D), jnp.bfloat16), jnp.zeros((1, 1000, 2, D), jnp.bfloat16),
          jnp.zeros((1, 1000, 2, Dv), jnp.bfloat16), jnp.zeros(1, jnp.int32),
          jnp.ones(1, jnp.int32))
  fn = lambda *a: ca.cached_attention(*a, return_lse=lse, interpret=False)
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "cached_attention" in text


# make test builds Kimi's dims (the larger tiles); 64 / 64 in the second tier.
@pytest.mark.parametrize("D,Dv", [pytest.param(64, 64, marks=pytest.mark.slow), (192, 128)])
def test_prefill_kernel_does_not_spill(D, Dv, tmp_path):
  """The prefill kernel at the launch width it ships with for each head dim, compiled for
  sm_90a by the triton package: no register spills, and shared memory within an H100/H200
  block's 232,448 bytes. At Kimi Linear's MLA dims (192 as 128 + 64, values 128) four
  warps spill 2,228 bytes a thread (2,308 padded to 256); the kernel launches 8 there
  (WIDE_NUM_WARPS)."""
  from benchmarks.kernel_registers import dump_ttir, ptxas_report, shared_bytes
  bf = lambda *shape: jnp.zeros(shape, jnp.bfloat16)
  fn = lambda q, k, v: ca.cached_attention(q, k, v, jnp.zeros(1, jnp.int32),
                                           jnp.full(1, 1024, jnp.int32), return_lse=True,
                                           interpret=False)
  kernels = dump_ttir(fn, (bf(1, 256, 2, D), bf(1, 1024, 2, D), bf(1, 1024, 2, Dv)),
                      str(tmp_path), stages=True)
  warps, stages = kernels["cached_attention"]
  assert warps == ca.num_warps(D) == (8 if D > 128 else 4)
  ttir = str(tmp_path / "cached_attention.ttir")
  assert ptxas_report(ttir, warps)[1] == 0
  assert shared_bytes(ttir, warps, stages) <= 232448


@pytest.mark.parametrize("B,Q,R,S,pos,kv_len", [
    # Decode rows of two rows at different lengths, a cache that is not a multiple of the
    # key block, and (small CHUNK) several chunks merged; a row that sees nothing.
    (2, 4, 32, 300, [[90] * 4, [250] * 4], [91, 251]),
    (1, 6, 16, 40, [[3, 3, 4, 4, 5, 5]], [6]),
    (2, 2, 32, 200, [[10, 10], [0, 0]], [11, 0]),
    # A rank above 256: fewer positions a step (launch_knobs), several of them per chunk.
    (1, 4, 512, 300, [[150, 150, 299, 299]], [280]),
    # Kimi Linear's latent with its shared key dims: two tiles, 512 + 64.
    (2, 4, 576, 300, [[150, 150, 299, 299], [7, 7, 8, 8]], [280, 9]),
    (1, 2, 48, 100, [[60, 99]], [100]),
])
def test_latent_decode_equals_materialised_attention(B, Q, R, S, pos, kv_len, monkeypatch):
  monkeypatch.setattr(ld, "CHUNK", 128)
  kq, kc = jax.random.split(jax.random.key(S + Q), 2)
  q = jax.random.normal(kq, (B, Q, R)) * R ** -0.5
  c = jax.random.normal(kc, (B, S, R))
  pos, kv_len = jnp.array(pos), jnp.array(kv_len)
  got = ld.latent_decode_attention(q, c, pos, kv_len, interpret=True)
  ref = reference.latent_attention(q, c, pos, kv_len)
  assert got.shape == (B, Q, R) and np.isfinite(np.asarray(got)).all()
  assert rel_err(got, ref) < 1e-5


def test_latent_decode_rejects_ranks_it_cannot_tile():
  assert [ld.rank_parts(R) for R in (16, 512, 576, 48, 24, 40, 8)] == [
      (16,), (512,), (512, 64), (32, 16), None, None, None]
  with pytest.raises(ValueError, match=r"sum of two \(e.g. 576 = 512 \+ 64\), got R=24"):
    ld.latent_decode_attention(jnp.zeros((1, 2, 24)), jnp.zeros((1, 64, 24)),
                               jnp.zeros((1, 2), jnp.int32), jnp.ones(1, jnp.int32))


@pytest.mark.parametrize("R", [256, 576])
def test_latent_decode_lowers_to_triton(h200, R):  # noqa: F811
  args = (jnp.zeros((1, 16, R), jnp.bfloat16), jnp.zeros((1, 5000, R), jnp.bfloat16),
          jnp.zeros((1, 16), jnp.int32), jnp.ones(1, jnp.int32))
  fn = lambda *a: ld.latent_decode_attention(*a, interpret=False)
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "latent_decode" in text


def test_tpu_kernel_lowers_to_mosaic():
  """Under a mesh of (abstract) TPU devices the prefill kernel is not interpreted: the
  program exported for TPU holds it as one Mosaic custom call."""
  import re

  from tests.conftest import target_mesh
  S = jax.ShapeDtypeStruct
  args = (S((2, 40, 2, 128), jnp.bfloat16), S((2, 300, 2, 128), jnp.bfloat16),
          S((2, 300, 2, 64), jnp.bfloat16), S((2,), jnp.int32), S((2,), jnp.int32))
  with target_mesh():
    exported = jax.export.export(jax.jit(tca.cached_attention), platforms=["tpu"])(*args)
  text = exported.mlir_module()
  assert re.findall(r'kernel_name = \\?"([\w-]+)', text) == ["tpu_cached_attention"]
  assert exported.out_avals[0].shape == (2, 40, 2, 64)
