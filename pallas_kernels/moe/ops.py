"""The MoE kernels' entry point: the grouped (ragged) matmul and its implementations.

A row block g of x (rows sorted by group) times w[g]. `jax.lax.ragged_dot` is emulated
densely on GPU (2% of peak, and at E=256 it tries to allocate 128 GiB on an H200), so
GPU/TPU use kernels for bf16/fp16:
* `triton` (the GPU default where both dims are multiples of 64 and jax_triton is
  installed): the native Triton kernels of triton_gpu_grouped.py for y and dx (two-warpgroup
  128 × 256 tiles, columns masked), Mosaic's dw. Against `mosaic`'s, Triton's y and dx take
  6–51% less time on seven of the eight products at the 1B's and single_h200's shapes (2%
  more on one); its dw is level with Mosaic's within the timing spread (benchmarks/moe.md),
  so dw stays Mosaic's where Mosaic's tiles fit until the train step shows otherwise;
* `mosaic`: the Mosaic GPU kernels of mosaic_gpu_grouped.py for y, dx (w read transposed
  in place) and dw, with tile shapes tuned per product on the H200 (benchmarks/moe.md);
  where dx's columns are not a multiple of 128 (only 64-wide tiles fit), tokamax's dx
  instead;
* `tokamax`: `tokamax.ragged_dot` (its sm90 Mosaic kernel, fixed 64×64 tiles) for y and dx;
  its weight gradient comes from pallas_gpu_grouped_dw.py instead, as tokamax 0.0.17's is
  wrong on the H200;
The GPU kernels take no float32, so float32 models (debugging, numerics checks) take XLA's
ragged_dot on GPU: exact, but dense in E. On TPU it is tokamax's Mosaic TPU kernel
(`implementation="mosaic_tpu"`, megablox-style gmm / tgmm, forward and backward), named
explicitly so that a program compiled for a TPU on a CPU host (pallas_kernels/platform.py)
gets it too; it takes K and N of at least 128, smaller experts fall back to XLA's
ragged_dot. tokamax is imported lazily: CPU runs never need it. reference.py holds the
exact spec.
"""

import functools
import importlib.util

import jax
import jax.numpy as jnp

from pallas_kernels import jax_triton_compat, platform
from pallas_kernels.moe import pallas_gpu_grouped_dw, mosaic_gpu_grouped
# Decoding (a few tokens): the routed experts (pallas_gpu_decode_experts.py) or the whole
# layer, router and shared expert included (pallas_gpu_decode_layer.py), as Pallas kernels:
# Triton on GPU, interpret elsewhere.
from pallas_kernels.moe.pallas_gpu_decode_experts import (  # noqa: F401 — re-exported
    fits as decode_experts_fit, swiglu_experts as decode_experts)
from pallas_kernels.moe.pallas_gpu_decode_layer import (  # noqa: F401 — re-exported
    fits as decode_layer_fits, moe_layer as decode_layer, route as decode_route,
    route_steps as decode_route_steps)

GROUPED_MATMULS = ("xla", "tokamax", "mosaic", "triton")
_HAS_TOKAMAX = importlib.util.find_spec("tokamax") is not None   # looked up, not imported


def default_grouped_matmul(dtype, K: int = 64, N: int = 64) -> str:
  """On GPU for bf16/fp16, where K and N (the expert's D and F) are multiples of 64: triton
  (Triton's y and dx, Mosaic's dw: 4.7% less a 1B step than mosaic, benchmarks/train.md),
  or mosaic where jax_triton is not installed; tokamax for other dims. xla for float32 on
  GPU (the GPU kernels are bf16/fp16 only) and on CPU; tokamax on TPU."""
  backend = platform.target()
  if backend == "cpu" or (backend == "gpu" and not _tokamax_gpu_dtype(dtype)):
    return "xla"
  if backend == "gpu" and mosaic_gpu_grouped.fits(K, N):
    return "triton" if platform.triton_available() else "mosaic"
  return "tokamax"


def _tokamax_gpu_dtype(dtype) -> bool:
  return jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)


