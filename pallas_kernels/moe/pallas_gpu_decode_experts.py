"""Routed SwiGLU experts for a few tokens (decoding), in Pallas (Triton lowering on GPU,
`interpret=True` elsewhere): each (token, expert) assignment reads its expert's weights
once, at full bandwidth.

Why: with N·k ≤ E the MoE layer gathers each assignment's weights and contracts them with
one einsum. XLA fuses the gather into a reduction that reads the weights at ≈ 0.4 TB/s on
the H200 (benchmarks/long_context.md), and that is most of the decode step's growth with the
batch. Here the expert index is read inside the kernel and the weight tiles are loaded
directly; a row against a [64, block_f] tile is a multiply and a column sum (one
row is below Triton's smallest dot). Measured at batch 8 (32 assignments): 2.6–2.8 TB/s,
193 → 53 µs per MoE layer; at 4 assignments the grid is too small and gather is faster
(moe.decode_path picks).

  up:   grid (A, F / block_f): a[a, f] = silu(x_t · Wg[e]) ⊙ (x_t · Wu[e]),
        t = a // k, e = idx[a]
  down: grid (A, D / block_d): y[a, d] = a[a] · Wd[e]

The column tiles narrow (64 → 32 → 16) until the grid has FILL programs: at batch 1 and
top-4 the 64-wide up kernel has only 4 × 11 programs for 132 SMs, which is why gather's
fusion beat it there (`tiles`).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

F32 = jnp.float32
BLOCK_F = 64     # hidden columns per program of the up kernel (at most), and rows per step of down
BLOCK_D = 64     # model columns per program of the down kernel (at most), and rows per step of up
NUM_WARPS = 4
FILL = 132       # programs a grid should have: the H100's and H200's SM count


def tiles(A: int, D: int, F: int) -> tuple[int, int]:
  """(up kernel's columns, down kernel's columns) a program: the widest of 64, 32, 16 whose
  grid over A assignments has at least FILL programs (16 if none has). Never below 16
  columns, Triton's smallest tile side."""
  def widest(n, block):
    widths = [w for w in (block, block // 2, block // 4) if w >= min(16, block)]
    return next((w for w in widths if A * (n // w) >= FILL), widths[-1])
  return widest(F, BLOCK_F), widest(D, BLOCK_D)


def fits(D: int, F: int) -> bool:
  return D % BLOCK_D == 0 and F % BLOCK_F == 0


def row_times(x_R, w_RxC):
  """x [R] · w [R, C] in fp32, w rounded to x's dtype first (as the XLA path casts weights
  to the model dtype): weights of another dtype are read as stored, with no convert kernel."""
  return jnp.sum(x_R.astype(F32)[:, None] * w_RxC.astype(x_R.dtype).astype(F32), axis=0)


def _up_kernel(idx_ref, x_ref, w_ref, a_ref, *, block_f):
  D = x_ref.shape[0]
  e = idx_ref[0]
  cols = pl.ds(pl.program_id(1) * block_f, block_f)

  def step(i, acc):
    g_F, u_F = acc
    rows = pl.ds(pl.multiple_of(i * BLOCK_D, BLOCK_D), BLOCK_D)
    x_R = x_ref[rows]
    return (g_F + row_times(x_R, w_ref[e, rows, 0, cols]),
            u_F + row_times(x_R, w_ref[e, rows, 1, cols]))

  zeros = jnp.zeros((block_f,), F32)
  g_F, u_F = jax.lax.fori_loop(0, D // BLOCK_D, step, (zeros, zeros))
  a_ref[...] = (jax.nn.silu(g_F) * u_F).astype(a_ref.dtype)


def _down_kernel(idx_ref, a_ref, w_ref, y_ref, *, block_d):
  F = a_ref.shape[0]
  e = idx_ref[0]
  cols = pl.ds(pl.program_id(1) * block_d, block_d)

  def step(i, acc):
    rows = pl.ds(pl.multiple_of(i * BLOCK_F, BLOCK_F), BLOCK_F)
    return acc + row_times(a_ref[rows], w_ref[e, rows, cols])

  y_ref[...] = jax.lax.fori_loop(0, F // BLOCK_F, step,
                                 jnp.zeros((block_d,), F32)).astype(y_ref.dtype)


def swiglu_experts(x_NxD, idx_NxK, gate_up_ExDx2xF, down_ExFxD, *, interpret=None):
  """y[n, j] = SwiGLU of token n by expert idx[n, j]: [N, K, D] in x's dtype (fp32 sums)."""
  N, K = idx_NxK.shape
  E, D, _, F = gate_up_ExDx2xF.shape
  if not fits(D, F):
    raise ValueError(f"decode_experts needs D % {BLOCK_D} == 0 and F % {BLOCK_F} == 0; "
                     f"got D={D}, F={F}")
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  A = N * K
  block_f, block_d = tiles(A, D, F)
  idx_A = idx_NxK.reshape(A).astype(jnp.int32)
  x_NxD = x_NxD.astype(gate_up_ExDx2xF.dtype)
  params = None if interpret else pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=2)
  whole = lambda shape: pl.BlockSpec(shape, lambda a, j: (0,) * len(shape))
  one_idx = pl.BlockSpec((1,), lambda a, j: (a,))
  a_AxF = pl.pallas_call(
      functools.partial(_up_kernel, block_f=block_f), grid=(A, F // block_f),
      in_specs=[one_idx, pl.BlockSpec((None, D), lambda a, j: (a // K, 0)),
                whole(gate_up_ExDx2xF.shape)],
      out_specs=pl.BlockSpec((None, block_f), lambda a, j: (a, j)),
      out_shape=jax.ShapeDtypeStruct((A, F), x_NxD.dtype),
      interpret=interpret, name="decode_experts_up", compiler_params=params,
  )(idx_A, x_NxD, gate_up_ExDx2xF)
  y_AxD = pl.pallas_call(
      functools.partial(_down_kernel, block_d=block_d), grid=(A, D // block_d),
      in_specs=[one_idx, pl.BlockSpec((None, F), lambda a, j: (a, 0)),
                whole(down_ExFxD.shape)],
      out_specs=pl.BlockSpec((None, block_d), lambda a, j: (a, j)),
      out_shape=jax.ShapeDtypeStruct((A, D), x_NxD.dtype),
      interpret=interpret, name="decode_experts_down", compiler_params=params,
  )(idx_A, a_AxF, down_ExFxD)
  return y_AxD.reshape(N, K, D)
