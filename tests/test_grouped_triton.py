"""The Triton grouped-matmul kernels (pallas_kernels/moe/triton_gpu_grouped.py) in Triton's
interpreter here (natively in the GPU suite): y, dx (w transposed in place) and dw against
an fp64 per-group reference, with empty groups, a group of one row, groups over several
row blocks, a group on a block boundary, NaN in the padding rows past the groups, and
output dims that the tile does not divide (masked columns); the model's custom VJP
(`grouped_matmul(..., "triton")`) against jax.lax.ragged_dot; bad input; and the kernels'
sm_90a builds at the shipped tiles (registers, spills, shared memory)."""

import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.kernel_registers import triton_report
from pallas_kernels import triton_launch
from pallas_kernels.moe import ops as moe_ops
from pallas_kernels.moe import triton_gpu_grouped as tg
# the Mosaic kernels' test cases' operands (NaN past the groups) and fp64 per-group products
from tests.test_grouped_mgpu import _f64, _operands, _per_group, _rel, check_model_vjp

INTERPRET = jax.default_backend() != "gpu"
SMALL = tg.Config(block_m=64, block_n=64, block_k=32, warps=4, stages=2, group_m=2)
SIZES = [0, 70, 1, 0, 129, 64]   # 264 rows used of 300: empty, one row, 3 blocks, aligned


# N = 80: the 64-wide tile's second column block is a quarter full (masked loads and stores)
@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("N", [128, 80])
def test_ragged_dot_matches_per_group_products(transpose_rhs, N):
  M, K = 300, 96
  lhs, _, w = _operands(M, K, N, SIZES)
  if transpose_rhs:          # as dx: w [G, N_out, K_contracted], read transposed in place
    w = jnp.swapaxes(w, 1, 2)
  used = sum(SIZES)
  got = tg.ragged_dot(lhs, w, jnp.asarray(SIZES), config=SMALL, transpose_rhs=transpose_rhs,
                      interpret=INTERPRET)
  assert got.shape == (M, N) and got.dtype == jnp.bfloat16
  w64 = _f64(w)
  ref = np.concatenate(_per_group(SIZES, lambda g, r: _f64(lhs)[r] @ (
      w64[g].T if transpose_rhs else w64[g])))
  got = _f64(got)[:used]
  assert np.isfinite(got).all()
  assert _rel(got, ref) < 4e-3      # bf16 output rounding (measured 1.7e-3)


@pytest.mark.parametrize("K,N", [(96, 128), (80, 48)])
def test_ragged_dw_matches_per_group_products_and_ignores_padding(K, N):
  """(80, 48): neither output dim divides the 64 × 64 tile."""
  M = 300
  x, dy, _ = _operands(M, K, N, SIZES, seed=1)
  got = _f64(tg.ragged_dw(x, dy, jnp.asarray(SIZES), config=SMALL, interpret=INTERPRET))
  ref = np.stack(_per_group(SIZES, lambda g, r: _f64(x)[r].T @ _f64(dy)[r]))
  assert got.shape == (len(SIZES), K, N) and np.isfinite(got).all()
  assert _rel(got, ref) < 4e-3
  assert not got[np.asarray(SIZES) == 0].any()     # empty groups: exact zeros


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("N", [128, 80])
def test_ragged_dx_gated_silu_matches_the_swiglu_backward(N, weighted):
  """The down projection's dx with the SwiGLU's backward as its epilogue: dh = d(silu(gate)
  · up) and a = silu(gate) · up against fp64 from the same bf16 operands, NaN in the padding
  rows, N = 80 with a masked column block; the rows past the groups stay unwritten. Weighted
  (each row's activation times its routing weight): a and dh with the weight, and the
  weight's gradient Σ da · silu(gate) · up (0 past the groups)."""
  M, K = 300, 96
  rng = np.random.default_rng(5)
  used = sum(SIZES)
  dy, h = rng.normal(size=(M, K)), 2 * rng.normal(size=(M, 2 * N))
  dy[used:], h[used:] = np.nan, np.nan
  w = rng.normal(size=(len(SIZES), N, K)) / np.sqrt(K)
  dy, h, w = (jnp.asarray(a, jnp.bfloat16) for a in (dy, h, w))
  rw = rng.uniform(0.1, 1.0, size=M)
  out = tg.ragged_dx_gated_silu(dy, w, h, jnp.asarray(SIZES),
                                jnp.asarray(rw, jnp.float32) if weighted else None,
                                config=SMALL, interpret=INTERPRET)
  dh, a = out[:2]
  assert dh.shape == (M, 2 * N) and a.shape == (M, N) and dh.dtype == jnp.bfloat16
  da = np.concatenate(_per_group(SIZES, lambda g, r: _f64(dy)[r] @ _f64(w)[g].T))
  gate, up = _f64(h)[:used, :N], _f64(h)[:used, N:]
  sig = 1 / (1 + np.exp(-gate))
  scale = np.asarray(rw, np.float32)[:used, None].astype(np.float64) if weighted else 1.0
  ref_dh = np.concatenate([da * up * sig * (1 + gate * (1 - sig)), da * gate * sig], 1) * scale
  got_dh, got_a = _f64(dh)[:used], _f64(a)[:used]
  assert np.isfinite(got_dh).all() and np.isfinite(got_a).all()
  assert _rel(got_dh, ref_dh) < 5e-3    # da rounded to bf16 as the unfused path stores it (2.3e-3)
  assert _rel(got_a, gate * sig * up * scale) < 4e-3    # bf16 output rounding (1.7e-3)
  if weighted:
    dw = np.asarray(out[2], np.float64)
    assert out[2].shape == (M,) and not dw[used:].any()
    assert _rel(dw[:used], (da * gate * sig * up).sum(1)) < 5e-3   # da in bf16, as for dh


