"""The Mosaic GPU grouped-matmul kernels (pallas_kernels/moe/mosaic_gpu_grouped.py) in
Pallas's Mosaic GPU interpreter here (natively in the GPU suite): y, dx (w transposed in place) and dw
against an fp64 per-group reference, with empty groups, a group of one row, groups over
several row blocks, a group on a block boundary, NaN in the padding rows past the groups
and a row count off TMA's 8-row tile;
the model's custom VJP against jax.lax.ragged_dot; the lowering of long_context_1b's six
products to Mosaic GPU for CUDA; and the `mosaic` route's dx choice (tokamax's kernel where
only 64-wide tiles fit)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import ops as moe_ops
from pallas_kernels.moe import mosaic_gpu_grouped as gm
from tests.conftest import target_mesh

INTERPRET = jax.default_backend() != "gpu"
SMALL = gm.Config(block_m=64, block_n=64, block_k=64, stages=2)
SIZES = [0, 70, 1, 0, 129, 64]   # 264 rows used of 320: empty, one row, 3 blocks, aligned


def _operands(M, K, N, sizes, seed=0):
  rng = np.random.default_rng(seed)
  used = sum(sizes)
  x = rng.normal(size=(M, K))
  dy = rng.normal(size=(M, N))
  x[used:], dy[used:] = np.nan, np.nan     # the grouped matmul leaves such rows unwritten
  w = rng.normal(size=(len(sizes), K, N)) / np.sqrt(K)
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)
  return bf(x), bf(dy), bf(w)


def _per_group(sizes, fn):
  ends = np.cumsum(sizes)
  return [fn(g, slice(s, e)) for g, (s, e) in enumerate(zip(ends - np.asarray(sizes), ends))]


def _f64(a):
  return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _rel(a, b):
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_ragged_dot_matches_per_group_products(transpose_rhs):
  M, K, N = 320, 128, 192
  x, dy, w = _operands(M, K, N, SIZES)
  used = sum(SIZES)
  lhs = dy if transpose_rhs else x
  got = gm.ragged_dot(lhs, w, jnp.asarray(SIZES), config=SMALL, transpose_rhs=transpose_rhs,
                      interpret=INTERPRET)
  assert got.shape == (M, K if transpose_rhs else N) and got.dtype == jnp.bfloat16
  w64 = _f64(w)
  ref = np.concatenate(_per_group(SIZES, lambda g, r: _f64(lhs)[r] @ (
      w64[g].T if transpose_rhs else w64[g])))
  got = _f64(got)[:used]
  assert np.isfinite(got).all()
  assert _rel(got, ref) < 4e-3      # bf16 output rounding


def test_row_counts_off_the_tma_tile():
  """M = 28 rows (not a multiple of 8): y, dx and dw of the rows used, through the padded
  operands, and y of M rows."""
  sizes = [9, 0, 12, 3]                 # 24 rows used of 28
  x, dy, w = _operands(28, 64, 64, sizes, seed=2)
  used = sum(sizes)
  for transpose_rhs, lhs in ((False, x), (True, dy)):
    got = gm.ragged_dot(lhs, w, jnp.asarray(sizes), config=SMALL, transpose_rhs=transpose_rhs,
                        interpret=INTERPRET)
    assert got.shape == (28, 64)
    ref = np.concatenate(_per_group(sizes, lambda g, r: _f64(lhs)[r] @ (
        _f64(w)[g].T if transpose_rhs else _f64(w)[g])))
    assert _rel(_f64(got)[:used], ref) < 4e-3
  got = _f64(gm.ragged_dw(x, dy, jnp.asarray(sizes), config=SMALL, interpret=INTERPRET))
  ref = np.stack(_per_group(sizes, lambda g, r: _f64(x)[r].T @ _f64(dy)[r]))
  assert np.isfinite(got).all() and _rel(got, ref) < 4e-3


def test_ragged_dw_matches_per_group_products_and_ignores_padding():
  M, K, N = 320, 128, 192
  x, dy, _ = _operands(M, K, N, SIZES, seed=1)
  for config in (SMALL, gm.Config(block_m=128, block_n=64, block_k=128, stages=3)):
    got = _f64(gm.ragged_dw(x, dy, jnp.asarray(SIZES), config=config, interpret=INTERPRET))
    ref = np.stack(_per_group(SIZES, lambda g, r: _f64(x)[r].T @ _f64(dy)[r]))
    assert got.shape == (len(SIZES), K, N) and np.isfinite(got).all()
    assert _rel(got, ref) < 4e-3
    assert not got[np.asarray(SIZES) == 0].any()     # empty groups: exact zeros


def check_model_vjp(impl, M, K, N, sizes):
  """moe_ops.grouped_matmul(..., impl): y and both gradients against XLA's ragged_dot in
  fp32 (the same bf16-rounded operands), to 1e-2."""
  sizes = jnp.asarray(sizes, jnp.int32)
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=(len(sizes), K, N)) / 8, jnp.bfloat16)
  ct = jnp.asarray(rng.normal(size=(M, N)), jnp.float32)

  def run(impl, x, w):
    y, vjp = jax.vjp(lambda x, w: moe_ops.grouped_matmul(x, w, sizes, impl), x, w)
    return (y, *vjp(ct.astype(y.dtype)))

  got = run(impl, x, w)
  with jax.default_matmul_precision("highest"):
    ref = run("xla", x.astype(jnp.float32), w.astype(jnp.float32))
  for name, a, b in zip(("y", "dx", "dw"), got, ref):
    a, b = _f64(a), _f64(b)
    assert a.shape == b.shape and np.isfinite(a).all(), name
    assert _rel(a, b) < 1e-2, name


def test_model_vjp_matches_xla_ragged_dot():
  check_model_vjp("mosaic", 256, 64, 128, [100, 0, 91, 65])


def test_bad_shapes_are_named():
  x = jnp.ones((64, 96), jnp.bfloat16)
  with pytest.raises(ValueError, match="K=96 and N=64 must be multiples of block_k=64"):
    gm.ragged_dot(x, jnp.ones((1, 96, 64), jnp.bfloat16), jnp.array([64]), config=SMALL,
                  interpret=True)
  with pytest.raises(ValueError, match="bfloat16/float16 operands"):
    gm.ragged_dw(jnp.ones((64, 64)), jnp.ones((64, 64)), jnp.array([64]), interpret=True)


@pytest.mark.parametrize("M", [4096, 28])   # 28: a prefill of 7 tokens of 2 rows at top-2
@pytest.mark.parametrize("K,N", [(1024, 1408), (704, 1024)])   # long_context_1b's experts
def test_long_context_1b_products_lower_to_mosaic_gpu(K, N, M):
  """Each product at the 1B's shapes, with its tuned (or default) tile, lowers for CUDA: the
  Mosaic GPU layout inference and lowering run here, PTX compilation only on the GPU. Row
  counts that are not a multiple of TMA's 8-row tile too."""
  G = 32
  sd = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((G,), jnp.int32)
  native = dict(interpret=False)
  for fn, args in ((lambda x, w, s: gm.ragged_dot(x, w, s, **native),
                    (sd(M, K), sd(G, K, N), sizes)),
                   (lambda d, w, s: gm.ragged_dot(d, w, s, transpose_rhs=True, **native),
                    (sd(M, N), sd(G, K, N), sizes)),
                   (lambda x, d, s: gm.ragged_dw(x, d, s, **native),
                    (sd(M, K), sd(M, N), sizes))):
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("implementation", ["mosaic", ""])
def test_model_path_lowers_to_the_native_kernels_for_a_gpu_target(implementation):
  """Under a mesh of GPU devices (as an ahead-of-time compile for a GPU on this CPU host),
  the grouped matmul and its VJP lower to native kernels, not to the interpreter:
  `interpret` follows the target platform. `mosaic` is the three Mosaic GPU kernels; the
  default ('') is `triton` where jax_triton is installed (Triton's y and dx, Mosaic's dw)
  and `mosaic` elsewhere."""
  sd = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)

  def y_and_grads(x, w, sizes):
    y, vjp = jax.vjp(lambda x, w: moe_ops.grouped_matmul(x, w, sizes, implementation), x, w)
    return vjp(y)

  with target_mesh("gpu", "NVIDIA H200"):
    resolved = implementation or moe_ops.default_grouped_matmul(jnp.bfloat16, 1024, 1408)
    text = jax.jit(y_and_grads).trace(sd(4096, 1024), sd(32, 1024, 1408),
                                      jax.ShapeDtypeStruct((32,), jnp.int32)
                                      ).lower(lowering_platforms=("cuda",)).as_text()
  mosaic = {"grouped_mgpu_y_1024x1408", "grouped_mgpu_dx_1408x1024", "grouped_mgpu_dw_1024x1408"}
  if resolved == "triton":
    assert text.count("@triton_kernel_call_ffi(") == 2, text.count("@triton_kernel_call_ffi(")
    mosaic = {"grouped_mgpu_dw_1024x1408"}
  else:
    assert resolved == "mosaic", resolved
  for kernel in mosaic:
    assert f"{kernel}_mosaic_gpu" in text, kernel
  # y leaves through a barrier: XLA's dynamic-slice fusion would clone the kernel call
  # into a scan's residual store (moe_ops._gpu_grouped).
  assert "stablehlo.optimization_barrier" in text


