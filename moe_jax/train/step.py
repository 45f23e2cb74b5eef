"""Jitted train and eval steps (masked next-token cross-entropy in fp32 + router penalties)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from moe_jax.data import tokenizer
from moe_jax.fields import is_moe
from moe_jax.model import layer_stack, moe, router as router_lib, vision
from moe_jax.train import optim


def _nll(params, router_vars, apply_fn, batch, mutable=()):
  variables = {"params": params, "router": router_vars}
  if mutable:
    (logits_BxTxV, aux), aux["variables"] = apply_fn(variables, batch, mutable=mutable)
  else:
    logits_BxTxV, aux = apply_fn(variables, batch)
  with jax.named_scope("loss"):
    nll_BxT = optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, batch["targets"])
  return nll_BxT * batch["loss_mask"], logits_BxTxV, aux


def loss_fn(params, router_vars, apply_fn, batch, patch_loss_weight=0.0):
  """(mean NLL + Σ router penalties + weighted next-patch MSE, (mean NLL, aux)); with the
  patch loss on, aux["patch_loss"] is its unweighted value."""
  nll_BxT, _, aux = _nll(params, router_vars, apply_fn, batch)
  nll = nll_BxT.sum() / jnp.maximum(batch["loss_mask"].sum(), 1.0)
  total = nll + sum((s["penalty"] for s in aux["routing"].values()), jnp.float32(0.0))
  if "patch_pred" in aux:
    aux["patch_loss"] = vision.next_patch_loss(aux.pop("patch_pred"), batch)
    total = total + patch_loss_weight * aux["patch_loss"]
  return total, (nll, aux)


def routing_metrics(routing: dict) -> dict:
  """Per MoE layer: load per expert (a vector), MaxVio, dropped share, entropy, bias range;
  with expert parallelism its rounds and buffer fill, and both for the worst layer."""
  out = {}
  for layer, s in routing.items():
    for k in ("load", "max_vio", "dropped_fraction", "entropy", "bias_min", "bias_max",
              "aux_loss"):
      out[f"moe/{layer}/{k}"] = s[k]
    for k in ("ep_rounds", "ep_buffer_fill"):   # expert parallelism (parallel/expert.py)
      if k in s:
        out[f"moe/{layer}/{k}"] = s[k]
  if routing:
    out["moe/max_vio_mean"] = jnp.mean(jnp.stack([s["max_vio"] for s in routing.values()]))
  for k in ("ep_rounds", "ep_buffer_fill"):     # the worst layer's
    if any(k in s for s in routing.values()):
      out[f"moe/{k}"] = jnp.max(jnp.stack([s[k] for s in routing.values() if k in s]))
  return out


def grad_step(state, batch, *, config):
  """The step's first half: (gradients, the loss terms and router statistics the update
  reads)."""
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  w = config.model.vision.patch_loss_weight
  (total, (nll, aux)), grads = grad_fn(state.params, state.router, state.apply_fn, batch, w)
  return grads, {"total": total, "nll": nll, "aux": aux}


def update_step(state, grads, out, *, config):
  """The step's second half: the router balancers and the optimizer. A non-finite gradient
  leaves params, optimizer moments and router unchanged."""
  aux, nll = out["aux"], out["nll"]
  w = config.model.vision.patch_loss_weight
  grad_norm = optax.tree.norm(grads)
  # The balancers read the router state per layer; with scanned layers it is stacked.
  router = layer_stack.stack(config.model, router_lib.update_all(
      config.model.moe, layer_stack.unstack(config.model, state.router), aux["routing"],
      state.step))
  router = jax.tree.map(lambda new, old: jnp.where(jnp.isfinite(grad_norm), new, old),
                        router, state.router)
  with jax.named_scope("optimizer"):
    new_state = state.apply_gradients(grads=grads).replace(router=router)
  metrics = {
      "loss": nll,
      "penalty": out["total"] - nll - w * aux.get("patch_loss", 0.0),
      **({"patch_loss": aux["patch_loss"]} if "patch_loss" in aux else {}),
      "grad_norm": grad_norm,
      **optim.routing_grad_norm(config, grads),
      "learning_rate": optim.learning_rate(config, state.step),
      "skipped_updates": optim.skipped_updates(new_state.opt_state),
      **routing_metrics(aux["routing"]),
  }
  return new_state, metrics


def train_step(state, batch, *, config):
  """One update: grad_step then update_step, traced as one program."""
  return update_step(state, *grad_step(state, batch, config=config), config=config)


def jit_train_step(config, state_shardings, batch_sharding):
  """The train step as one jitted program (train.split_step=False's; AOT and tests)."""
  return jax.jit(functools.partial(train_step, config=config),
                 in_shardings=(state_shardings, batch_sharding),
                 out_shardings=(state_shardings, None), donate_argnums=0)


def jit_step_halves(config, state_shardings, batch_sharding):
  """(grad_step, update_step) jitted as two programs (train.split_step): XLA optimises a
  module on one thread, so the two compile side by side in less time than the one program
  (long_context_1b on the H200: 28.5 s against 36.5; benchmarks/train.md). The update
  donates the state (the gradients have no output of their shape left to alias)."""
  grads = jax.jit(functools.partial(grad_step, config=config),
                  in_shardings=(state_shardings, batch_sharding),
                  out_shardings=(state_shardings.params, None))
  update = jax.jit(functools.partial(update_step, config=config),
                   in_shardings=(state_shardings, state_shardings.params, None),
                   out_shardings=(state_shardings, None), donate_argnums=0)
  return grads, update


class SplitStep:
  """A train step made of the two compiled halves, called as the one-program step is."""

  def __init__(self, grads, update):
    self.grads, self.update = grads, update

  def __call__(self, state, batch):
    return self.update(state, *self.grads(state, batch))

  def hlo_texts(self) -> list[str]:
    """Each program's compiled HLO, the gradient half first."""
    return [self.grads.as_text(), self.update.as_text()]


def eval_step(params, router_vars, batch, *, apply_fn, model_cfg=None):
  """Sums over the batch: NLL (nats), predicted tokens, predicted bytes, correct predictions.

  For a multimodal MoE model (model_cfg given, batch with patches) also each MoE layer's
  assignments per expert on image patches and on text (every other live position), from
  the top-k ids the layers sow."""
  by_modality = (model_cfg is not None and is_moe(model_cfg)
                 and "patches" in batch)
  nll_BxT, logits_BxTxV, aux = _nll(params, router_vars, apply_fn, batch,
                                    ("intermediates",) if by_modality else ())
  mask_BxT = batch["loss_mask"]
  correct_BxT = (jnp.argmax(logits_BxTxV, -1) == batch["targets"]) * mask_BxT
  out = {
      "nll_sum": nll_BxT.sum(),
      "tokens": mask_BxT.sum(),
      # Text bytes the labels cover: a learned tokenizer's rows say (target_bytes), a
      # byte-level row's labels below 256 are one byte each.
      "bytes": (mask_BxT * (batch["target_bytes"] if "target_bytes" in batch
                            else batch["targets"] < 256)).sum(),
      "correct": correct_BxT.sum(),
  }
  if by_modality:
    out.update(modality_counts(model_cfg, aux["variables"]["intermediates"], batch))
  return out


def modality_counts(model_cfg, intermediates, batch) -> dict:
  """{"moe/<layer>/image_count" | "text_count": assignments per expert [E]}."""
  E = model_cfg.moe.num_experts
  image_BxT = batch["tokens"] == tokenizer.PATCH
  text_BxT = (batch["segment_ids"] > 0) & ~image_BxT
  out = {}
  for layer, ids_BxTxK in moe.sown_routes(model_cfg, intermediates,
                                          batch["tokens"].shape).items():
    for name, m_BxT in (("image", image_BxT), ("text", text_BxT)):
      weight_BxTxK = jnp.broadcast_to(m_BxT[..., None], ids_BxTxK.shape).astype(jnp.float32)
      out[f"moe/{layer}/{name}_count"] = jax.ops.segment_sum(
          weight_BxTxK.reshape(-1), ids_BxTxK.reshape(-1), num_segments=E)
  return out


def jit_eval_step(apply_fn, state_shardings, batch_sharding, model_cfg=None):
  return jax.jit(functools.partial(eval_step, apply_fn=apply_fn, model_cfg=model_cfg),
                 in_shardings=(state_shardings.params, state_shardings.router, batch_sharding))


def summarize_eval(sums) -> dict:
  """Validation loss per token, bits per byte (total bits / text bytes), accuracy; with
  per-modality counts, each MoE layer's load per expert on image and on text tokens
  ("moe/<layer>/load_image", a share summing to 1) and the total-variation distance between
  the two ("moe/<layer>/modality_tv": 0 = the same experts, 1 = disjoint)."""
  nll, tokens = float(sums["nll_sum"]), max(float(sums["tokens"]), 1.0)
  out = {
      "loss": nll / tokens,
      "bits_per_byte": nll / jnp.log(2.0).item() / max(float(sums["bytes"]), 1.0),
      "accuracy": float(sums["correct"]) / tokens,
  }
  for key in sums:
    if key.endswith("/image_count"):
      layer = key[:-len("/image_count")]
      load = {m: np.asarray(sums[f"{layer}/{m}_count"], np.float64) for m in ("image", "text")}
      load = {m: x / max(x.sum(), 1.0) for m, x in load.items()}
      out[f"{layer}/load_image"], out[f"{layer}/load_text"] = load["image"], load["text"]
      if load["image"].sum() and load["text"].sum():
        out[f"{layer}/modality_tv"] = 0.5 * float(np.abs(load["image"] - load["text"]).sum())
  return out
