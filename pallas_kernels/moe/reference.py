"""The exact specs the MoE kernels are tested against, in plain JAX: the grouped matmul
and its weight gradient (ops.py, mosaic_gpu_grouped.py, pallas_gpu_grouped_dw.py), and the
per-assignment SwiGLU of decode (pallas_gpu_decode_experts.py; also the MoE layer's gather path)."""

import jax
import jax.numpy as jnp

F32 = jnp.float32


def _group_of_row(group_sizes_G, M: int):
  """[M] group id of each row (rows sorted by group); G for rows past the last group."""
  ends_G = jnp.cumsum(group_sizes_G)
  return jnp.searchsorted(ends_G, jnp.arange(M), side="right")


def ragged_dot(x_MxK, w_GxKxN, group_sizes_G):
  """[M, N] fp32: row m of x times w[g] for the group g it falls in; rows past
  sum(group_sizes) are 0."""
  G = w_GxKxN.shape[0]
  onehot_MxG = jax.nn.one_hot(_group_of_row(group_sizes_G, x_MxK.shape[0]), G, dtype=F32)
  return jnp.einsum("mk,gkn,mg->mn", x_MxK.astype(F32), w_GxKxN.astype(F32), onehot_MxG)


def ragged_dw(x_MxK, dy_MxN, group_sizes_G):
  """[G, K, N] fp32: dw[g] = x[rows of g]ᵀ · dy[rows of g]; rows past the last group are
  never read into a sum."""
  G = group_sizes_G.shape[0]
  onehot_MxG = jax.nn.one_hot(_group_of_row(group_sizes_G, x_MxK.shape[0]), G, dtype=F32)
  x_MxK = jnp.where(onehot_MxG.sum(1, keepdims=True) > 0, x_MxK.astype(F32), 0.0)
  dy_MxN = jnp.where(onehot_MxG.sum(1, keepdims=True) > 0, dy_MxN.astype(F32), 0.0)
  return jnp.einsum("mk,mn,mg->gkn", x_MxK, dy_MxN, onehot_MxG)


def swiglu_experts(x_NxD, idx_NxK, gate_up_ExDx2xF, down_ExFxD):
  """[N, K, D]: SwiGLU of token n by expert idx[n, j], through gathered weight copies."""
  gate_up_NxKxDx2xF, down_NxKxFxD = gate_up_ExDx2xF[idx_NxK], down_ExFxD[idx_NxK]
  h_NxKx2xF = jnp.einsum("nd,nkdgf->nkgf", x_NxD, gate_up_NxKxDx2xF)
  a_NxKxF = jax.nn.silu(h_NxKx2xF[:, :, 0]) * h_NxKx2xF[:, :, 1]
  return jnp.einsum("nkf,nkfd->nkd", a_NxKxF, down_NxKxFxD)
