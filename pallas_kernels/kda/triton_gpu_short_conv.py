"""KDA's short convolution (model/layers.py ShortConv: a depthwise causal conv over time
within each segment, then SiLU) as native Triton kernels, forward and backward
(model.kda_conv_implementation = "triton"):

  z[t] = Σ_j [t-j ≥ 0, seg[t-j] = seg[t]] · x[t-j] · w[j]     y = silu(z)
  dz = dy · silu'(z)                                           (z recomputed from x)
  dx[s] = Σ_j [s+j < T, seg[s+j] = seg[s]] · dz[s+j] · w[j]
  dw[j] = Σ_{b,t} [t-j ≥ 0, seg[t-j] = seg[t]] · x[t-j] · dz[t]

Why: XLA's version is W shifted, masked copies summed; its backward sums W zero-padded
cotangents into one multi-output fusion beside the weight gradient's reductions, at about
ten times the bytes' floor in single_h200's step (0.4 ms a conv against 0.04:
benchmarks/train.json, h200_dropless's top_kernels, input_add_reduce_fusion_10). Here
each [BT, BC] tile reads its rows and the W-1 rows before it (after it, for dx) and
computes in fp32: one pass forward; backward a pass for dz and
each program's dw column sums over 256 rows (summed over programs by the caller), and a
pass for dx.

Opt-in: in the 1B's step on an H100 these kernels took 20.6 ms against XLA's 12.9, 15.1
of them the dz pass, which then reduced its dw products over rows once per 32-row tile
and tap (benchmarks/train.md); it now sums them elementwise over 16 tiles first (untimed).

Launched by pallas_kernels/triton_launch.py: jax_triton on a GPU, Triton's interpreter on
host arrays elsewhere (CPU tests).
"""

import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels import platform, triton_launch

F32 = jnp.float32
# A program's tile: BLOCK_T time rows × BLOCK_C channels at WARPS warps. sm_90a, bf16,
# C = 2048: 62 / 95 / 65 registers a thread (forward / dz / dx), no spills; 64-row tiles
# took 163-242 registers at 4-8 warps or spilled (memory-bound kernels want the occupancy).
BLOCK_T = 32
BLOCK_C = 128
WARPS = 8
# dz: DZ_TILES row tiles of DZ_BLOCK_T a program, so its weight-gradient partials are
# reduced over rows once per 256 rows (a [WP, 16, 128] fp32 accumulator).
DZ_BLOCK_T = 16
DZ_TILES = 16


