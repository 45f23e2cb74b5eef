"""x @ w for a few rows (decoding), in Pallas (Triton lowering on GPU, `interpret=True` on CPU).

Why: at batch 1, XLA's GPU simplifier rewrites each decode projection (a vector times a
small matrix) into an elementwise product and a reduction, two kernels that write the
product out. (At batch 8 the H200 profile shows Triton GEMM fusions instead, and this kernel
is no faster end to end: benchmarks/long_context.md, "Experts at decode".) This kernel
reads w once, with the rows padded to ROWS (the smallest Triton dot).
K is split as well as N, so that a [1024, 1024] weight is spread over ≈ 256 programs rather
than 32 (one program per 32 columns left most of the H200's 132 SMs idle: 12.8 µs for a
2 MB weight); the fp32 partial sums over the K splits are added by XLA.

  grid (N / BLOCK_N, S): program (j, s) does x[:, K_s] · w[K_s, N_j] into partial [S, ROWS, N].

`dot_general` is the same contraction as `lax.dot_general` for flax's DenseGeneral: it
uses the kernel for ≤ ROWS rows on GPU when the shapes fit, and lax.dot_general otherwise.
The backward is XLA's (dx = dy · wᵀ, dw = xᵀ · dy): a gradient through a batch that small
(a test, a tiny GRPO step) still works, now that decoding takes the kernel by default.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

F32 = jnp.float32
ROWS = 16        # rows per call at most, padded to this
BLOCK_N = 32     # output columns per program
BLOCK_K = 64     # contraction step
NUM_WARPS = 4
PROGRAMS = 256   # aim for about this many programs: ≈ 2 per SM


def fits(M: int, K: int, N: int) -> bool:
  return 0 < M <= ROWS and K % BLOCK_K == 0 and N % BLOCK_N == 0


def _kernel(x_ref, w_ref, p_ref, *, block_k):
  K = x_ref.shape[1]

  def step(i, acc):
    ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
    return acc + jnp.dot(x_ref[:, ks], w_ref[ks, :], preferred_element_type=F32)

  p_ref[...] = jax.lax.fori_loop(0, K // block_k, step, jnp.zeros(p_ref.shape, F32))


def k_splits(K: int, N: int) -> int:
  """The number of K splits (a divisor of K / BLOCK_K) whose grid is nearest PROGRAMS, by
  ratio."""
  steps, blocks = K // BLOCK_K, N // BLOCK_N
  return min((s for s in range(1, steps + 1) if steps % s == 0),
             key=lambda s: abs(math.log(s * blocks / PROGRAMS)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def matmul(x_MxK, w_KxN, interpret: bool = False):
  """x @ w with fp32 accumulation, output in x's dtype; M ≤ ROWS, K % BLOCK_K == 0,
  N % BLOCK_N == 0 (`fits`)."""
  return _matmul(x_MxK, w_KxN, interpret)


def _matmul_fwd(x_MxK, w_KxN, interpret):
  return _matmul(x_MxK, w_KxN, interpret), (x_MxK, w_KxN)


def _matmul_bwd(interpret, res, dy_MxN):
  del interpret
  x_MxK, w_KxN = res
  dy = dy_MxN.astype(F32)
  return ((dy @ w_KxN.astype(F32).T).astype(x_MxK.dtype),
          (x_MxK.astype(F32).T @ dy).astype(w_KxN.dtype))


matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _matmul(x_MxK, w_KxN, interpret):
  M, K = x_MxK.shape
  N = w_KxN.shape[1]
  if w_KxN.shape[0] != K or not fits(M, K, N):
    raise ValueError(f"few_rows.matmul needs x [M ≤ {ROWS}, K] and w [K, N] with K % {BLOCK_K} "
                     f"== 0 and N % {BLOCK_N} == 0; got x {x_MxK.shape}, w {w_KxN.shape}")
  S = k_splits(K, N)
  Ks = K // S
  x_RxK = jnp.pad(x_MxK, ((0, ROWS - M), (0, 0))).astype(w_KxN.dtype)
  params = None if interpret else pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=2)
  p_SxRxN = pl.pallas_call(
      functools.partial(_kernel, block_k=BLOCK_K),
      grid=(N // BLOCK_N, S),
      in_specs=[pl.BlockSpec((ROWS, Ks), lambda j, s: (0, s)),
                pl.BlockSpec((Ks, BLOCK_N), lambda j, s: (s, j))],
      out_specs=pl.BlockSpec((None, ROWS, BLOCK_N), lambda j, s: (s, 0, j)),
      out_shape=jax.ShapeDtypeStruct((S, ROWS, N), F32),
      interpret=interpret, name="few_rows_matmul", compiler_params=params,
  )(x_RxK, w_KxN)
  return p_SxRxN[:, :M].sum(0).astype(x_MxK.dtype)


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *,
                interpret: bool = False):
  """lax.dot_general; a DenseGeneral-shaped contraction (lhs's trailing dims against rhs's
  leading dims, no batch dims) of ≤ ROWS rows goes to `matmul` on GPU (anywhere with
  interpret=True)."""
  (lc, rc), (lb, rb) = dimension_numbers
  nc = len(lc)
  trailing = tuple(lc) == tuple(range(lhs.ndim - nc, lhs.ndim))
  leading = tuple(rc) == tuple(range(nc))
  use = interpret or jax.default_backend() == "gpu"
  if use and trailing and leading and not lb and not rb and preferred_element_type is None:
    M = math.prod(lhs.shape[:lhs.ndim - nc])
    K = math.prod(lhs.shape[lhs.ndim - nc:])
    N = math.prod(rhs.shape[nc:])
    if fits(M, K, N) and lhs.dtype == rhs.dtype:
      y_MxN = matmul(lhs.reshape(M, K), rhs.reshape(K, N), interpret)
      return y_MxN.reshape(lhs.shape[:lhs.ndim - nc] + rhs.shape[nc:])
  return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                             preferred_element_type=preferred_element_type)