def grouped_matmul(x_MxK, w_GxKxN, group_sizes_G, implementation: str = ""):
  """Row block g of x (rows sorted by group) times w[g].

  Rows past sum(group_sizes) are undefined (xla writes 0, tokamax's GPU kernel leaves
  them unwritten): callers with padding rows mask them.
  """
  K, N = w_GxKxN.shape[1:]
  implementation = implementation or default_grouped_matmul(x_MxK.dtype, K, N)
  if implementation == "xla":
    return jax.lax.ragged_dot(x_MxK, w_GxKxN, group_sizes_G)
  if implementation == "mosaic":
    if platform.target() == "tpu":
      raise ValueError("model.moe.grouped_matmul='mosaic' is the Mosaic GPU kernels; on TPU "
                       "use '' or 'tokamax'")
    if not _tokamax_gpu_dtype(x_MxK.dtype) or not mosaic_gpu_grouped.fits(K, N):
      raise ValueError(f"model.moe.grouped_matmul='mosaic' takes bfloat16/float16 experts "
                       f"with both dims multiples of 64, got {x_MxK.dtype} [{K}, {N}]; use '' "
                       f"(xla for float32, tokamax for other dims)")
    return _gpu_grouped_jit(x_MxK, w_GxKxN, group_sizes_G, "mosaic")
  if implementation == "triton":
    if platform.target() == "tpu":
      raise ValueError("model.moe.grouped_matmul='triton' is the Triton GPU kernels; on TPU "
                       "use '' or 'tokamax'")
    if not _tokamax_gpu_dtype(x_MxK.dtype) or not _triton_grouped().fits(K, N):
      raise ValueError(f"model.moe.grouped_matmul='triton' takes bfloat16/float16 experts "
                       f"with both dims multiples of 16, got {x_MxK.dtype} [{K}, {N}]; use '' "
                       f"(xla for float32)")
    return _gpu_grouped_jit(x_MxK, w_GxKxN, group_sizes_G, "triton")
  if implementation == "tokamax":
    target = platform.target()
    on_gpu = target == "gpu"
    if on_gpu and not _tokamax_gpu_dtype(x_MxK.dtype):
      raise ValueError(f"model.moe.grouped_matmul='tokamax' on GPU takes bfloat16/float16 "
                       f"inputs, got {x_MxK.dtype}; use '' (xla for float32) or "
                       f"model.dtype='bfloat16'")
    jax_triton_compat.patch_driver()
    import tokamax  # heavy optional dependency: the gpu/tpu extras install it

    if on_gpu:
      return _gpu_grouped_jit(x_MxK, w_GxKxN, group_sizes_G, "tokamax")
    if target == "tpu":  # the kernel takes dims >= 128; it raises otherwise and XLA's runs
      return tokamax.ragged_dot(x_MxK, w_GxKxN, group_sizes_G,
                                implementation=("mosaic_tpu", "xla"))
    return tokamax.ragged_dot(x_MxK, w_GxKxN, group_sizes_G)
  raise ValueError(f"grouped_matmul implementation must be one of {GROUPED_MATMULS} or '', "
                   f"got {implementation!r}")


F32 = jnp.float32
# dw's layout in ragged_dot_general terms: the rows (contracting dim) are split into groups.
_RAGGED_CONTRACTING = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])


def _tokamax_y(x_MxK, w_GxKxN, group_sizes_G):
  jax_triton_compat.patch_driver()
  import tokamax
  return tokamax.ragged_dot(x_MxK, w_GxKxN, group_sizes_G, implementation="mosaic")


def _tokamax_dx(dy_MxN, w_GxKxN, group_sizes_G):
  """tokamax's kernel takes w untransposed only: dx reads a transposed copy."""
  return _tokamax_y(dy_MxN, jnp.swapaxes(w_GxKxN, 1, 2), group_sizes_G)