@triton.jit
def _tile(seg, T: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
  """Program (time block, channel block, b)'s row b, time block, rows t [BT] and channels
  c [BC] with their in-range masks, and the rows' segment ids."""
  pid_t, b = tl.program_id(0), tl.program_id(2)
  t = pid_t * BT + tl.arange(0, BT)
  c = tl.program_id(1) * BC + tl.arange(0, BC)
  t_ok = t < T
  return b, pid_t, t, c, t_ok, c < C, tl.load(seg + b * T + t, mask=t_ok, other=0)


@triton.jit
def _shifted(x, seg, seg_t, b, t, c, t_ok, c_ok, j, T: tl.constexpr, C: tl.constexpr):
  """x[b, t + j] (j may be negative) as fp32 [BT, BC], 0 where t + j is outside [0, T) or
  in another segment than t."""
  s = t + j
  s_ok = t_ok & (s >= 0) & (s < T)
  seg_s = tl.load(seg + b * T + s, mask=s_ok, other=0)
  m = s_ok & (seg_s == seg_t)
  rows = (b * T + s).to(tl.int64)
  xs = tl.load(x + rows[:, None] * C + c[None, :], mask=m[:, None] & c_ok[None, :], other=0.0)
  return xs.to(tl.float32)


@triton.jit
def _taps(a, w, seg, seg_t, b, t, c, t_ok, c_ok, SIGN: tl.constexpr, T: tl.constexpr,
          C: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
  """Σ_j a[t + SIGN·j] · w[j] over the rows of t's segment, fp32 [BT, BC]: the forward's
  pre-activation z (SIGN -1, a = x) and dx (SIGN +1, a = dz)."""
  acc = tl.full((BT, BC), 0.0, tl.float32)
  for j in tl.static_range(W):
    shifted = _shifted(a, seg, seg_t, b, t, c, t_ok, c_ok, SIGN * j, T, C)
    acc += shifted * tl.load(w + j * C + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
  return acc


@triton.jit
def _store_rows(ptr, val, b, t, c, t_ok, c_ok, T: tl.constexpr, C: tl.constexpr):
  rows = (b * T + t).to(tl.int64)
  tl.store(ptr + rows[:, None] * C + c[None, :], val.to(ptr.dtype.element_ty),
           mask=t_ok[:, None] & c_ok[None, :])


@triton.jit
def _sigmoid(z):
  return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def _short_conv_triton(x, w, seg, y, T: tl.constexpr, C: tl.constexpr, W: tl.constexpr,
                       BT: tl.constexpr, BC: tl.constexpr, NUM_STAGES: tl.constexpr):
  """y [B, T, C] = silu(z) in y's dtype; x [B, T, C], w [W, C], seg [B, T] int32."""
  b, pid_t, t, c, t_ok, c_ok, seg_t = _tile(seg, T, C, BT, BC)
  z = _taps(x, w, seg, seg_t, b, t, c, t_ok, c_ok, -1, T, C, W, BT, BC)
  _store_rows(y, z * _sigmoid(z), b, t, c, t_ok, c_ok, T, C)


@triton.jit
def _short_conv_dz_triton(x, w, seg, dy, dz, dw_part, T: tl.constexpr, C: tl.constexpr,
                          W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                          WP: tl.constexpr, TILES: tl.constexpr, NUM_STAGES: tl.constexpr):
  """dz [B, T, C] fp32 = dy · silu'(z); dw_part [B, cdiv(T, BT·TILES), W, C] fp32: this
  program's Σ_t x[t-j] · dz[t] over its TILES row tiles, for each j. The products are
  summed elementwise into a [WP, BT, BC] accumulator (the W shifted copies of x as one
  load) and reduced over rows once a program; the form before, a cross-warp reduction a
  32-row tile and tap, took 5x the dx pass's time."""
  pid_t, b = tl.program_id(0), tl.program_id(2)
  c = tl.program_id(1) * BC + tl.arange(0, BC)
  c_ok = c < C
  j = tl.arange(0, WP)
  acc = tl.full((WP, BT, BC), 0.0, tl.float32)
  for i in tl.range(0, TILES):
    t = (pid_t * TILES + i) * BT + tl.arange(0, BT)
    t_ok = t < T
    seg_t = tl.load(seg + b * T + t, mask=t_ok, other=0)
    z = _taps(x, w, seg, seg_t, b, t, c, t_ok, c_ok, -1, T, C, W, BT, BC)
    rows = (b * T + t).to(tl.int64)
    dy_TC = tl.load(dy + rows[:, None] * C + c[None, :], mask=t_ok[:, None] & c_ok[None, :],
                    other=0.0).to(tl.float32)
    s = _sigmoid(z)
    dz_TC = dy_TC * s * (1.0 + z * (1.0 - s))
    _store_rows(dz, dz_TC, b, t, c, t_ok, c_ok, T, C)
    src = t[None, :] - j[:, None]                                   # [WP, BT]: row t - j
    src_ok = t_ok[None, :] & (j[:, None] < W) & (src >= 0)
    seg_src = tl.load(seg + b * T + src, mask=src_ok, other=0)
    live = src_ok & (seg_src == seg_t[None, :])
    xs = tl.load(x + (b * T + src).to(tl.int64)[:, :, None] * C + c[None, None, :],
                 mask=live[:, :, None] & c_ok[None, None, :], other=0.0)
    acc += xs.to(tl.float32) * dz_TC[None, :, :]
  NT: tl.constexpr = (T + BT * TILES - 1) // (BT * TILES)
  part = dw_part + ((b * NT + pid_t) * W) * C
  tl.store(part + j[:, None] * C + c[None, :], tl.reduce(acc, 1, tl.standard._sum_combine),
           mask=(j[:, None] < W) & c_ok[None, :])


@triton.jit
def _short_conv_dx_triton(dz, w, seg, dx, T: tl.constexpr, C: tl.constexpr, W: tl.constexpr,
                          BT: tl.constexpr, BC: tl.constexpr, NUM_STAGES: tl.constexpr):
  """dx [B, T, C] in dx's dtype: Σ_j dz[t+j] · w[j] over the rows t+j of t's segment."""
  b, pid_t, t, c, t_ok, c_ok, seg_t = _tile(seg, T, C, BT, BC)
  dx_TC = _taps(dz, w, seg, seg_t, b, t, c, t_ok, c_ok, 1, T, C, W, BT, BC)
  _store_rows(dx, dx_TC, b, t, c, t_ok, c_ok, T, C)


def _launch(kernel, shape, args, out_type, interpret, **meta):
  """One program a (BT-row tile, or DZ_TILES of them for dz, channel block, row b)."""
  B, T, C = shape
  W = args[1].shape[0]
  rows = meta["BT"] * meta.get("TILES", 1)
  grid = (triton.cdiv(T, rows), triton.cdiv(C, BLOCK_C), B)
  return triton_launch.launch(kernel, grid, args, out_type,
                              dict(T=T, C=C, W=W, BC=BLOCK_C, **meta),
                              name=kernel.__name__[1:], interpret=interpret, warps=WARPS,
                              max_stages=1, stages=1)


def dz_meta(W: int) -> dict:
  """The dz kernel's tile: DZ_BLOCK_T rows, DZ_TILES tiles a program, W taps padded."""
  return dict(BT=DZ_BLOCK_T, WP=triton.next_power_of_2(W), TILES=DZ_TILES)


def _check(x_BxTxC, w_WxC, seg_BxT):
  B, T, C = x_BxTxC.shape
  if w_WxC.ndim != 2 or w_WxC.shape[1] != C or seg_BxT.shape != (B, T):
    raise ValueError(f"short_conv: x {x_BxTxC.shape}, w {w_WxC.shape} and segment ids "
                     f"{seg_BxT.shape} do not agree (x [B, T, C], w [W, C], ids [B, T])")
  if x_BxTxC.dtype not in (jnp.bfloat16, jnp.float16, F32):
    raise ValueError(f"short_conv takes bfloat16/float16/float32 x, got {x_BxTxC.dtype}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _short_conv(x_BxTxC, w_WxC, seg_BxT, interpret):
  (y,) = _launch(_short_conv_triton, x_BxTxC.shape, (x_BxTxC, w_WxC, seg_BxT),
                 [jax.ShapeDtypeStruct(x_BxTxC.shape, x_BxTxC.dtype)], interpret, BT=BLOCK_T)
  return y


def _short_conv_fwd(x_BxTxC, w_WxC, seg_BxT, interpret):
  return _short_conv(x_BxTxC, w_WxC, seg_BxT, interpret), (x_BxTxC, w_WxC, seg_BxT)


def _short_conv_bwd(interpret, res, dy_BxTxC):
  x_BxTxC, w_WxC, seg_BxT = res
  B, T, C = x_BxTxC.shape
  W = w_WxC.shape[0]
  dz, dw_part = _launch(
      _short_conv_dz_triton, x_BxTxC.shape, (x_BxTxC, w_WxC, seg_BxT, dy_BxTxC),
      [jax.ShapeDtypeStruct((B, T, C), F32),
       jax.ShapeDtypeStruct((B, triton.cdiv(T, DZ_BLOCK_T * DZ_TILES), W, C), F32)],
      interpret, **dz_meta(W))
  (dx,) = _launch(_short_conv_dx_triton, x_BxTxC.shape, (dz, w_WxC, seg_BxT),
                  [jax.ShapeDtypeStruct(x_BxTxC.shape, x_BxTxC.dtype)], interpret, BT=BLOCK_T)
  return dx, dw_part.sum((0, 1)).astype(w_WxC.dtype), None


_short_conv.defvjp(_short_conv_fwd, _short_conv_bwd)


def short_conv(x_BxTxC, w_WxC, seg_BxT, *, interpret: bool | None = None):
  """silu(depthwise causal conv of x by w within each segment) [B, T, C] in x's dtype,
  fp32 inside; w [W, C] (tap j multiplies x[t - j]); differentiable in x and w."""
  _check(x_BxTxC, w_WxC, seg_BxT)
  return _short_conv(x_BxTxC, w_WxC, seg_BxT.astype(jnp.int32),
                     platform.interpret_off_gpu(interpret))
