"""Names on what a kernel's custom VJP keeps for its backward pass.

Under jax.checkpoint (the model's remat) a custom VJP's residuals are not saved unless the
policy saves them by name: the backward pass runs the forward kernels again to rebuild
them (MLA's flash forward twice per step, KDA's whole stage 1). The kernels tag their
residuals with NAME, and with CHEAP those that one cheap launch rebuilds (KDA stage 1's q̂,
k̂ and G: the prologue, which reads q, k and the gate input its own residuals keep). Remat
policy "residuals" (moe_jax/model/remat.py) saves both; "residuals_recompute_prologue"
saves NAME only. Outside jax.checkpoint the tag is the identity.
"""

import jax
from jax.ad_checkpoint import checkpoint_name

NAME = "kernel_residuals"
CHEAP = "kernel_residuals_cheap"


def tag(tree, name: str = NAME):
  """Every array in `tree`, named `name`."""
  return jax.tree.map(lambda x: checkpoint_name(x, name), tree)