def _tokamax_dw(x_MxK, dy_MxN, group_sizes_G):
  """pallas_gpu_grouped_dw.py: tokamax 0.0.17's dw kernel is wrong on the H200 (that module
  says how). Dims off its 16-multiples take XLA's exact (dense in G) version."""
  if pallas_gpu_grouped_dw.fits(x_MxK.shape[1], dy_MxN.shape[1]):
    return pallas_gpu_grouped_dw.grouped_dw(x_MxK, dy_MxN, group_sizes_G)
  return jax.lax.ragged_dot_general(x_MxK, dy_MxN, group_sizes_G, _RAGGED_CONTRACTING,
                                    preferred_element_type=F32)


def _mosaic_dx(dy_MxN, w_GxKxN, group_sizes_G):
  """dx by grouped_mgpu, except where dx's K columns take only 64-wide tiles (K not a
  multiple of 128: long_context_1b's 704-wide experts): there tokamax's kernel on a
  transposed copy of w is faster (2.5 ms less a 1B step; benchmarks/train.md). Only on a
  GPU host: tokamax's GPU kernel has no interpreter (CPU tests) and does not lower for a
  GPU from a CPU host (ahead-of-time compiles), where mosaic_gpu_grouped's does. Without
  tokamax installed (the `gpu` extra brings it) mosaic_gpu_grouped's runs everywhere."""
  if w_GxKxN.shape[1] % 128 and jax.default_backend() == "gpu" and _HAS_TOKAMAX:
    return _tokamax_dx(dy_MxN, w_GxKxN, group_sizes_G)
  return mosaic_gpu_grouped.ragged_dot(dy_MxN, w_GxKxN, group_sizes_G, transpose_rhs=True)


def _triton_grouped():
  """triton_gpu_grouped, imported on first use: the triton package is an optional
  dependency (the `gpu` and `test` extras), as for KDA's Triton kernels."""
  from pallas_kernels.moe import triton_gpu_grouped
  return triton_gpu_grouped


def _triton_dw(x_MxK, dy_MxN, group_sizes_G):
  """dw for `triton`: Mosaic's where its 64-multiples fit, since Triton's dw ran at half
  Mosaic's speed in the 1B step (benchmarks/moe.md, timed before its grid walked one
  group's tiles together); Triton's elsewhere."""
  if mosaic_gpu_grouped.fits(x_MxK.shape[1], dy_MxN.shape[1]):
    return mosaic_gpu_grouped.ragged_dw(x_MxK, dy_MxN, group_sizes_G)
  return _triton_grouped().ragged_dw(x_MxK, dy_MxN, group_sizes_G)


# The GPU implementations' three products, (y, dx, dw), each f(a, b, group_sizes):
#   y = x·w[g],  dx = dy·w[g]ᵀ,  dw[g] = x_gᵀ·dy_g
# (benchmarks/bench_grouped_matmul.py times them)
GPU_PRODUCTS = {
    "tokamax": (_tokamax_y, _tokamax_dx, _tokamax_dw),
    "mosaic": (mosaic_gpu_grouped.ragged_dot, _mosaic_dx, mosaic_gpu_grouped.ragged_dw),
    "triton": (lambda x, w, s: _triton_grouped().ragged_dot(x, w, s),
               lambda dy, w, s: _triton_grouped().ragged_dot(dy, w, s, transpose_rhs=True),
               _triton_dw),
}


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gpu_grouped(x_MxK, w_GxKxN, group_sizes_G, implementation):
  """The grouped matmul on GPU with its VJP from the same implementation's kernels.

  The barrier keeps XLA from running the kernel twice. Under scanned layers the output is
  also stored into the scan's stacked residual (remat tag moe_h / moe_y), and XLA's GPU
  dynamic-slice fusion fuses a custom call into that dynamic-update-slice by cloning the
  call when it has other users: 24 extra expert launches (about 23 ms) per long_context_1b
  step (benchmarks/train.md)."""
  return jax.lax.optimization_barrier(
      GPU_PRODUCTS[implementation][0](x_MxK, w_GxKxN, group_sizes_G))


def _gpu_grouped_fwd(x_MxK, w_GxKxN, group_sizes_G, implementation):
  return (_gpu_grouped(x_MxK, w_GxKxN, group_sizes_G, implementation),
          (x_MxK, w_GxKxN, group_sizes_G))


