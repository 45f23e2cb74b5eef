"""HybridMoE: embedding → layer stack from the pattern string → final norm → LM head."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from moe_jax.fields import is_moe
from moe_jax.model import attn_res, layer_stack, remat, vision
from moe_jax.model.kda import KDAMixer
from moe_jax.model.layers import SwiGLU, dtype_of, embed_lookup, lp, rms_norm
from moe_jax.model.mla import MLAMixer
from moe_jax.model.moe import MoE

MIXERS = {"K": KDAMixer, "A": MLAMixer}


def mixer_kind(cfg, layer: int) -> str:
  """The pattern string applies cyclically: "KKKA" over 8 layers is KKKAKKKA."""
  return cfg.layer_pattern[layer % len(cfg.layer_pattern)]


def make_ffn(cfg, layer: int) -> nn.Module:
  """FFN for `layer`: dense SwiGLU or MoE. Both return (y, routing stats or {})."""
  return MoE(cfg, name="ffn") if is_moe(cfg, layer) else DenseFFN(cfg, name="ffn")


class DenseFFN(nn.Module):
  cfg: object

  @nn.compact
  def __call__(self, x_BxTxD):
    return SwiGLU(self.cfg, self.cfg.ffn_hidden, name="mlp")(x_BxTxD), {}


class Block(nn.Module):
  """Pre-norm block: the mixer, then the FFN, each reading its input from the residual
  state and writing its output back (model/attn_res.py: a plain residual stream, or
  attention over depth).

  Returns (state, routing stats), and the mixer's new cache as a third item when given one.
  """
  cfg: object
  layer: int

  @nn.compact
  def __call__(self, res, segment_ids_BxT, cache=None):
    cfg = self.cfg
    kind = mixer_kind(cfg, self.layer)
    mixer = MIXERS[kind](cfg, name="mixer")
    h_BxTxD = rms_norm(cfg, "mixer_norm")(attn_res.read(cfg, res, "mixer_res"))
    # Named scopes tag every op (and its backward) for the per-phase profile
    # (benchmarks/bench_train.py).
    with jax.named_scope("kda" if kind == "K" else "mla"):
      if cache is None:
        y_BxTxD = mixer(h_BxTxD, segment_ids_BxT)
      else:
        y_BxTxD, cache = mixer(h_BxTxD, segment_ids_BxT, cache)
    res = attn_res.write(cfg, res, y_BxTxD, 2 * self.layer)
    h_BxTxD = rms_norm(cfg, "ffn_norm")(attn_res.read(cfg, res, "ffn_res"))
    with jax.named_scope("moe" if is_moe(cfg, self.layer) else "dense_ffn"):
      y_BxTxD, stats = make_ffn(cfg, self.layer)(h_BxTxD)
    res = attn_res.write(cfg, res, y_BxTxD, 2 * self.layer + 1)
    return (res, stats) if cache is None else (res, stats, cache)


def remat_block(cfg, scanned: bool):
  """Block, rematerialised per model.remat / remat_policy (model/remat.py). Inside a scan
  the loop already keeps XLA from merging the recomputation away (prevent_cse off)."""
  if not cfg.remat:
    return Block
  return nn.remat(Block, policy=remat.policy(cfg.remat_policy,
                                             cfg.get("remat_expert_rows", False)),
                  prevent_cse=not scanned)


class Period(nn.Module):
  """One period of the layer pattern: blocks start … start+P-1 (the body of nn.scan).
  Carries the residual state; returns each block's routing stats as the scan output."""
  cfg: object
  start: int

  @nn.compact
  def __call__(self, res, segment_ids_BxT):
    block = remat_block(self.cfg, scanned=True)
    stats = []
    for j in range(len(self.cfg.layer_pattern)):
      res, s = block(self.cfg, self.start + j, name=f"block_{j}")(res, segment_ids_BxT)
      stats.append(s)
    return res, tuple(stats)


def scanned_periods(cfg, plan, res, segment_ids_BxT):
  """The body of the stack as one nn.scan over plan.n periods; the routing stats come back
  per layer ("layer_l"), each a slice of the stacked scan output."""
  scan = nn.scan(Period, variable_axes={"params": 0, "router": 0, "intermediates": 0,
                                        "replay": 0},
                 split_rngs={"params": True}, in_axes=(nn.broadcast,), length=plan.n,
                 metadata_params={nn.PARTITION_NAME: "layers"},
                 # flax otherwise traces the body twice, the first time only to check that
                 # broadcast variables stay constant (there are none): 1 s of the 1B's trace.
                 check_constancy_invariants=False)
  res, stats = scan(cfg, plan.start, name=layer_stack.PERIODS)(res, segment_ids_BxT)
  routing = {}
  for i in range(plan.n):
    for j, s in enumerate(stats):
      if s:
        routing[f"layer_{plan.layer(i, j)}"] = jax.tree.map(lambda x, i=i: x[i], s)
  return res, routing


