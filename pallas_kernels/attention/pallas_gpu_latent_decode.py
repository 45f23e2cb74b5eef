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

Triton tiles are powers of two, and padding the latent would copy the whole cache every
step, so a rank that is not one is read as two tiles side by side (`rank_parts`): Kimi
Linear's latent, kv_lora 512 plus its 64 shared key dims, is 576 = 512 + 64.
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


def rank_parts(R: int) -> tuple[int, ...] | None:
  """The latent rank as at most two power-of-two tiles ≥ 16 (the larger first, so each
  starts at a whole number of its own widths), or None."""
  if R >= 16 and tile_dim(R) == R:
    return (R,)
  hi = 1 << (R.bit_length() - 1)
  lo = R - hi
  return (hi, lo) if lo >= 16 and tile_dim(lo) == lo else None


def _kernel(kv_len_ref, pos_ref, *refs, block_k, chunk, n_parts):
  q_refs, c_refs = refs[:n_parts], refs[n_parts:2 * n_parts]
  m_ref, l_ref, acc_refs = refs[2 * n_parts], refs[2 * n_parts + 1], refs[2 * n_parts + 2:]
  Q = q_refs[0].shape[0]
  S = c_refs[0].shape[0]
  kv_len = kv_len_ref[0]
  pos_Q = pos_ref[...]
  first = pl.program_id(1) * chunk
  # Positions this chunk may need: below the filled length and the last query's position.
  hi = jnp.minimum(jnp.minimum(kv_len, jnp.max(pos_Q) + 1), first + chunk)
  n_blocks = (jnp.maximum(hi - first, 0) + block_k - 1) // block_k
  qs = [q_ref[...] for q_ref in q_refs]

  def body(j, carry):
    m_Q, l_Q, accs = carry
    nominal = first + j * block_k
    start = jnp.minimum(nominal, S - block_k)  # a block past S overlaps the one before
    cs = [c_ref[pl.ds(start, block_k), :] for c_ref in c_refs]
    s_QxK = sum(jax.lax.dot_general(q_QxW, c_KxW, (((1,), (1,)), ((), ())),
                                    preferred_element_type=F32) for q_QxW, c_KxW in zip(qs, cs))
    j_K = start + jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    visible_QxK = ((j_K[None, :] >= nominal) & (j_K[None, :] < first + chunk)
                   & (j_K[None, :] <= pos_Q[:, None]) & (j_K[None, :] < kv_len))
    s_QxK = jnp.where(visible_QxK, s_QxK, -jnp.inf)
    m_new = jnp.maximum(m_Q, s_QxK.max(axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p_QxK = jnp.exp(s_QxK - m_safe[:, None])
    corr_Q = jnp.exp(m_Q - m_safe)
    accs = tuple(acc_QxW * corr_Q[:, None] + jnp.dot(p_QxK.astype(c_KxW.dtype), c_KxW,
                                                      preferred_element_type=F32)
                 for acc_QxW, c_KxW in zip(accs, cs))
    return m_new, l_Q * corr_Q + p_QxK.sum(axis=1), accs

  init = (jnp.full((Q,), -jnp.inf, F32), jnp.zeros((Q,), F32),
          tuple(jnp.zeros((Q, c_ref.shape[1]), F32) for c_ref in c_refs))
  m_Q, l_Q, accs = jax.lax.fori_loop(0, n_blocks, body, init)
  m_ref[...], l_ref[...] = m_Q, l_Q
  for acc_ref, acc_QxW in zip(acc_refs, accs):
    acc_ref[...] = acc_QxW


def fits(R: int) -> bool:
  """The latent rank is one or two whole tiles (rank_parts)."""
  return rank_parts(R) is not None


def latent_decode_attention(q_BxQxR, ckv_BxSxR, pos_BxQ, kv_len_B, *, interpret=None):
  """softmax(q · cᵀ) c over the visible cache positions, per row: [B, Q, R] fp32.

  q_BxQxR: query rows already in the latent space and scaled (k_b absorbed).
  pos_BxQ: each row's position (it sees cache positions j ≤ pos with j < kv_len_B[b]).
  A row that sees nothing gets zeros.
  """
  B, Q, R = q_BxQxR.shape
  S = ckv_BxSxR.shape[1]
  parts = rank_parts(R)
  if parts is None:
    raise ValueError(f"latent_decode_attention needs a latent rank R that is a power of two "
                     f">= 16 or the sum of two (e.g. 576 = 512 + 64), got R={R}")
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
  per_chunk = lambda *shape: pl.BlockSpec((None, None, *shape),
                                          lambda b, c: (b, c) + (0,) * len(shape))
  # Tile i of the rank: width w at column offset o, which is o // w whole blocks of w.
  offsets = [sum(parts[:i]) for i in range(len(parts))]
  cols = lambda rows, w, o: pl.BlockSpec((None, rows, w), lambda b, c: (b, 0, o // w))
  m_BxCxQ, l_BxCxQ, *accs = pl.pallas_call(
      functools.partial(_kernel, block_k=block_k, chunk=chunk, n_parts=len(parts)),
      grid=(B, n_chunks),
      in_specs=[pl.BlockSpec((1,), lambda b, c: (b,)),
                pl.BlockSpec((None, Qp), lambda b, c: (b, 0)),
                *[cols(Qp, w, o) for w, o in zip(parts, offsets)],
                *[cols(S, w, o) for w, o in zip(parts, offsets)]],
      out_specs=[per_chunk(Qp), per_chunk(Qp), *[per_chunk(Qp, w) for w in parts]],
      out_shape=[jax.ShapeDtypeStruct((B, n_chunks, Qp), F32),
                 jax.ShapeDtypeStruct((B, n_chunks, Qp), F32),
                 *[jax.ShapeDtypeStruct((B, n_chunks, Qp, w), F32) for w in parts]],
      interpret=interpret, name="latent_decode", compiler_params=params,
  )(kv_len_B.astype(jnp.int32), pos_BxQ, *[q_BxQxR] * len(parts), *[ckv_BxSxR] * len(parts))
  acc_BxCxQxR = accs[0] if len(accs) == 1 else jnp.concatenate(accs, axis=-1)
  # Merge the chunks' partial softmaxes.
  m_BxQ = m_BxCxQ.max(axis=1)
  m_safe = jnp.where(m_BxQ == -jnp.inf, 0.0, m_BxQ)
  w_BxCxQ = jnp.where(m_BxCxQ == -jnp.inf, 0.0, jnp.exp(m_BxCxQ - m_safe[:, None]))
  l_BxQ = (w_BxCxQ * l_BxCxQ).sum(1)
  acc_BxQxR = jnp.einsum("bcq,bcqr->bqr", w_BxCxQ, acc_BxCxQxR)
  o_BxQxR = acc_BxQxR / jnp.where(l_BxQ == 0.0, 1.0, l_BxQ)[..., None]
  return o_BxQxR[:, :Q]
