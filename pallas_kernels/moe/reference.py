"""The exact specs the MoE kernels are tested against, in plain JAX: the grouped matmul
and its weight gradient (ops.py, mosaic_gpu_grouped.py, pallas_gpu_grouped_dw.py), and the
per-assignment SwiGLU of decode (pallas_gpu_decode_experts.py; also the MoE layer's gather path)."""

import jax
import jax.numpy as jnp

F32 = jnp.float32


def _rows_by_group(group_sizes_G, rows_MxX):
  """(one-hot [M, G] of each row's group, the rows in fp32 with those past the last group
  zeroed): rows are sorted by group, and padding past them may hold anything, NaN too."""
  G, M = group_sizes_G.shape[0], rows_MxX.shape[0]
  group_M = jnp.searchsorted(jnp.cumsum(group_sizes_G), jnp.arange(M), side="right")
  onehot_MxG = jax.nn.one_hot(group_M, G, dtype=F32)   # all zeros past the last group
  return onehot_MxG, jnp.where((group_M < G)[:, None], rows_MxX.astype(F32), 0.0)


def ragged_dot(x_MxK, w_GxKxN, group_sizes_G):
  """[M, N] fp32: row m of x times w[g] for the group g it falls in; rows past
  sum(group_sizes) are 0."""
  onehot_MxG, x_MxK = _rows_by_group(group_sizes_G, x_MxK)
  return jnp.einsum("mk,gkn,mg->mn", x_MxK, w_GxKxN.astype(F32), onehot_MxG)


def ragged_dw(x_MxK, dy_MxN, group_sizes_G):
  """[G, K, N] fp32: dw[g] = x[rows of g]ᵀ · dy[rows of g]; rows past the last group are
  never read into a sum."""
  onehot_MxG, x_MxK = _rows_by_group(group_sizes_G, x_MxK)
  _, dy_MxN = _rows_by_group(group_sizes_G, dy_MxN)
  return jnp.einsum("mk,mn,mg->gkn", x_MxK, dy_MxN, onehot_MxG)


def swiglu_experts(x_NxD, idx_NxK, gate_up_ExDx2xF, down_ExFxD):
  """[N, K, D]: SwiGLU of token n by expert idx[n, j], through gathered weight copies."""
  gate_up_NxKxDx2xF, down_NxKxFxD = gate_up_ExDx2xF[idx_NxK], down_ExFxD[idx_NxK]
  h_NxKx2xF = jnp.einsum("nd,nkdgf->nkgf", x_NxD, gate_up_NxKxDx2xF)
  a_NxKxF = jax.nn.silu(h_NxKx2xF[:, :, 0]) * h_NxKx2xF[:, :, 1]
  return jnp.einsum("nkf,nkfd->nkd", a_NxKxF, down_NxKxFxD)
