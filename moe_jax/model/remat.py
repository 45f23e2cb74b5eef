"""What a rematerialised block keeps for the backward pass (model.remat, model.remat_policy).

  full     nothing but the block's input: the whole block runs twice.
  dots     the outputs of matmuls with a weight (projections); elementwise work, attention
           and the MoE kernels run again in the backward pass.
  kernels  dots, plus the outputs of the expensive kernels, tagged here by name: the KDA and
           MLA attention outputs and both expert matmuls of the MoE.

Under nn.scan every value the backward pass reads is stored per period (XLA cannot fuse
a cheap producer into its consumer across the loop), so scanned layers at long context
need a policy; measured choices are in benchmarks/train.md.
"""

import jax
from jax.ad_checkpoint import checkpoint_name

from moe_jax.config import REMAT_POLICIES

KERNEL_OUTPUTS = ("kda_out", "mla_out", "moe_h", "moe_y")


def tag(x, name: str):
  """Marks x as one of KERNEL_OUTPUTS (identity outside jax.checkpoint)."""
  return checkpoint_name(x, name)


def policy(name: str):
  cp = jax.checkpoint_policies
  if name == "full":
    return None
  if name == "dots":
    return cp.dots_with_no_batch_dims_saveable
  if name == "kernels":
    return cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable,
                                      cp.save_only_these_names(*KERNEL_OUTPUTS))
  raise ValueError(f"model.remat_policy must be one of {REMAT_POLICIES}, got {name!r}")