# An opt-in (model.moe.swiglu_grad_in_kernel): make test keeps the weighted 128-wide case.
@pytest.mark.parametrize("F,weighted", [(128, True)] + [
    pytest.param(F, w, marks=pytest.mark.slow) for F, w in ((80, False), (80, True), (128, False))])
def test_swiglu_with_the_gradient_in_kernel_matches_xla(F, weighted):
  """experts.swiglu_grouped on `triton` (its down projection through ops.swiglu_down) against
  XLA's ragged_dot in fp32 from the same bf16 operands: y and the gradients of x, gate_up
  and down. F = 80: Triton's dw for the down projection; 128: Mosaic's. Weighted: each row's
  activation times its routing weight (model.moe.weights_before_down), and the weights'
  gradient too."""
  from moe_jax.model import experts
  M, D, sizes = 200, 64, jnp.asarray([90, 0, 45, 65], jnp.int32)
  assert moe_ops.swiglu_grad_in_kernel("triton", F, D)
  rng = np.random.default_rng(6)
  bf = lambda *s, scale=1.0: jnp.asarray(scale * rng.normal(size=s), jnp.bfloat16)
  x, gate_up, down = bf(M, D), bf(4, D, 2, F, scale=0.3), bf(4, F, D, scale=0.2)
  rw = jnp.asarray(rng.uniform(0.1, 1.0, size=M), jnp.float32)
  ct = jnp.asarray(rng.normal(size=(M, D)), jnp.float32)

  def run(impl, *args):
    f = lambda x, gu, dn, w: experts.swiglu_grouped(x, sizes, gu, dn, impl,
                                                    grad_in_kernel=True, w_M=w)
    args = (*args, rw) if weighted else args
    y, vjp = jax.vjp(f if weighted else (lambda *a: f(*a, None)), *args)
    return (y, *vjp(ct.astype(y.dtype)))

  got = run("triton", x, gate_up, down)
  with jax.default_matmul_precision("highest"):
    ref = run("xla", *(a.astype(jnp.float32) for a in (x, gate_up, down)))
  for name, a, b in zip(("y", "dx", "dgate_up", "ddown", "dweights"), got, ref):
    a, b = _f64(a), _f64(b)
    assert a.shape == b.shape and np.isfinite(a).all(), name
    assert _rel(a, b) < 1e-2, (name, _rel(a, b))


@pytest.mark.parametrize("M,N", [(200, 144), (256, 128)])
def test_model_vjp_matches_xla_ragged_dot(M, N):
  """grouped_matmul(..., "triton") at the shipped tiles (default_config): N off the tile and
  off Mosaic's 64-multiples (Triton's dw), then on them (Mosaic's dw)."""
  check_model_vjp("triton", M, 64, N, [100, 0, M - 165, 65])


