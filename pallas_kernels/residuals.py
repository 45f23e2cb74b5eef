"""A name on what a kernel's custom VJP keeps for its backward pass.

Under jax.checkpoint (the model's remat) a custom VJP's residuals are not saved unless the
policy saves them by name: the backward pass runs the forward kernels again to rebuild
them (MLA's flash forward twice per step, KDA's whole stage 1). The kernels tag their
residuals with NAME; remat policy "residuals" (moe_jax/model/remat.py) saves them. Outside
jax.checkpoint the tag is the identity.
"""

import jax
from jax.ad_checkpoint import checkpoint_name

NAME = "kernel_residuals"


def tag(tree):
  """Every array in `tree`, named NAME."""
  return jax.tree.map(lambda x: checkpoint_name(x, NAME), tree)
