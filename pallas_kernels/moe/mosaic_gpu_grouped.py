"""The grouped (ragged) matmul's three products as Mosaic GPU kernels (Hopper: TMA loads into
swizzled shared memory, wgmma into a register accumulator, persistent over the SMs):

  ragged_dot(x, w, sizes)                  y[rows of g] = x[rows of g] · w[g]
  ragged_dot(dy, w, sizes, transpose_rhs)  dx[rows of g] = dy[rows of g] · w[g]ᵀ (no wᵀ copy)
  ragged_dw(x, dy, sizes)                  dw[g] = x[rows of g]ᵀ · dy[rows of g]

Rows are sorted by group; rows past sum(sizes) are padding. Adapted from jax's
pallas/ops/gpu/ragged_dot_mgpu.py and transposed_ragged_dot_mgpu.py. What differs:
* the tile shape is a per-call `Config`, tuned per product and shape on the H200
  (`TUNED`, written by benchmarks/bench_grouped_matmul.py --tune; benchmarks/moe.md);
* the grid is the device's SM count, and off a GPU (`interpret`) Pallas's Mosaic GPU
  interpreter runs them (CPU tests);
* ragged_dw selects the rows of its group in its first and last row block of both operands,
  where jax's multiplies x by a 0/1 mask: a padding row may hold NaN (the grouped matmul
  leaves rows past the groups unwritten), and 0·NaN is NaN.
"""

import dataclasses
import functools
import json
import math
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import platform


@dataclasses.dataclass(frozen=True)
class Config:
  """Tile of one program: block_m × block_n outputs, block_k deep per pipeline step, with
  `stages` steps in flight; grid_block_n output-column tiles walked together (L2 reuse)."""
  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  stages: int = 4
  grid_block_n: int = 1


TUNED_PATH = os.path.join(os.path.dirname(__file__), "mosaic_gpu_grouped_tuned.json")


def _load_tuned() -> dict:
  if not os.path.exists(TUNED_PATH):
    return {}
  with open(TUNED_PATH) as fh:
    return {key: Config(**c) for key, c in json.load(fh)["configs"].items()}


TUNED = _load_tuned()   # "<product> <K>x<N>" -> Config, product in y | dx | dw


def tuned_key(product: str, K: int, N: int) -> str:
  """K: the contracted width of y and dx, the rows of dw's output; N: the output columns."""
  return f"{product} {K}x{N}"


def _divisor(dim: int, choices) -> int:
  return next((b for b in choices if dim % b == 0), 0)