def _gpu_grouped_bwd(implementation, res, dy_MxN):
  _, dx_fn, dw_fn = GPU_PRODUCTS[implementation]
  x_MxK, w_GxKxN, group_sizes_G = res
  dy_MxN = dy_MxN.astype(x_MxK.dtype)
  return (dx_fn(dy_MxN, w_GxKxN, group_sizes_G),
          dw_fn(x_MxK, dy_MxN, group_sizes_G).astype(w_GxKxN.dtype), None)


_gpu_grouped.defvjp(_gpu_grouped_fwd, _gpu_grouped_bwd)
# Jitted, so that every MoE layer with these shapes shares one trace and one lowering of the
# Mosaic kernels (0.4 s each on the H200's host): trace + lower time stops growing with depth.
_gpu_grouped_jit = jax.jit(_gpu_grouped, static_argnums=3)


def swiglu_grad_in_kernel(implementation: str, F: int, D: int) -> bool:
  """Whether swiglu_down applies: `triton` (resolved) with the down projection [F, D] in
  Triton's 16-multiples."""
  return implementation == "triton" and _triton_grouped().fits(D, F)


@jax.custom_vjp
def _swiglu_down(h_Mx2F, down_GxFxD, group_sizes_G, weights_M):
  """weights_M None: silu(gate) · up in XLA's steps in h's dtype; else times the weights, in
  fp32 and rounded once (as experts.weighted_gated_silu)."""
  F = down_GxFxD.shape[1]
  if weights_M is None:
    a_MxF = jax.nn.silu(h_Mx2F[:, :F]) * h_Mx2F[:, F:]
  else:
    gate, up = h_Mx2F[:, :F].astype(F32), h_Mx2F[:, F:].astype(F32)
    a_MxF = (jax.nn.silu(gate) * up * weights_M[:, None].astype(F32)).astype(h_Mx2F.dtype)
  return jax.lax.optimization_barrier(       # as _gpu_grouped's: the kernel once
      _triton_grouped().ragged_dot(a_MxF, down_GxFxD, group_sizes_G))


def _swiglu_down_fwd(h_Mx2F, down_GxFxD, group_sizes_G, weights_M):
  return (_swiglu_down(h_Mx2F, down_GxFxD, group_sizes_G, weights_M),
          (h_Mx2F, down_GxFxD, group_sizes_G, weights_M))


def _swiglu_down_bwd(res, dy_MxD):
  h_Mx2F, down_GxFxD, group_sizes_G, weights_M = res
  dy_MxD = dy_MxD.astype(h_Mx2F.dtype)
  dh_Mx2F, a_MxF, *dweights = _triton_grouped().ragged_dx_gated_silu(
      dy_MxD, down_GxFxD, h_Mx2F, group_sizes_G, weights_M)
  ddown = _triton_dw(a_MxF, dy_MxD, group_sizes_G).astype(down_GxFxD.dtype)
  return (dh_Mx2F, ddown, None,
          None if weights_M is None else dweights[0].astype(weights_M.dtype))


_swiglu_down.defvjp(_swiglu_down_fwd, _swiglu_down_bwd)


@jax.jit
def swiglu_down(h_Mx2F, down_GxFxD, group_sizes_G, weights_M=None):
  """grouped_matmul(silu(gate) · up, down, sizes, "triton") of h = [gate | up] [M, 2F], with
  the SwiGLU's backward inside the down projection's dx kernel (triton_gpu_grouped.
  ragged_dx_gated_silu): one kernel writes dh and the dw operand a = silu(gate) · up from h
  and dy, and da = dy · downᵀ only passes through a's tile in L2. The unfused path writes
  da, reads it back with h in a second pass for dh and, under remat, recomputes a in a
  third. The residuals are the inputs. a for dw is computed in fp32 and rounded once (the
  forward's in XLA's bf16 steps); da is rounded to h's dtype, as the unfused path stores
  it. weights_M (model.moe.weights_before_down): each row's activation times its routing
  weight, the weight's gradient from the same kernel."""
  return _swiglu_down(h_Mx2F, down_GxFxD, group_sizes_G, weights_M)
