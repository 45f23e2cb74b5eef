"""Routed-expert SwiGLU math in the two expert-FFN layouts. Experts are stored stacked:
`gate_up` [E, D, 2, F] (gate and up fused so one grouped matmul does both) and `down`
[E, F, D].

* grouped (dropless): rows sorted by expert, pallas_kernels/moe/ops.py's grouped matmul
  over group sizes (model.moe.grouped_matmul picks its kernels).
* batched (capacity): tokens laid out [E, C, D], plain batched matmuls.
"""

import jax
import jax.numpy as jnp

from moe_jax.model import remat
from pallas_kernels.moe.ops import (default_grouped_matmul, grouped_matmul, swiglu_down,
                                    swiglu_grad_in_kernel)

F32 = jnp.float32


@jax.custom_vjp
def gated_silu(h_Xx2xF):
  """silu(gate) · up of the fused gate/up product [..., 2, F] (gate at index 0).

  Its own VJP because autodiff's is wasteful here: the linearisation keeps five [..., F]
  intermediates for the backward, and the two slices' transposes are two zero-padded
  [..., 2, F] cotangents summed by an add. Here the backward keeps only h (the `moe_h`
  residual the remat policies save anyway) and writes d(h) in one elementwise pass, in
  fp32 before the cast. The forward is the same expression, bit for bit."""
  return jax.nn.silu(h_Xx2xF[..., 0, :]) * h_Xx2xF[..., 1, :]


def _gated_silu_fwd(h_Xx2xF):
  return gated_silu(h_Xx2xF), h_Xx2xF


def _gated_silu_dh(h_Xx2xF, da_XxF):
  """d(h) of silu(gate) · up for the cotangent da (fp32), in h's dtype."""
  gate, up = h_Xx2xF[..., 0, :].astype(F32), h_Xx2xF[..., 1, :].astype(F32)
  sig = jax.nn.sigmoid(gate)
  d_gate = da_XxF * up * sig * (1.0 + gate * (1.0 - sig))  # d silu(x)/dx = σ(x)(1 + x(1 - σ(x)))
  d_up = da_XxF * gate * sig
  return jnp.stack([d_gate, d_up], axis=-2).astype(h_Xx2xF.dtype)


def _gated_silu_bwd(h_Xx2xF, da_XxF):
  return (_gated_silu_dh(h_Xx2xF, da_XxF.astype(F32)),)


gated_silu.defvjp(_gated_silu_fwd, _gated_silu_bwd)


@jax.custom_vjp
def weighted_gated_silu(h_Xx2xF, w_X):
  """w · silu(gate) · up, each row scaled by its routing weight (model.moe.
  weights_before_down), computed in fp32 and rounded once. gated_silu's backward with
  d(w) = Σ_F da · silu(gate) · up beside it: the residuals are h and w only."""
  gate, up = h_Xx2xF[..., 0, :].astype(F32), h_Xx2xF[..., 1, :].astype(F32)
  return (jax.nn.silu(gate) * up * w_X[..., None].astype(F32)).astype(h_Xx2xF.dtype)


def _weighted_gated_silu_fwd(h_Xx2xF, w_X):
  return weighted_gated_silu(h_Xx2xF, w_X), (h_Xx2xF, w_X)


def _weighted_gated_silu_bwd(res, da_XxF):
  h_Xx2xF, w_X = res
  da = da_XxF.astype(F32)
  a = jax.nn.silu(h_Xx2xF[..., 0, :].astype(F32)) * h_Xx2xF[..., 1, :].astype(F32)
  dw = (da * a).sum(-1).astype(w_X.dtype)
  return _gated_silu_dh(h_Xx2xF, da * w_X[..., None].astype(F32)), dw


weighted_gated_silu.defvjp(_weighted_gated_silu_fwd, _weighted_gated_silu_bwd)


def swiglu_grouped(x_MxD, group_sizes_E, gate_up_ExDx2xF, down_ExFxD, implementation="",
                   grad_in_kernel=False, w_M=None):
  """SwiGLU of each row by its group's expert (rows sorted by expert). grad_in_kernel
  (model.moe.swiglu_grad_in_kernel): on `triton`, the down projection's dx kernel writes
  the SwiGLU's gradient (ops.swiglu_down). w_M (model.moe.weights_before_down): each row's
  routing weight, applied to its activation before the down projection."""
  E, D, _, F = gate_up_ExDx2xF.shape
  x_MxD = remat.tag(x_MxD, "moe_x")
  h_Mx2F = remat.tag(grouped_matmul(x_MxD, gate_up_ExDx2xF.reshape(E, D, 2 * F),
                                    group_sizes_E, implementation), "moe_h")
  if grad_in_kernel and swiglu_grad_in_kernel(
      implementation or default_grouped_matmul(x_MxD.dtype, F, D), F, D):
    return remat.tag(swiglu_down(h_Mx2F, down_ExFxD, group_sizes_E, w_M), "moe_y")
  h_Mx2xF = h_Mx2F.reshape(-1, 2, F)
  a_MxF = remat.tag(gated_silu(h_Mx2xF) if w_M is None else weighted_gated_silu(h_Mx2xF, w_M),
                    "moe_a")
  return remat.tag(grouped_matmul(a_MxF, down_ExFxD, group_sizes_E, implementation), "moe_y")


def swiglu_batched(x_ExCxD, gate_up_ExDx2xF, down_ExFxD):
  """SwiGLU of every expert's [C, D] buffer: batched dense matmuls."""
  x_ExCxD = remat.tag(x_ExCxD, "moe_x")
  h_ExCx2xF = remat.tag(jnp.einsum("ecd,edgf->ecgf", x_ExCxD, gate_up_ExDx2xF), "moe_h")
  a_ExCxF = remat.tag(gated_silu(h_ExCx2xF), "moe_a")
  return remat.tag(jnp.einsum("ecf,efd->ecd", a_ExCxF, down_ExFxD), "moe_y")