def image_fields(cfg, batch) -> dict:
  """The batch's image fields, zero where it has none (a text-only batch, a decode step):
  a multimodal model builds the same params from any batch."""
  B, T = batch["tokens"].shape
  zeros = lambda *s, dtype=jnp.int32: jnp.zeros((B, T) + s, dtype)
  return {"tokens": batch["tokens"],
          "patches": batch.get("patches", zeros(vision.patch_dim(cfg.vision), dtype=jnp.float32)),
          "patch_rows": batch.get("patch_rows", zeros()),
          "patch_cols": batch.get("patch_cols", zeros())}


class HybridMoE(nn.Module):
  """Decoder-only LM. `cfg` is the (frozen) model config. Returns (logits fp32, aux).

  aux["routing"] maps each MoE layer's name ("layer_3") to its routing stats
  (router.routing_stats); the balancer state of that layer is
  variables["router"][name]["ffn"].

  With `cache` (infer/cache.py) the tokens continue each row from its cached length
  (prefill chunks and decode steps; live tokens first in each row) and aux["cache"] is
  the updated cache. The cache path runs unscanned (infer.generate.inference_model).

  With cfg.vision.patch_size > 0 the batch may carry images (model/vision.py): PATCH
  positions are embedded from batch["patches"], and with vision.patch_loss_weight
  aux["patch_pred"] holds each position's prediction of the next patch.

  With cfg.scan_layers the layers that repeat are one nn.scan (model/layer_stack.py: which
  layers, and the "periods" parameter layout).
  """
  cfg: object

  @nn.compact
  def __call__(self, batch, cache=None):
    cfg = self.cfg
    tokens_BxT, segment_ids_BxT = batch["tokens"], batch["segment_ids"]
    embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype_of(cfg), param_dtype=jnp.float32,
                     embedding_init=lp(nn.initializers.normal(1.0), ("vocab", "embed")),
                     name="embed")
    x_BxTxD = embed_lookup(embed, tokens_BxT)
    if cfg.vision.patch_size:   # image patches in the stream (model/vision.py)
      x_BxTxD = vision.PatchEmbed(cfg, name="patch_embed")(x_BxTxD, image_fields(cfg, batch))
    res = attn_res.init(cfg, x_BxTxD)
    block = remat_block(cfg, scanned=False) if cache is None else Block
    plan = layer_stack.plan(cfg)
    if plan.n and cache is not None:
      raise ValueError("model.scan_layers: the cache path runs unscanned; build the model with "
                       "infer.generate.inference_model and layer_stack.unstack its variables")
    routing, new_layers = {}, {}
    for i in range(cfg.n_layers):
      if plan.start <= i < plan.end:
        if i == plan.start:
          res, scanned = scanned_periods(cfg, plan, res, segment_ids_BxT)
          routing.update(scanned)
        continue
      name = f"layer_{i}"
      layer = block(cfg, i, name=name)
      if cache is None:
        res, stats = layer(res, segment_ids_BxT)
      else:
        layer_cache = {**cache["layers"][name], "length": cache["length"]}
        res, stats, new_layers[name] = layer(res, segment_ids_BxT, layer_cache)
      if stats:
        routing[name] = stats
    x_BxTxD = rms_norm(cfg, "final_norm")(attn_res.read(cfg, res, "final_res"))
    if cfg.tie_embeddings:
      logits_BxTxV = embed.attend(x_BxTxD) / jnp.sqrt(cfg.d_model).astype(x_BxTxD.dtype)
    else:
      head = nn.DenseGeneral(cfg.vocab_size, use_bias=False, dtype=dtype_of(cfg),
                             param_dtype=jnp.float32, name="lm_head",
                             kernel_init=lp(nn.initializers.variance_scaling(
                                 1.0, "fan_in", "truncated_normal"), ("embed", "vocab")))
      logits_BxTxV = head(x_BxTxD)
    aux = {"routing": routing}
    if cfg.vision.patch_loss_weight and cache is None:
      aux["patch_pred"] = vision.patch_head(cfg, x_BxTxD)
    if cache is not None:
      aux["cache"] = {"length": cache["length"] + (segment_ids_BxT != 0).sum(-1),
                      "layers": new_layers}
    return logits_BxTxV.astype(jnp.float32), aux
