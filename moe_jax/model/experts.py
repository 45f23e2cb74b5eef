"""Routed-expert SwiGLU math: the grouped matmul choice, and the two expert-FFN layouts.

Experts are stored stacked: `gate_up` [E, D, 2, F] (gate and up fused so one
grouped matmul does both) and `down` [E, F, D].

* grouped (dropless): rows sorted by expert, `ragged_dot` over group sizes.
  `jax.lax.ragged_dot` is emulated densely on GPU (2% of peak, and at E=256 it
  tries to allocate 128 GiB on an H200), so GPU/TPU use `tokamax.ragged_dot`
  (a Pallas Mosaic kernel) for bf16/fp16. On GPU its weight gradient comes from
  pallas_kernels/moe/grouped_dw.py instead: tokamax 0.0.17's is wrong on the H200.
  tokamax's GPU kernel takes no float32, so float32 models (debugging, numerics checks)
  take XLA's ragged_dot on GPU: exact, but dense in E (fine at the tiny config's 8 experts).
  On TPU it is tokamax's Mosaic TPU kernel (`implementation="mosaic_tpu"`, megablox-style
  gmm / tgmm, forward and backward), named explicitly so that a program compiled for a TPU
  on a CPU host (pallas_kernels/platform.py) gets it too; it takes K and N of at least 128,
  smaller experts fall back to XLA's ragged_dot. tokamax is imported lazily: CPU
  runs never need it.
* batched (capacity): tokens laid out [E, C, D], plain batched matmuls.
"""

import jax
import jax.numpy as jnp

from moe_jax.model import remat
from pallas_kernels import platform
from pallas_kernels.moe import grouped_dw

GROUPED_MATMULS = ("xla", "tokamax")


def default_grouped_matmul(dtype) -> str:
  """tokamax on GPU/TPU, except for float32 on GPU (tokamax's Mosaic GPU kernel is bf16/fp16
  only); xla on CPU."""
  backend = platform.target()
  if backend == "cpu" or (backend == "gpu" and not _tokamax_gpu_dtype(dtype)):
    return "xla"
  return "tokamax"


def _tokamax_gpu_dtype(dtype) -> bool:
  return jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)


def grouped_matmul(x_MxK, w_GxKxN, group_sizes_G, implementation: str = ""):
  """Row block g of x (rows sorted by group) times w[g].

  Rows past sum(group_sizes) are undefined (xla writes 0, tokamax's GPU kernel leaves
  them unwritten): callers with padding rows mask them.
  """
  implementation = implementation or default_grouped_matmul(x_MxK.dtype)
  if implementation == "xla":
    return jax.lax.ragged_dot(x_MxK, w_GxKxN, group_sizes_G)
  if implementation == "tokamax":
    target = platform.target()
    on_gpu = target == "gpu"
    if on_gpu and not _tokamax_gpu_dtype(x_MxK.dtype):
      raise ValueError(f"model.moe.grouped_matmul='tokamax' on GPU takes bfloat16/float16 "
                       f"inputs, got {x_MxK.dtype}; use '' (xla for float32) or "
                       f"model.dtype='bfloat16'")
    import tokamax  # heavy optional dependency: the gpu/tpu extras install it

    if on_gpu:
      return _tokamax_gpu_jit(x_MxK, w_GxKxN, group_sizes_G)
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


@jax.custom_vjp
def _tokamax_gpu(x_MxK, w_GxKxN, group_sizes_G):
  """tokamax's Mosaic kernel on GPU for y and dx; dw by pallas_kernels/moe/grouped_dw.py,
  because tokamax 0.0.17's dw kernel is wrong on the H200 (that module says how)."""
  import tokamax
  return tokamax.ragged_dot(x_MxK, w_GxKxN, group_sizes_G, implementation="mosaic")


def _tokamax_gpu_fwd(x_MxK, w_GxKxN, group_sizes_G):
  return _tokamax_gpu(x_MxK, w_GxKxN, group_sizes_G), (x_MxK, w_GxKxN, group_sizes_G)


def _tokamax_gpu_bwd(res, dy_MxN):
  import tokamax
  x_MxK, w_GxKxN, group_sizes_G = res
  dy_MxN = dy_MxN.astype(x_MxK.dtype)
  dx_MxK = tokamax.ragged_dot(dy_MxN, jnp.swapaxes(w_GxKxN, 1, 2), group_sizes_G,
                              implementation="mosaic")
  K, N = x_MxK.shape[1], dy_MxN.shape[1]
  if grouped_dw.fits(K, N):
    dw_GxKxN = grouped_dw.grouped_dw(x_MxK, dy_MxN, group_sizes_G, out_dtype=w_GxKxN.dtype)
  else:   # dims off the kernel's 16-multiples: XLA's exact (dense in G) version
    dw_GxKxN = jax.lax.ragged_dot_general(
        x_MxK, dy_MxN, group_sizes_G, _RAGGED_CONTRACTING,
        preferred_element_type=F32).astype(w_GxKxN.dtype)
  return dx_MxK, dw_GxKxN, None


_tokamax_gpu.defvjp(_tokamax_gpu_fwd, _tokamax_gpu_bwd)
# Jitted, so that every MoE layer with these shapes shares one trace and one lowering of the
# Mosaic kernels (0.4 s each on the H200's host): trace + lower time stops growing with depth.
_tokamax_gpu_jit = jax.jit(_tokamax_gpu)


def swiglu_grouped(x_MxD, group_sizes_E, gate_up_ExDx2xF, down_ExFxD, implementation=""):
  """SwiGLU of each row by its group's expert (rows sorted by expert)."""
  E, D, _, F = gate_up_ExDx2xF.shape
  h_Mx2F = remat.tag(grouped_matmul(x_MxD, gate_up_ExDx2xF.reshape(E, D, 2 * F),
                                    group_sizes_E, implementation), "moe_h")
  h_Mx2xF = h_Mx2F.reshape(-1, 2, F)
  a_MxF = jax.nn.silu(h_Mx2xF[:, 0]) * h_Mx2xF[:, 1]
  return remat.tag(grouped_matmul(a_MxF, down_ExFxD, group_sizes_E, implementation), "moe_y")


def swiglu_batched(x_ExCxD, gate_up_ExDx2xF, down_ExFxD):
  """SwiGLU of every expert's [C, D] buffer: batched dense matmuls."""
  h_ExCx2xF = remat.tag(jnp.einsum("ecd,edgf->ecgf", x_ExCxD, gate_up_ExDx2xF), "moe_h")
  a_ExCxF = jax.nn.silu(h_ExCx2xF[:, :, 0]) * h_ExCx2xF[:, :, 1]
  return remat.tag(jnp.einsum("ecf,efd->ecd", a_ExCxF, down_ExFxD), "moe_y")
