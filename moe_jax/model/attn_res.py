"""Attention residuals: what each sub-layer (mixer or FFN) reads from the layers below.

Every sub-layer i reads an input h_i and writes an output y_i. `model.attn_res` picks
how h_i is formed:

  none   plain pre-norm residual: h_i = x = embedding + Σ_{j<i} y_j.
  full   h_i = Σ_j α_ij v_j over v = [embedding, y_0, …, y_{i-1}], with
         α_i = softmax_j(w_i · RMSNorm(v_j)). w_i is a learned pseudo-query per sub-layer,
         zero at init (a uniform average). Memory grows with depth.
  block  The same softmax over [embedding, completed block summaries…, partial sum of
         the current block]. A block is `attn_res_block_size` sub-layers and its summary
         is the sum of their outputs. Memory grows with the number of blocks, not layers.
  mix    The plain residual, plus every `attn_res_block_size` sub-layers
         x ← x + attn_res_mix_coef · (x at the start of the block).

The model's final norm reads the same kind of mix over everything (its own pseudo-query)
in `full` and `block` mode. The state threaded through the layers is a small pytree of
[B, T, D] streams; these functions are pure, and `DepthMix` holds the one parameter.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from moe_jax.model.layers import lp

MODES = ("none", "block", "full", "mix")


class DepthMix(nn.Module):
  """softmax over sources of (w · RMSNorm(v)) times v, per token; w starts at zero."""
  cfg: object

  @nn.compact
  def __call__(self, sources):
    D = sources[0].shape[-1]
    w_D = self.param("query", lp(nn.initializers.zeros, ("embed",)), (D,), jnp.float32)
    v_SxBxTxD = jnp.stack(sources).astype(jnp.float32)
    k_SxBxTxD = v_SxBxTxD * jax.lax.rsqrt(
        jnp.mean(v_SxBxTxD * v_SxBxTxD, -1, keepdims=True) + self.cfg.norm_eps)
    a_SxBxT = jax.nn.softmax(jnp.einsum("sbtd,d->sbt", k_SxBxTxD, w_D), axis=0)
    # The weight per source, averaged over live and padded tokens alike, for inspection
    # (apply with mutable=["intermediates"]; notebooks/05_attention_residuals.ipynb).
    self.sow("intermediates", "depth_weights", a_SxBxT.mean((1, 2)))
    return jnp.einsum("sbt,sbtd->btd", a_SxBxT, v_SxBxTxD).astype(sources[0].dtype)


def init(cfg, emb_BxTxD):
  """The state before the first sub-layer."""
  mode = cfg.attn_res
  if mode == "block":
    return {"blocks": (emb_BxTxD,), "partial": None}
  if mode == "mix":
    return {"x": emb_BxTxD, "start": emb_BxTxD}
  return {"sources": (emb_BxTxD,)} if mode == "full" else {"x": emb_BxTxD}


def sources(cfg, state) -> tuple:
  """What the next sub-layer (or the final norm) mixes over; one stream = no mixing."""
  if cfg.attn_res == "block":
    partial = () if state["partial"] is None else (state["partial"],)
    return state["blocks"] + partial
  return state["sources"] if cfg.attn_res == "full" else (state["x"],)


def read(cfg, state, name: str):
  """The input of the next sub-layer: a DepthMix submodule named `name` in block/full mode
  (call inside a compact module)."""
  if cfg.attn_res in ("block", "full"):
    return DepthMix(cfg, name=name)(sources(cfg, state))
  return state["x"]


def write(cfg, state, y_BxTxD, sublayer: int):
  """The state after sub-layer number `sublayer` (0-based over the whole stack) wrote y."""
  mode, size = cfg.attn_res, cfg.attn_res_block_size
  ends_block = (sublayer + 1) % size == 0
  if mode == "none":
    return {"x": state["x"] + y_BxTxD}
  if mode == "full":
    return {"sources": state["sources"] + (y_BxTxD,)}
  if mode == "block":
    partial = y_BxTxD if state["partial"] is None else state["partial"] + y_BxTxD
    if ends_block:
      return {"blocks": state["blocks"] + (partial,), "partial": None}
    return {"blocks": state["blocks"], "partial": partial}
  x_BxTxD = state["x"] + y_BxTxD
  if ends_block:
    x_BxTxD = x_BxTxD + jnp.asarray(cfg.attn_res_mix_coef, x_BxTxD.dtype) * state["start"]
    return {"x": x_BxTxD, "start": x_BxTxD}
  return {"x": x_BxTxD, "start": state["start"]}
