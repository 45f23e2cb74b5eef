"""The grouped (ragged) matmul's products as native Triton kernels (Hopper: Triton
pipelines the K loop's loads with cp.async and multiplies with wgmma):

  ragged_dot(x, w, sizes)                  y[rows of g] = x[rows of g] · w[g]
  ragged_dot(dy, w, sizes, transpose_rhs)  dx[rows of g] = dy[rows of g] · w[g]ᵀ (no wᵀ copy)
  ragged_dw(x, dy, sizes)                  dw[g] = x[rows of g]ᵀ · dy[rows of g]
  ragged_dx_gated_silu(dy, w, h, sizes)    dx through a SwiGLU: d(silu(gate) · up) from h,
                                           and silu(gate) · up (ops.swiglu_down)

mosaic_gpu_grouped.py's contract (rows sorted by group; rows past sum(sizes) are padding,
left unwritten in y and dx and never read into dw), with what that kernel lacks: a
two-warpgroup tile (8 warps, 128 × 256 outputs), output tiles walked in L2-friendly
bands (`group_m` row tiles at a time, as Triton's matmul tutorial), and columns masked,
so no dim needs to divide the tile (long_context_1b's 704-wide experts take full tiles).

y and dx: program t of the row-tile axis finds its (group, row block) from the group sizes
itself (a vector search over the G groups: no metadata kernels a call), multiplies the
whole row block unmasked (rows of a neighbouring group only feed output rows it does not
store; rows past M are clamped to row M-1) and stores its group's rows. A group takes each
row block it touches, so there are at most cdiv(M, block_m) + G - 1 row tiles.
dw: one program per (output tile, group), its loop over the group's rows in block_k steps,
rows outside the group masked to 0 at the load (a padding row may hold NaN). The tile is
the launch grid's fast axis, so the programs resident at once are one group's tiles, which
read the same rows of x and dy from L2. With the group as the fast axis, the resident
programs belonged to different groups and shared no rows: up to 4.8 GB read a call at the
1B's gate/up instead of 0.6, and dw ran at half Mosaic's speed; in this order it is level
with Mosaic's at the 1B's shapes (benchmarks/moe.md).

Launched by pallas_kernels/triton_launch.py: jax_triton on a GPU, Triton's interpreter on
host arrays elsewhere (CPU tests). benchmarks/bench_grouped_matmul.py times them beside
the Mosaic kernels.
"""

import dataclasses

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels import platform, triton_launch
from pallas_kernels.moe.mosaic_gpu_grouped import check_operands, dot_dims


@dataclasses.dataclass(frozen=True)
class Config:
  """One program's tile: block_m × block_n outputs, block_k deep per pipeline step, at most
  `stages` steps in flight, `warps` warps (8: two warpgroups share the tile's rows), and
  group_m row tiles walked together (y, dx: the w[g] tile stays in L2 across them)."""
  block_m: int = 128
  block_n: int = 256
  block_k: int = 64
  warps: int = 8
  stages: int = 3
  group_m: int = 8


def default_config(product: str, K: int, N: int) -> Config:
  """K: the contracted width of y and dx, the rows of dw's output; N: the output columns.
  128 × 256 tiles at 8 warps and 3 stages (Triton's Hopper matmul tutorial's best tile),
  128-wide where N is 128 or less; block_k the widest of 64/32/16 that divides the
  contraction (y, dx; dw's contraction is the rows, masked)."""
  block_n = 256 if N > 128 else 128
  if product == "dw":
    return Config(block_n=block_n)
  return Config(block_n=block_n, block_k=next(b for b in (64, 32, 16) if K % b == 0))


def fits(K: int, N: int) -> bool:
  """Both dims multiples of 16 (a bf16 row of 32 bytes: cp.async's 16-byte copies)."""
  return K % 16 == 0 and N % 16 == 0


@triton.jit
def _isum(x):
  """Sum of an int32 vector (tl.reduce: tl.sum is a library function Triton's interpreter
  runs only under TRITON_INTERPRET=1)."""
  return tl.reduce(x, 0, tl.standard._sum_combine)


