"""Decode attention over an MLA latent cache, split over the cache (flash-decoding), in
Pallas (Triton lowering on GPU, `interpret=True` on CPU).

A decode step has a handful of query rows (T new tokens × H heads, k_b absorbed, so each
row is a vector in the latent space of rank R) and a cache of S latents [S, R] that serve
as both keys and values. One row block cannot fill a GPU, so the cache is split into
chunks of CHUNK positions: program (b, c) runs an online softmax over chunk c (only up to
the filled length; chunks past it exit at once) and writes its partial (max, sum, acc);
a small XLA step merges the partials. The latent is read once per step, and the filled
length is read inside the kernel, so the step has no loop that the host has to drive.

  grid (B, ⌈S / CHUNK⌉), rows [Q, R] per program, key blocks of `launch_knobs(R)` positions.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.attention.pallas_gpu_tiles import tile_dim

F32 = jnp.float32

CHUNK = 4096      # cache positions per program
BLOCK_K = 64      # positions per step of a program's online softmax, at R <= WIDE_RANK
NUM_WARPS = 4     # at R <= WIDE_RANK
NUM_STAGES = 2
WIDE_RANK = 256   # above it, fewer positions a step and more warps: see `launch_knobs`


def launch_knobs(R: int) -> tuple[int, int]:
  """(positions a step, warps) at latent rank R. A program holds its [Q, R] fp32 accumulator
  and a [block_k, R] cache block in registers, so above rank 256 the block shrinks and the
  warps grow with R: each thread holds about what it holds at rank 256. At R = 512
  (Kimi-48B's kv_lora_rank) that is 32 positions on 8 warps (benchmarks/gpu_tests.md)."""
  if R <= WIDE_RANK:
    return BLOCK_K, NUM_WARPS
  scale = R // WIDE_RANK
  return max(16, BLOCK_K // scale), min(16, NUM_WARPS * scale)


def _kernel(kv_len_ref, pos_ref, q_ref, c_ref, m_ref, l_ref, acc_ref, *, block_k, chunk):
  Q, R = q_ref.shape
  S = c_ref.shape[0]
  kv_len = kv_len_ref[0]
  pos_Q = pos_ref[...]
  first = pl.program_id(1) * chunk
  # Positions this chunk may need: below the filled length and the last query's position.
  hi = jnp.minimum(jnp.minimum(kv_len, jnp.max(pos_Q) + 1), first + chunk)
  n_blocks = (jnp.maximum(hi - first, 0) + block_k - 1) // block_k
  q_QxR = q_ref[...]

  def body(j, carry):
    m_Q, l_Q, acc_QxR = carry
    nominal = first + j * block_k
    start = jnp.minimum(nominal, S - block_k)  # a block past S overlaps the one before
    c_KxR = c_ref[pl.ds(start, block_k), :]
    s_QxK = jax.lax.dot_general(q_QxR, c_KxR, (((1,), (1,)), ((), ())),
                                preferred_element_type=F32)
    j_K = start + jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    visible_QxK = ((j_K[None, :] >= nominal) & (j_K[None, :] < first + chunk)
                   & (j_K[None, :] <= pos_Q[:, None]) & (j_K[None, :] < kv_len))
    s_QxK = jnp.where(visible_QxK, s_QxK, -jnp.inf)
    m_new = jnp.maximum(m_Q, s_QxK.max(axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p_QxK = jnp.exp(s_QxK - m_safe[:, None])
    corr_Q = jnp.exp(m_Q - m_safe)
    acc_QxR = acc_QxR * corr_Q[:, None] + jnp.dot(p_QxK.astype(c_KxR.dtype), c_KxR,
                                                  preferred_element_type=F32)
    return m_new, l_Q * corr_Q + p_QxK.sum(axis=1), acc_QxR

  init = (jnp.full((Q,), -jnp.inf, F32), jnp.zeros((Q,), F32), jnp.zeros((Q, R), F32))
  m_Q, l_Q, acc_QxR = jax.lax.fori_loop(0, n_blocks, body, init)
  m_ref[...], l_ref[...], acc_ref[...] = m_Q, l_Q, acc_QxR


def fits(R: int) -> bool:
  """The latent rank is a whole tile (padding it would copy the whole cache every step)."""
  return tile_dim(R) == R


def latent_decode_attention(q_BxQxR, ckv_BxSxR, pos_BxQ, kv_len_B, *, interpret=None):
  """softmax(q · cᵀ) c over the visible cache positions, per row: [B, Q, R] fp32.

  q_BxQxR: query rows already in the latent space and scaled (k_b absorbed).
  pos_BxQ: each row's position (it sees cache positions j ≤ pos with j < kv_len_B[b]).
  A row that sees nothing gets zeros.
  """
  B, Q, R = q_BxQxR.shape
  S = ckv_BxSxR.shape[1]
  if not fits(R):
    raise ValueError(f"latent_decode_attention needs a latent rank R that is a power of two "
                     f">= 16, got R={R}")
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  block_k, num_warps = launch_knobs(R)
  Qp = max(16, pl.next_power_of_2(Q))   # matmul tiles need ≥ 16 rows
  q_BxQxR = jnp.pad(q_BxQxR.astype(ckv_BxSxR.dtype), ((0, 0), (0, Qp - Q), (0, 0)))
  pos_BxQ = jnp.pad(pos_BxQ.astype(jnp.int32), ((0, 0), (0, Qp - Q)), constant_values=-1)
  if S < block_k:
    ckv_BxSxR = jnp.pad(ckv_BxSxR, ((0, 0), (0, block_k - S), (0, 0)))
    S = block_k
  # Whole key blocks per chunk, and no more chunk than the cache needs.
  chunk = min(max(block_k, CHUNK // block_k * block_k), pl.cdiv(S, block_k) * block_k)
  n_chunks = pl.cdiv(S, chunk)
  params = None if interpret else pltriton.CompilerParams(num_warps=num_warps,
                                                          num_stages=NUM_STAGES)
  part = lambda *shape: pl.BlockSpec((None, None, *shape), lambda b, c: (b, c) + (0,) * len(shape))
  m_BxCxQ, l_BxCxQ, acc_BxCxQxR = pl.pallas_call(
      functools.partial(_kernel, block_k=block_k, chunk=chunk),
      grid=(B, n_chunks),
      in_specs=[pl.BlockSpec((1,), lambda b, c: (b,)),
                pl.BlockSpec((None, Qp), lambda b, c: (b, 0)),
                pl.BlockSpec((None, Qp, R), lambda b, c: (b, 0, 0)),
                pl.BlockSpec((None, S, R), lambda b, c: (b, 0, 0))],
      out_specs=[part(Qp), part(Qp), part(Qp, R)],
      out_shape=[jax.ShapeDtypeStruct((B, n_chunks, Qp), F32),
                 jax.ShapeDtypeStruct((B, n_chunks, Qp), F32),
                 jax.ShapeDtypeStruct((B, n_chunks, Qp, R), F32)],
      interpret=interpret, name="latent_decode", compiler_params=params,
  )(kv_len_B.astype(jnp.int32), pos_BxQ, q_BxQxR, ckv_BxSxR)
  # Merge the chunks' partial softmaxes.
  m_BxQ = m_BxCxQ.max(axis=1)
  m_safe = jnp.where(m_BxQ == -jnp.inf, 0.0, m_BxQ)
  w_BxCxQ = jnp.where(m_BxCxQ == -jnp.inf, 0.0, jnp.exp(m_BxCxQ - m_safe[:, None]))
  l_BxQ = (w_BxCxQ * l_BxCxQ).sum(1)
  acc_BxQxR = jnp.einsum("bcq,bcqr->bqr", w_BxCxQ, acc_BxCxQxR)
  o_BxQxR = acc_BxQxR / jnp.where(l_BxQ == 0.0, 1.0, l_BxQ)[..., None]
  return o_BxQxR[:, :Q]
