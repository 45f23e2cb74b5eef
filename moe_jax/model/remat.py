"""What a rematerialised block keeps for the backward pass (model.remat, model.remat_policy).

  full     nothing but the block's input: the whole block runs twice.
  dots     the outputs of matmuls with a weight (projections); elementwise work, attention
           and the MoE kernels run again in the backward pass.
  kernels  dots, plus the outputs of the expensive kernels, tagged here by name: the KDA and
           MLA attention outputs and both expert matmuls of the MoE.
  residuals  kernels, plus what the kernels' custom VJPs keep for their backward pass
           (pallas_kernels/residuals.py: KDA's stage-1 inputs and outputs, the flash
           attention's output and log-sum-exp): no kernel's forward runs twice, for memory
           (about 1 GB per KDA layer of `long_context_1b` at 8192 × 4).
  residuals_recompute_prologue  residuals, less KDA stage 1's q̂, k̂ and G (0.27 GB per KDA
           layer at 8192 × 4 × 16 heads of 64): the backward pass runs KDA's prologue (one
           launch over q, k and the gate input) again to rebuild them.

model.remat_expert_rows adds EXPERT_ROWS (below) to any of them.

Under nn.scan every value the backward pass reads is stored per period (XLA cannot fuse
a cheap producer into its consumer across the loop), so scanned layers at long context
need a policy; measured choices are in benchmarks/train.md.
"""

import jax
from jax.ad_checkpoint import checkpoint_name

from moe_jax.fields import REMAT_POLICIES
from pallas_kernels import residuals

KERNEL_OUTPUTS = ("kda_out", "mla_out", "moe_h", "moe_y")
# model.remat_expert_rows: the routed experts' input rows (the dispatch gather's output),
# their SwiGLU activation (the expert matmuls' weight gradients read both) and their output
# rows in token order (the combine's weight gradient reads it). Saved, the backward pass
# runs neither gather nor the SwiGLU again, for N·k·(2D + F) values a MoE layer (10.8 GB
# over long_context_1b's 15 at 8192 × 4 in bf16). With model.moe.swiglu_grad_in_kernel there
# is no moe_a to save: the down projection's dx kernel recomputes it from moe_h.
EXPERT_ROWS = ("moe_x", "moe_a", "moe_y_tokens")


def tag(x, name: str):
  """Marks x as one of KERNEL_OUTPUTS (identity outside jax.checkpoint)."""
  return checkpoint_name(x, name)


# The names each name-saving policy keeps, on top of the dots.
SAVED_NAMES = {"kernels": KERNEL_OUTPUTS,
               "residuals": KERNEL_OUTPUTS + (residuals.NAME, residuals.CHEAP),
               "residuals_recompute_prologue": KERNEL_OUTPUTS + (residuals.NAME,)}


def policy(name: str, expert_rows: bool = False):
  """The checkpoint policy of remat_policy `name`, also saving EXPERT_ROWS if asked."""
  cp = jax.checkpoint_policies
  if name not in REMAT_POLICIES:
    raise ValueError(f"model.remat_policy must be one of {REMAT_POLICIES}, got {name!r}")
  names = SAVED_NAMES.get(name, ()) + (EXPERT_ROWS if expert_rows else ())
  if name == "full":
    return cp.save_only_these_names(*names) if names else None
  if not names:
    return cp.dots_with_no_batch_dims_saveable
  return cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable,
                                    cp.save_only_these_names(*names))