@triton.jit
def _group_bounds(sizes, G: tl.constexpr, GP: tl.constexpr):
  """Index i (GP-wide), each group's first row and its row past the end, as [GP] int32."""
  i = tl.arange(0, GP)
  size_G = tl.load(sizes + i, mask=i < G, other=0)
  end_G = tl.associative_scan(size_G, 0, tl.standard._sum_combine)
  return i, end_G - size_G, end_G


@triton.jit
def _band(pid, tiles_m, tiles_n, GROUP_M: tl.constexpr):
  """(row tile, column tile) of program pid: group_m row tiles' column tiles in turn."""
  in_band = GROUP_M * tiles_n
  first = (pid // in_band) * GROUP_M
  rows = tl.minimum(tiles_m - first, GROUP_M)
  return first + (pid % in_band) % rows, (pid % in_band) // rows


@triton.jit
def _program_tile(sizes, M: tl.constexpr, N: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
  """(found, group, the group's first row and its row past the end, the tile's first row and
  first column) of this program of y/dx's grid: row tile t (in bands of GROUP_M) belongs to group i, which takes
  the row blocks it touches, tiles cum_i - nb_i … cum_i - 1; found is False past the last
  group's last block."""
  tiles_m: tl.constexpr = (M + BM - 1) // BM + G - 1
  tiles_n: tl.constexpr = (N + BN - 1) // BN
  t, pn = _band(tl.program_id(0), tiles_m, tiles_n, GROUP_M)
  i, start_G, end_G = _group_bounds(sizes, G, GP)
  nb_G = tl.where(end_G > start_G, (tl.maximum(end_G, 1) - 1) // BM - start_G // BM + 1, 0)
  cum_G = tl.associative_scan(nb_G, 0, tl.standard._sum_combine)
  mine = (cum_G - nb_G <= t) & (t < cum_G)
  g = _isum(tl.where(mine, i, 0))
  start = _isum(tl.where(mine, start_G, 0))
  end = _isum(tl.where(mine, end_G, 0))
  block = start // BM + t - _isum(tl.where(mine, cum_G - nb_G, 0))
  return _isum(mine.to(tl.int32)) > 0, g, start, end, block * BM, pn * BN


@triton.jit
def _tile_dot(x, w, g, rows, cols, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
              TRANSPOSE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              NUM_STAGES: tl.constexpr):
  """[BM, BN] fp32: x[rows] (rows past M clamped to M-1) times w[g]'s columns `cols`."""
  ks = tl.arange(0, BK)
  x_rows = x + tl.minimum(rows, M - 1).to(tl.int64)[:, None] * K + ks[None, :]
  w_g = w + g.to(tl.int64) * K * N
  col_ok = cols < N
  if TRANSPOSE:
    w_cols = w_g + cols[None, :] * K + ks[:, None]
  else:
    w_cols = w_g + ks[:, None] * N + cols[None, :]
  acc = tl.full((BM, BN), 0.0, tl.float32)
  for kb in tl.range(0, K // BK, num_stages=NUM_STAGES):
    a = tl.load(x_rows + kb * BK)
    # Columns past N are masked, not clamped: N a multiple of 16, so the mask is constant
    # over each 16-byte run and the loads stay vector copies (a clamp would hide that).
    if TRANSPOSE:
      b = tl.load(w_cols + kb * BK, mask=col_ok[None, :], other=0.0)
    else:
      b = tl.load(w_cols + kb * BK * N, mask=col_ok[None, :], other=0.0)
    acc = tl.dot(a, b, acc)
  return acc


@triton.jit
def _grouped_dot_triton(sizes, x, w, y, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                        G: tl.constexpr, GP: tl.constexpr, TRANSPOSE: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr):
  """y [M, N] = x [M, K] times w[g] ([G, K, N]; [G, N, K] read transposed with TRANSPOSE)
  over the rows of each group g; one program per (row tile, column tile)."""
  found, g, start, end, row0, col0 = _program_tile(sizes, M, N, G, GP, BM, BN, GROUP_M)
  if not found:
    return
  rows, cols = row0 + tl.arange(0, BM), col0 + tl.arange(0, BN)
  acc = _tile_dot(x, w, g, rows, cols, M, K, N, TRANSPOSE, BM, BN, BK, NUM_STAGES)
  own = (rows >= start) & (rows < end)
  tl.store(y + rows.to(tl.int64)[:, None] * N + cols[None, :], acc.to(y.dtype.element_ty),
           mask=own[:, None] & (cols < N)[None, :])


@triton.jit
def _grouped_dx_gated_silu_triton(sizes, dy, w, h, rw, dh, a, dwp, M: tl.constexpr,
                                  K: tl.constexpr, N: tl.constexpr, G: tl.constexpr,
                                  GP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                                  BK: tl.constexpr, SUB: tl.constexpr, GROUP_M: tl.constexpr,
                                  WEIGHTED: tl.constexpr, NUM_STAGES: tl.constexpr):
  """The down projection's dx with the SwiGLU's backward as its epilogue: with da = dy
  [M, K] times w[g]ᵀ (w [G, N, K], N = F) and the gate/up product h [M, 2N] (gate in
  columns [0, N), up in [N, 2N)), the program writes dh = d(silu(gate) · up) [M, 2N] and
  a = silu(gate) · up [M, N] (dw's operand) for its tile; da has no array of its own.
  WEIGHTED: the activation was rw · silu(gate) · up (rw [M] fp32, a row's routing
  weight): a and dh take the weight, and dwp [M, cdiv(N, SUB)] gets each SUB columns' part
  of the weight's gradient, Σ da · silu(gate) · up over them (stored at once: a sum carried
  through the loop spilled at 255 registers)."""
  found, g, start, end, row0, col0 = _program_tile(sizes, M, N, G, GP, BM, BN, GROUP_M)
  if not found:
    return
  rows, cols = row0 + tl.arange(0, BM), col0 + tl.arange(0, BN)
  da = _tile_dot(dy, w, g, rows, cols, M, K, N, True, BM, BN, BK, NUM_STAGES)
  own = (rows >= start) & (rows < end)
  # da goes through `a`'s tile (this program's alone; bf16, as the unfused path rounds it)
  # and comes back SUB columns at a time: the [BM, BN] fp32 tile beside h's gate and up
  # tiles spilled (5 KB a thread at 128 × 256). The barrier orders the block's stores
  # before its loads.
  r0 = row0.to(tl.int64)
  a_tile, h_tile, dh_tile = a + r0 * N, h + r0 * (2 * N), dh + r0 * (2 * N)
  r = tl.arange(0, BM)[:, None]
  tl.store(a_tile + r * N + cols[None, :], da.to(a.dtype.element_ty),
           mask=own[:, None] & (cols < N)[None, :])
  tl.debug_barrier()
  for j in tl.static_range(BN // SUB):
    c = col0 + j * SUB + tl.arange(0, SUB)[None, :]
    ok = own[:, None] & (c < N)
    da_j = tl.load(a_tile + r * N + c, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    gate = tl.load(h_tile + r * (2 * N) + c, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(h_tile + r * (2 * N) + N + c, mask=ok, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))   # tl.sigmoid: a library function the interpreter lacks
    silu = gate * sig
    act = silu * up
    if WEIGHTED:   # masked loads are 0: no NaN from padding rows; tl.reduce as kda's fp32_sum
      weight = tl.load(rw + r0 + r, mask=own[:, None], other=0.0)
      tl.store(dwp + (r0 + r) * ((N + SUB - 1) // SUB) + (col0 // SUB + j),
               tl.reduce(da_j * act, 1, tl.standard._sum_combine, keep_dims=True),
               mask=own[:, None] & (col0 + j * SUB < N))
      da_j, act = da_j * weight, act * weight
    # d silu(x)/dx = σ(x)(1 + x(1 - σ(x))) = σ(x) + silu(x)(1 - σ(x))
    tl.store(dh_tile + r * (2 * N) + c, (da_j * up * (sig + silu * (1.0 - sig))).to(
        dh.dtype.element_ty), mask=ok)
    tl.store(dh_tile + r * (2 * N) + N + c, (da_j * silu).to(dh.dtype.element_ty), mask=ok)
    tl.store(a_tile + r * N + c, act.to(a.dtype.element_ty), mask=ok)


@triton.jit
def _grouped_dw_triton(sizes, x, dy, dw, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                       G: tl.constexpr, GP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, NUM_STAGES: tl.constexpr):
  """dw [G, K, N] = x[rows of g]ᵀ · dy[rows of g]: program (output tile, g) loops over its
  group's rows BK at a time; an empty group's tiles get zeros."""
  g = tl.program_id(1)
  tiles_n: tl.constexpr = (N + BN - 1) // BN
  pm, pn = tl.program_id(0) // tiles_n, tl.program_id(0) % tiles_n
  i, start_G, end_G = _group_bounds(sizes, G, GP)
  start = _isum(tl.where(i == g, start_G, 0))
  end = _isum(tl.where(i == g, end_G, 0))
  kr = pm * BM + tl.arange(0, BM)
  cols = pn * BN + tl.arange(0, BN)
  kr_ok, col_ok = kr < K, cols < N          # masked, not clamped: as in _grouped_dot_triton
  acc = tl.full((BM, BN), 0.0, tl.float32)
  for r0 in tl.range(start, end, BK, num_stages=NUM_STAGES):
    rows = r0 + tl.arange(0, BK)
    ok = rows < end
    rows64 = rows.to(tl.int64)
    a = tl.load(x + rows64[None, :] * K + kr[:, None], mask=kr_ok[:, None] & ok[None, :],
                other=0.0)
    b = tl.load(dy + rows64[:, None] * N + cols[None, :], mask=ok[:, None] & col_ok[None, :],
                other=0.0)
    acc = tl.dot(a, b, acc)
  out = dw + g.to(tl.int64) * K * N + kr[:, None] * N + cols[None, :]
  tl.store(out, acc.to(dw.dtype.element_ty), mask=kr_ok[:, None] & col_ok[None, :])


def _groups_padded(G: int) -> int:
  return max(16, triton.next_power_of_2(G))


def _row_tile_plan(name: str, c: Config, M: int, K: int, N: int, G: int):
  """(grid size, constexprs) of a y/dx-style kernel: at most cdiv(M, block_m) + G - 1 row
  tiles times the column tiles."""
  if K % c.block_k:
    raise ValueError(f"{name}: the contracted width K={K} must be a multiple of "
                     f"block_k={c.block_k}")
  tiles = (triton.cdiv(M, c.block_m) + G - 1) * triton.cdiv(N, c.block_n)
  return tiles, dict(M=M, K=K, N=N, G=G, GP=_groups_padded(G), BM=c.block_m, BN=c.block_n,
                     BK=c.block_k, GROUP_M=c.group_m)


def ragged_dot(x_MxK, w_GxKxN, sizes_G, *, config: Config | None = None,
               transpose_rhs: bool = False, interpret: bool | None = None):
  """[M, N] (x's dtype, fp32 accumulation): row block g of x times w[g] (w[g]ᵀ with
  transpose_rhs, w then [G, N, K]). Rows past sum(sizes) are left unwritten."""
  check_operands("ragged_dot", x_MxK, w_GxKxN, sizes_G)
  M = x_MxK.shape[0]
  K, N, G = dot_dims(x_MxK, w_GxKxN, sizes_G, transpose_rhs)
  c = config or default_config("dx" if transpose_rhs else "y", K, N)
  tiles, meta = _row_tile_plan("ragged_dot", c, M, K, N, G)
  meta["TRANSPOSE"] = bool(transpose_rhs)
  (y,) = triton_launch.launch(
      _grouped_dot_triton, (tiles,), (sizes_G.astype(jnp.int32), x_MxK, w_GxKxN),
      [jax.ShapeDtypeStruct((M, N), x_MxK.dtype)], meta,
      name=f"grouped_triton_{'dx' if transpose_rhs else 'y'}_{K}x{N}",
      interpret=platform.interpret_off_gpu(interpret), warps=c.warps, max_stages=c.stages,
      stages=c.stages)
  return y


EPILOGUE_COLUMNS = 64   # ragged_dx_gated_silu's epilogue: columns of its tile at a time


def ragged_dx_gated_silu(dy_MxK, w_GxNxK, h_Mx2N, sizes_G, weights_M=None, *,
                         config: Config | None = None, interpret: bool | None = None):
  """(dh [M, 2N], a [M, N]), h's dtype: the backward of y = ragged_dot(silu(gate) · up, w)
  through the SwiGLU, from dy [M, K] and w [G, N, K] (the down projection, read transposed
  in place) and h = [gate | up] [M, 2N]. da = dy · w[g]ᵀ gets no array of its own (it
  passes through a's tile, rounded to h's dtype as the unfused path stores it); a, the down
  projection's dw operand, is recomputed from h beside dh. Rows past sum(sizes) are left
  unwritten.

  With weights_M [M] (each row's routing weight, model.moe.weights_before_down: y =
  ragged_dot(weights · silu(gate) · up, w)): (dh, a, dweights [M] fp32), a and dh with the
  weight, dweights = Σ_N da · silu(gate) · up (0 past sum(sizes))."""
  check_operands("ragged_dx_gated_silu", dy_MxK, w_GxNxK, sizes_G)
  M = dy_MxK.shape[0]
  K, N, G = dot_dims(dy_MxK, w_GxNxK, sizes_G, True)
  if h_Mx2N.shape != (M, 2 * N) or h_Mx2N.dtype != dy_MxK.dtype:
    raise ValueError(f"ragged_dx_gated_silu: h must be [M, 2N] = [{M}, {2 * N}] in "
                     f"{dy_MxK.dtype}, got {h_Mx2N.shape} {h_Mx2N.dtype}")
  if weights_M is not None and weights_M.shape != (M,):
    raise ValueError(f"ragged_dx_gated_silu: weights must be [M] = [{M}], got "
                     f"{weights_M.shape}")
  c = config or default_config("dx", K, N)
  tiles, meta = _row_tile_plan("ragged_dx_gated_silu", c, M, K, N, G)
  weighted = weights_M is not None
  meta.update(SUB=min(EPILOGUE_COLUMNS, c.block_n), WEIGHTED=weighted)
  subs = triton.cdiv(N, meta["SUB"]) if weighted else 1   # unweighted: 1-element stand-ins
  rw = weights_M.astype(jnp.float32) if weighted else jnp.zeros((1,), jnp.float32)
  dh, a, dwp = triton_launch.launch(
      _grouped_dx_gated_silu_triton, (tiles,),
      (sizes_G.astype(jnp.int32), dy_MxK, w_GxNxK, h_Mx2N, rw),
      [jax.ShapeDtypeStruct((M, 2 * N), h_Mx2N.dtype), jax.ShapeDtypeStruct((M, N), h_Mx2N.dtype),
       jax.ShapeDtypeStruct((M if weighted else 1, subs), jnp.float32)],
      meta, name=f"grouped_triton_dx_gated_silu{'_weighted' if weighted else ''}_{K}x{N}",
      interpret=platform.interpret_off_gpu(interpret), warps=c.warps, max_stages=c.stages,
      stages=c.stages)
  if not weighted:
    return dh, a
  return dh, a, jnp.where(jnp.arange(M) < sizes_G.sum(), dwp.sum(-1), 0.0)


def ragged_dw(x_MxK, dy_MxN, sizes_G, *, config: Config | None = None,
              interpret: bool | None = None):
  """[G, K, N] (x's dtype, fp32 accumulation): dw[g] = x[rows of g]ᵀ · dy[rows of g]. Rows
  past sum(sizes) never reach a sum, whatever they hold; an empty group gets zeros."""
  check_operands("ragged_dw", x_MxK, dy_MxN, sizes_G)
  if dy_MxN.shape[0] != x_MxK.shape[0]:
    raise ValueError(f"ragged_dw: x {x_MxK.shape} and dy {dy_MxN.shape} differ in rows")
  M, K = x_MxK.shape
  N = dy_MxN.shape[1]
  G = sizes_G.shape[0]
  c = config or default_config("dw", K, N)
  meta = dict(M=M, K=K, N=N, G=G, GP=_groups_padded(G), BM=c.block_m, BN=c.block_n,
              BK=c.block_k)
  (dw,) = triton_launch.launch(
      _grouped_dw_triton, (triton.cdiv(K, c.block_m) * triton.cdiv(N, c.block_n), G),
      (sizes_G.astype(jnp.int32), x_MxK, dy_MxN),
      [jax.ShapeDtypeStruct((G, K, N), x_MxK.dtype)], meta,
      name=f"grouped_triton_dw_{K}x{N}", interpret=platform.interpret_off_gpu(interpret),
      warps=c.warps, max_stages=c.stages, stages=c.stages)
  return dw