def default_config(product: str, K: int, N: int) -> Config:
  """The tuned config of this product and shape, else 128-row tiles with the widest of
  128/64 columns that divides the output, 4 stages, and (y, dx) 4 column tiles walked
  together where they divide the columns: on the H200's sweep 4 stages made dw 1.6-2.1×
  faster than 2, and 4 column tiles made y/dx 18-23% faster than 1 (benchmarks/moe.md)."""
  if (c := TUNED.get(tuned_key(product, K, N))) is not None:
    return c
  if product == "dw":
    return Config(block_m=_divisor(K, (128, 64)), block_n=_divisor(N, (128, 64)))
  block_n = _divisor(N, (128, 64))
  return Config(block_n=block_n, grid_block_n=4 if (N // block_n) % 4 == 0 else 1)


def fits(K: int, N: int) -> bool:
  """Both dims multiples of 64: one 128-byte swizzled bf16 row per tile."""
  return K % 64 == 0 and N % 64 == 0


def check_operands(name, x, w, sizes):
  """The GPU grouped kernels' operands (this module's and triton_gpu_grouped's): one
  16-bit float dtype, integer group sizes."""
  if x.dtype not in (jnp.bfloat16, jnp.float16) or w.dtype != x.dtype:
    raise ValueError(f"{name} takes bfloat16/float16 operands of one dtype, got {x.dtype} and "
                     f"{w.dtype}")
  if not jnp.issubdtype(sizes.dtype, jnp.integer):
    raise ValueError(f"{name}: group sizes must be integers, got {sizes.dtype}")


def dot_dims(x_MxK, w_GxKxN, sizes_G, transpose_rhs: bool):
  """(K, N, G) of ragged_dot: x [M, K] times w [G, K, N] ([G, N, K] with transpose_rhs),
  sizes [G]; a ValueError where they do not agree."""
  K, G = x_MxK.shape[1], w_GxKxN.shape[0]
  N, Kw = (w_GxKxN.shape[1:] if transpose_rhs else w_GxKxN.shape[:0:-1])
  if Kw != K or sizes_G.shape != (G,):
    raise ValueError(f"ragged_dot: x {x_MxK.shape}, w {w_GxKxN.shape} (transpose_rhs="
                     f"{transpose_rhs}) and sizes {sizes_G.shape} do not agree")
  return K, N, G


# TMA reads a [M, K] operand in tiles of 8 rows: M must be a multiple of 8 (or the kernel
# fails to lower: "dimension 0 must have size smaller or a multiple of its tiling 8").
ROW_TILE = 8


def _pad_rows(a_MxK):
  """a with zero rows appended up to a multiple of ROW_TILE: rows past sum(sizes), which no
  product reads into a group's sum (a prefill of 7 tokens of 2 rows at top-2 has M = 28)."""
  extra = -a_MxK.shape[0] % ROW_TILE
  return jnp.pad(a_MxK, ((0, extra), (0, 0))) if extra else a_MxK


def _num_sms(interpret) -> int:
  if interpret:
    return 2     # the interpreter walks the persistent loop; a small grid keeps it quick
  return getattr(jax.devices()[0], "core_count", None) or 132


def _interpret_params(interpret):
  return plgpu.InterpretGPUParams() if interpret else None


def _group_of_tile(sizes_ref, block_m, tile, num_groups):
  """(group, row block, first own row in the block, own rows) of row tile `tile`: a group
  takes every row block it touches, so a block holding a group boundary is visited once per
  group in it. A tile no group takes gets 0 rows. (jax's GroupInfo.create, unrolled selects:
  the groups are few.)"""
  block_m = jnp.int32(block_m)
  end = group = block = start = group_end = jnp.int32(0)
  for i in range(num_groups):
    begin, end = end, end + sizes_ref[i]
    first_block = jax.lax.div(begin, block_m)
    t0, t1 = first_block + i, jax.lax.div(end - 1, block_m) + 1 + i
    mine = (t0 <= tile) & (tile < t1)
    block = jax.lax.select(mine, tile - t0 + first_block, block)
    group = jax.lax.select(mine, jnp.int32(i), group)
    start = jax.lax.select(mine, begin, start)
    group_end = jax.lax.select(mine, end, group_end)
  block_start = block * block_m
  own_start = jnp.maximum(start, block_start)
  own_rows = jnp.minimum(group_end, block_start + block_m) - own_start
  return group, block, own_start - block_start, own_rows


@functools.partial(jax.jit, static_argnames=("config", "transpose_rhs", "interpret"))
def ragged_dot(x_MxK, w_GxKxN, sizes_G, *, config: Config | None = None,
               transpose_rhs: bool = False, interpret: bool | None = None):
  """[M, N] (x's dtype, fp32 accumulation): row block g of x times w[g] (w[g]ᵀ with
  transpose_rhs, w then [G, N, K]). Rows past sum(sizes) are left unwritten."""
  check_operands("ragged_dot", x_MxK, w_GxKxN, sizes_G)
  interpret = platform.interpret_off_gpu(interpret)
  M_out = x_MxK.shape[0]
  x_MxK = _pad_rows(x_MxK)
  M = x_MxK.shape[0]
  K, N, G = dot_dims(x_MxK, w_GxKxN, sizes_G, transpose_rhs)
  c = config or default_config("dx" if transpose_rhs else "y", K, N)
  if K % c.block_k or N % c.block_n:
    raise ValueError(f"ragged_dot: K={K} and N={N} must be multiples of block_k={c.block_k} "
                     f"and block_n={c.block_n}")
  grid_m, grid_n = pl.cdiv(M, c.block_m) + G - 1, N // c.block_n

  def body(sizes_ref, x_gmem, w_gmem, o_gmem):
    @plgpu.nd_loop((grid_m * grid_n,), collective_axes="sm")
    def _(loop_info):
      mi, ni = plgpu.planar_snake(loop_info.index[0], (grid_m, grid_n), 1, c.grid_block_n)
      group, block, own_first, own_rows = _group_of_tile(sizes_ref, c.block_m, mi, G)

      def acc_scope(acc_ref):
        plgpu.emit_pipeline(
            lambda _, x_smem, w_smem: plgpu.wgmma(
                acc_ref, x_smem, w_smem.transpose((1, 0)) if transpose_rhs else w_smem),
            grid=(K // c.block_k,),
            in_specs=[
                plgpu.BlockSpec((c.block_m, c.block_k), lambda k: (block, k), delay_release=1),
                plgpu.BlockSpec((c.block_n, c.block_k) if transpose_rhs else
                                (c.block_k, c.block_n),
                                (lambda k: (ni, k)) if transpose_rhs else (lambda k: (k, ni)),
                                delay_release=1),
            ],
            max_concurrent_steps=c.stages,
        )(x_gmem, w_gmem.at[group])
        return acc_ref[...]

      acc = pl.run_scoped(acc_scope, plgpu.ACC((c.block_m, c.block_n)))

      @functools.partial(pl.run_scoped,
                         o_smem=plgpu.SMEM((c.block_m, c.block_n), dtype=o_gmem.dtype))
      def _(o_smem):
        o_smem[...] = acc.astype(o_smem.dtype)
        plgpu.commit_smem()
        # TMA stores have static shapes: the tile's own rows go out as a ladder of
        # power-of-two row counts (jax's ragged_dot_mgpu explains it).
        first, rows = own_first, min(c.block_m, M)
        while rows > 0:
          n_rows = 1 << int(math.log2(rows))
          rows //= 2

          @pl.when(own_rows & n_rows != 0)
          def _():
            plgpu.copy_smem_to_gmem(
                o_smem.at[pl.ds(first, n_rows)],
                o_gmem.at[pl.ds(block * c.block_m + first, n_rows),
                          pl.ds(ni * c.block_n, c.block_n)])

          first += own_rows & n_rows
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((M, N), x_MxK.dtype), grid=(_num_sms(interpret),),
      grid_names=("sm",), interpret=_interpret_params(interpret),
      kernel_name=f"grouped_mgpu_{'dx' if transpose_rhs else 'y'}_{K}x{N}",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )(sizes_G.astype(jnp.int32), x_MxK, w_GxKxN)[:M_out]


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def ragged_dw(x_MxK, dy_MxN, sizes_G, *, config: Config | None = None,
              interpret: bool | None = None):
  """[G, K, N] (x's dtype, fp32 accumulation): dw[g] = x[rows of g]ᵀ · dy[rows of g]. Rows
  past sum(sizes) never reach a sum, whatever they hold; an empty group gets zeros."""
  check_operands("ragged_dw", x_MxK, dy_MxN, sizes_G)
  interpret = platform.interpret_off_gpu(interpret)
  if dy_MxN.shape[0] != x_MxK.shape[0]:
    raise ValueError(f"ragged_dw: x {x_MxK.shape} and dy {dy_MxN.shape} differ in rows")
  x_MxK, dy_MxN = _pad_rows(x_MxK), _pad_rows(dy_MxN)
  M, K = x_MxK.shape
  N = dy_MxN.shape[1]
  G = sizes_G.shape[0]
  c = config or default_config("dw", K, N)
  if c.stages < 2:
    raise ValueError(f"ragged_dw: stages must be >= 2 (the pipeline releases a block one "
                     f"step late), got {c.stages}")
  if not c.block_m or not c.block_n or K % c.block_m or N % c.block_n:
    raise ValueError(f"ragged_dw: K={K} and N={N} must be multiples of block_m={c.block_m} "
                     f"and block_n={c.block_n}")
  bk = c.block_k   # rows (the ragged, contracted dim) per pipeline step
  sizes_G = sizes_G.astype(jnp.int32)
  ends_G = jnp.cumsum(sizes_G)
  starts_G = ends_G - sizes_G
  first_row_G = starts_G // bk * bk
  blocks_G = (-(ends_G // -bk) * bk - first_row_G) // bk
  swizzle = plgpu.find_swizzle(bk * jnp.dtype(x_MxK.dtype).itemsize * 8)
  transforms = (plgpu.TilingTransform((8, swizzle // jnp.dtype(x_MxK.dtype).itemsize)),
                plgpu.SwizzleTransform(swizzle))
  grid_m, grid_n = K // c.block_m, N // c.block_n

  def body(sizes_ref, starts_ref, ends_ref, blocks_ref, first_row_ref, x_gmem, dy_gmem, o_gmem):
    @plgpu.nd_loop((G, grid_m * grid_n), collective_axes="sm")
    def _(loop_info):
      g = loop_info.index[0]
      mi, ni = plgpu.planar_snake(loop_info.index[1], (grid_m, grid_n), 1, c.grid_block_n)
      first_row = pl.multiple_of(first_row_ref[g], bk)
      n_blocks = blocks_ref[g]

      def select_rows(ref, keep):
        """Zero the rows of a staged [bk, cols] block that `keep(row)` rejects."""
        rows = plgpu.layout_cast(jax.lax.broadcasted_iota(jnp.int32, ref.shape, 0),
                                 plgpu.Layout.WGMMA)
        block = ref[...]
        ref[...] = jnp.where(keep(rows), block, jnp.zeros_like(block))
        plgpu.commit_smem()

      def acc_scope(acc_ref):
        def step(idx, x_smem, dy_smem):
          b = idx[0]
          first = jax.lax.rem(starts_ref[g], bk)
          last = jax.lax.rem(ends_ref[g] - 1, bk)

          @pl.when(b == 0)   # rows of the group before this one
          def _():
            select_rows(x_smem, lambda r: r >= first)
            select_rows(dy_smem, lambda r: r >= first)

          @pl.when(b == n_blocks - 1)   # rows of the next group, or padding, after it
          def _():
            select_rows(x_smem, lambda r: r <= last)
            select_rows(dy_smem, lambda r: r <= last)

          plgpu.wgmma(acc_ref, x_smem.transpose((1, 0)), dy_smem)

        @pl.when(sizes_ref[g] > 0)
        def _():
          rows = pl.ds(first_row, M)   # may run past M: the pipeline stops at the group's end
          plgpu.emit_pipeline(
              step, grid=(n_blocks,),
              in_specs=[
                  plgpu.BlockSpec((bk, c.block_m), lambda k: (k, mi), delay_release=1,
                                  transforms=transforms),
                  plgpu.BlockSpec((bk, c.block_n), lambda k: (k, ni), delay_release=1,
                                  transforms=transforms),
              ],
              max_concurrent_steps=c.stages,
          )(x_gmem.at[rows, :], dy_gmem.at[rows, :])

        return acc_ref[...]

      acc = pl.run_scoped(acc_scope, plgpu.ACC((c.block_m, c.block_n)))

      @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((c.block_m, c.block_n),
                                                           dtype=o_gmem.dtype,
                                                           transforms=transforms))
      def _(o_smem):
        o_smem[...] = acc.astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[g, pl.ds(mi * c.block_m, c.block_m),
                                                 pl.ds(ni * c.block_n, c.block_n)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((G, K, N), x_MxK.dtype),
      grid=(_num_sms(interpret),), grid_names=("sm",), interpret=_interpret_params(interpret),
      kernel_name=f"grouped_mgpu_dw_{K}x{N}",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )(sizes_G, starts_G, ends_G, blocks_G, first_row_G, x_MxK, dy_MxN)
