"""The weight gradient of a grouped (ragged) matmul, in Pallas (Triton lowering on GPU,
`interpret=True` elsewhere): dw[g] = x[rows of g]ᵀ · dy[rows of g].

Why: tokamax 0.0.17's sm90 Mosaic kernel for this product (the ragged-contracting
`ragged_dot_general`, which its ragged_dot VJP uses for dw) is wrong on the H200 for every
group that spans more than one of its K blocks: 2–17% relative error per expert at
M 4096, 32 experts, 1024 → 512 (tests/test_gpu_kernels.py). Its Triton
version needs jax_triton, which the GPU image lacks, and XLA's ragged_dot_general is dense
in the number of groups. This kernel is the plain loop.

  grid (G, K / BLOCK_K, N / BLOCK_N): program (g, i, j) walks group g's rows in blocks of
  BLOCK_M and accumulates x[rows, K_i]ᵀ · dy[rows, N_j] in fp32.

Rows are sorted by group (group g is rows starts[g] .. starts[g] + sizes[g]); rows past the
last group are never read into a sum (they may hold anything, even NaN). A block that would
run past M starts at M - BLOCK_M instead, and the rows it repeats are masked out.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

F32 = jnp.float32
BLOCK_M = 64     # rows per step
NUM_WARPS = 4
NUM_STAGES = 3


def _block(dim: int) -> int:
  """The largest of 128, 64, 32, 16 that divides dim (0 if none)."""
  return next((b for b in (128, 64, 32, 16) if dim % b == 0), 0)


def fits(K: int, N: int) -> bool:
  return _block(K) > 0 and _block(N) > 0


def _kernel(starts_ref, sizes_ref, x_ref, dy_ref, dw_ref, *, block_m):
  g = pl.program_id(0)
  M = x_ref.shape[0]
  start, size = starts_ref[g], sizes_ref[g]
  end = start + size

  def step(b, acc_KxN):
    lo = start + b * block_m                       # first row this step owns
    first = jnp.minimum(lo, M - block_m)           # first row it loads
    rows = pl.ds(first, block_m)
    r_M = first + jax.lax.broadcasted_iota(jnp.int32, (block_m,), 0)
    own_M = (r_M >= lo) & (r_M < jnp.minimum(lo + block_m, end))
    x_MxK = jnp.where(own_M[:, None], x_ref[rows, :], 0)
    dy_MxN = jnp.where(own_M[:, None], dy_ref[rows, :], 0)
    return acc_KxN + jax.lax.dot_general(x_MxK, dy_MxN, (((0,), (0,)), ((), ())),
                                         preferred_element_type=F32)

  n_steps = (size + block_m - 1) // block_m
  acc_KxN = jax.lax.fori_loop(0, n_steps, step, jnp.zeros(dw_ref.shape, F32))
  dw_ref[...] = acc_KxN.astype(dw_ref.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret"))
def grouped_dw(x_MxK, dy_MxN, group_sizes_G, *, out_dtype=None, interpret: bool = False):
  """dw [G, K, N] with dw[g] = x[group g]ᵀ · dy[group g], fp32 accumulation, in out_dtype
  (default x's dtype). K and N must be multiples of 16 (`fits`)."""
  M, K = x_MxK.shape
  N = dy_MxN.shape[1]
  if dy_MxN.shape[0] != M or not fits(K, N):
    raise ValueError(f"grouped_dw needs x [M, K] and dy [M, N] with K and N multiples of 16; "
                     f"got x {x_MxK.shape}, dy {dy_MxN.shape}")
  if M < BLOCK_M:                                  # every step loads BLOCK_M rows
    x_MxK = jnp.pad(x_MxK, ((0, BLOCK_M - M), (0, 0)))
    dy_MxN = jnp.pad(dy_MxN, ((0, BLOCK_M - M), (0, 0)))
    M = BLOCK_M
  G = group_sizes_G.shape[0]
  bk, bn = _block(K), _block(N)
  sizes_G = group_sizes_G.astype(jnp.int32)
  starts_G = jnp.cumsum(sizes_G) - sizes_G
  params = None if interpret else pltriton.CompilerParams(num_warps=NUM_WARPS,
                                                          num_stages=NUM_STAGES)
  full = lambda shape: pl.BlockSpec(shape, lambda g, i, j: (0,) * len(shape))
  return pl.pallas_call(
      functools.partial(_kernel, block_m=BLOCK_M),
      grid=(G, K // bk, N // bn),
      in_specs=[full((G,)), full((G,)),
                pl.BlockSpec((M, bk), lambda g, i, j: (0, i)),
                pl.BlockSpec((M, bn), lambda g, i, j: (0, j))],
      out_specs=pl.BlockSpec((None, bk, bn), lambda g, i, j: (g, i, j)),
      out_shape=jax.ShapeDtypeStruct((G, K, N), out_dtype or x_MxK.dtype),
      interpret=interpret, name="grouped_dw", compiler_params=params,
  )(starts_G, sizes_G, x_MxK, dy_MxN)
