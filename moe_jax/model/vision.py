"""Image patches in the token stream (data/images.py): the embedding of a PATCH position
comes from its pixels, and the optional reconstruction head predicts the next patch.

Early fusion: there is no vision encoder. A patch is a linear map of its P·P·C pixels plus a
learned row and column embedding (the model is NoPE, so this 2-D position is all an image
has), and from there it is a token like any other: the same KDA/MLA mixers and MoE experts.
"""

import flax.linen as nn
import jax.numpy as jnp

from moe_jax.data import tokenizer
from moe_jax.model.layers import dense, dtype_of, lp


def patch_dim(vision_cfg) -> int:
  return vision_cfg.patch_size ** 2 * vision_cfg.channels


class PatchEmbed(nn.Module):
  """x at PATCH positions ← W·pixels + b + row_embed[r] + col_embed[c]; text unchanged."""
  cfg: object

  @nn.compact
  def __call__(self, x_BxTxD, batch):
    cfg, v = self.cfg, self.cfg.vision
    D = x_BxTxD.shape[-1]
    pixels_BxTxP = batch["patches"].astype(dtype_of(cfg))
    y_BxTxD = dense(cfg, D, ("patch", "embed"), "patch_proj", use_bias=True)(pixels_BxTxP)
    pos = lambda n, name: nn.Embed(n, D, dtype=dtype_of(cfg), param_dtype=jnp.float32,
                                   embedding_init=lp(nn.initializers.normal(1.0),
                                                     ("patch_grid", "embed")), name=name)
    y_BxTxD = (y_BxTxD + pos(v.max_rows, "row_embed")(batch["patch_rows"])
               + pos(v.max_cols, "col_embed")(batch["patch_cols"]))
    is_patch_BxT = batch["tokens"] == tokenizer.PATCH
    return jnp.where(is_patch_BxT[..., None], y_BxTxD.astype(x_BxTxD.dtype), x_BxTxD)


def patch_head(cfg, x_BxTxD):
  """Position t's prediction of the pixels at t + 1 ([B, T, P·P·C], fp32)."""
  head = dense(cfg, patch_dim(cfg.vision), ("embed", "patch"), "patch_head")
  return head(x_BxTxD).astype(jnp.float32)


def next_patch_loss(pred_BxTxP, batch):
  """Mean squared error of the predicted next patch, over positions whose next token is a
  patch of the same image (the targets say which: PAD across a segment edge)."""
  target_BxTxP = jnp.roll(batch["patches"], -1, axis=1).astype(jnp.float32)
  mask_BxT = (batch["targets"] == tokenizer.PATCH).astype(jnp.float32)
  err_BxT = jnp.mean((pred_BxTxP - target_BxTxP) ** 2, -1)
  return (err_BxT * mask_BxT).sum() / jnp.maximum(mask_BxT.sum(), 1.0)
