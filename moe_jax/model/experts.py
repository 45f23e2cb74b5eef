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
from pallas_kernels.moe.ops import grouped_matmul

def swiglu_grouped(x_MxD, group_sizes_E, gate_up_ExDx2xF, down_ExFxD, implementation=""):
  """SwiGLU of each row by its group's expert (rows sorted by expert)."""
  E, D, _, F = gate_up_ExDx2xF.shape
  h_Mx2F = remat.tag(grouped_matmul(x_MxD, gate_up_ExDx2xF.reshape(E, D, 2 * F),
                                    group_sizes_E, implementation), "moe_h")
  h_Mx2xF = h_Mx2F.reshape(-1, 2, F)
  a_MxF = jax.nn.silu(h_Mx2xF[:, 0]) * h_Mx2xF[:, 1]
  return remat.tag(grouped_matmul(a_MxF, down_ExFxD, group_sizes_E, implementation), "moe_y")


def swiglu_batched(x_ExCxD, gate_up_ExDx2xF, down_ExFxD):
  """SwiGLU of every expert's [C, D] buffer: batched dense matmuls."""
  h_ExCx2xF = remat.tag(jnp.einsum("ecd,edgf->ecgf", x_ExCxD, gate_up_ExDx2xF), "moe_h")
  a_ExCxF = jax.nn.silu(h_ExCx2xF[:, :, 0]) * h_ExCx2xF[:, :, 1]
  return remat.tag(jnp.einsum("ecf,efd->ecd", a_ExCxF, down_ExFxD), "moe_y")