def test_bad_input_is_named():
  x = jnp.ones((64, 96), jnp.bfloat16)
  with pytest.raises(ValueError, match="K=96 must be a multiple of block_k=64"):
    tg.ragged_dot(x, jnp.ones((1, 96, 64), jnp.bfloat16), jnp.array([64]),
                  config=tg.Config(block_k=64), interpret=True)
  with pytest.raises(ValueError, match="bfloat16/float16 operands"):
    tg.ragged_dw(jnp.ones((64, 64)), jnp.ones((64, 64)), jnp.array([64]), interpret=True)
  with pytest.raises(ValueError, match=r"grouped_matmul='triton' takes .* multiples of 16, "
                                       r"got bfloat16 \[40, 64\]"):
    moe_ops.grouped_matmul(jnp.ones((8, 40), jnp.bfloat16), jnp.ones((2, 40, 64), jnp.bfloat16),
                           jnp.array([4, 4]), "triton")


# single_h200's experts (d 2048, 2 × 1024 gate/up; second tier) and long_context_1b's
# (1024, 2 × 704)
@pytest.mark.parametrize("K,N", [pytest.param(2048, 2048, marks=pytest.mark.slow), (704, 1024)])
def test_compiles_for_h200_within_registers_and_shared_memory(K, N):
  """y, dx and dw at their default tiles, built as jax_triton builds them for sm_90a: no
  spills (the 128 × 256 fp32 accumulator is 128 registers a thread at 8 warps), within the
  H200's shared memory, and the loads pipelined (cp.async) into wgmma."""
  M, G = 98304, 32
  bf = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((G,), jnp.int32)
  for product in ("y", "dx", "dw"):
    c = tg.default_config(product, K, N)
    meta = dict(M=M, K=K, N=N, G=G, GP=32, BM=c.block_m, BN=c.block_n, BK=c.block_k)
    if product == "dw":
      kernel, arrays = tg._grouped_dw_triton, [sizes, bf(M, K), bf(M, N), bf(G, K, N)]
    else:
      kernel, arrays = tg._grouped_dot_triton, [sizes, bf(M, K), bf(G, K, N), bf(M, N)]
      meta.update(TRANSPOSE=product == "dx", GROUP_M=c.group_m)
    compiled = triton_launch.build(kernel, arrays, meta, c.stages, c.warps)
    regs, spilled = triton_report(compiled, tempfile.mkdtemp())
    ptx = compiled.asm["ptx"]
    assert compiled.metadata.shared <= triton_launch.MAX_SHARED[90], (product, c)
    assert 0 < regs <= 255 and spilled == 0, (product, regs, spilled)
    assert "wgmma.mma_async" in ptx and "cp.async" in ptx, product
  # The down projection's dx with the SwiGLU's backward (here N = F, K = D): its epilogue
  # works EPILOGUE_COLUMNS at a time (the whole tile at once spilled 5 KB a thread); also
  # with the rows' routing weights (model.moe.weights_before_down).
  c = tg.default_config("dx", N, K)
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  for weighted in (False, True):
    meta = dict(M=M, K=N, N=K, G=G, GP=32, BM=c.block_m, BN=c.block_n, BK=c.block_k,
                SUB=tg.EPILOGUE_COLUMNS, GROUP_M=c.group_m, WEIGHTED=weighted)
    compiled = triton_launch.build(tg._grouped_dx_gated_silu_triton,
                                   [sizes, bf(M, N), bf(G, K, N), bf(M, 2 * K), f32(M),
                                    bf(M, 2 * K), bf(M, K), f32(M, 4)], meta, c.stages, c.warps)
    regs, spilled = triton_report(compiled, tempfile.mkdtemp())
    assert 0 < regs <= 255 and spilled == 0, ("dx_gated_silu", weighted, regs, spilled)
    assert compiled.metadata.shared <= triton_launch.MAX_SHARED[90]


def test_interpreted_launches_on_several_threads():
  """Triton's interpreter patches triton.language for a launch's length: launches from
  several threads at once (XLA's CPU runtime runs a grouped matmul's independent dx and dw
  callbacks side by side) take turns (triton_launch._INTERPRETER_LOCK); without it 2 of 3
  threads here failed mid-kernel."""
  x, dy, _ = _operands(256, 64, 96, [100, 56, 0, 100], seed=4)
  sizes = jnp.asarray([100, 56, 0, 100])
  ref = np.stack(_per_group([100, 56, 0, 100], lambda g, r: _f64(x)[r].T @ _f64(dy)[r]))
  results, errors = [], []

  def work():
    try:
      for _ in range(3):
        results.append(_f64(tg.ragged_dw(x, dy, sizes, config=SMALL, interpret=True)))
    except Exception as e:  # noqa: BLE001 — collected, asserted below
      errors.append(repr(e)[:200])

  threads = [threading.Thread(target=work) for _ in range(3)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors and len(results) == 9
  assert all(_rel(r, ref) < 4e-3 for r in results)