@pytest.mark.parametrize("K,tokamax", [(64, True), (128, False)])
def test_mosaic_dx_takes_tokamax_where_only_64_wide_tiles_fit(monkeypatch, K, tokamax):
  """On a GPU host the down projection's dx (K = 704 in long_context_1b) is tokamax's kernel,
  faster there; K a multiple of 128 stays on grouped_mgpu. (Off a GPU host grouped_mgpu's
  interpreter stands in for tokamax, so the stand-in here has grouped_mgpu's numbers.)"""
  real = gm.ragged_dot
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(gm, "ragged_dot", functools.partial(real, interpret=True))
  calls = []
  monkeypatch.setattr(moe_ops, "_tokamax_dx", lambda dy, w, s: calls.append(w.shape) or
                      real(dy, w, s, transpose_rhs=True, interpret=True))
  sizes = jnp.asarray([40, 0, 24], jnp.int32)
  dy = jnp.asarray(np.random.default_rng(0).normal(size=(64, 128)), jnp.bfloat16)
  w = jnp.asarray(np.random.default_rng(1).normal(size=(3, K, 128)), jnp.bfloat16)
  dx = moe_ops.GPU_PRODUCTS["mosaic"][1](dy, w, sizes)
  assert calls == ([(3, K, 128)] if tokamax else [])
  ref = np.concatenate([_f64(dy)[:40] @ _f64(w)[0].T, _f64(dy)[40:64] @ _f64(w)[2].T])
  assert dx.shape == (64, K) and _rel(_f64(dx), ref) < 4e-3
