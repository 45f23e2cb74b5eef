"""Jitted train and eval steps (masked next-token cross-entropy in fp32 + router penalties)."""

import functools

import jax
import jax.numpy as jnp
import optax

from moe_jax.model import layer_stack, router as router_lib
from moe_jax.train import optim


def _nll(params, router_vars, apply_fn, batch):
  logits_BxTxV, aux = apply_fn({"params": params, "router": router_vars}, batch)
  with jax.named_scope("loss"):
    nll_BxT = optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, batch["targets"])
  return nll_BxT * batch["loss_mask"], logits_BxTxV, aux


def loss_fn(params, router_vars, apply_fn, batch):
  """(mean NLL + Σ router penalties, (mean NLL, aux))."""
  nll_BxT, _, aux = _nll(params, router_vars, apply_fn, batch)
  nll = nll_BxT.sum() / jnp.maximum(batch["loss_mask"].sum(), 1.0)
  penalty = sum((s["penalty"] for s in aux["routing"].values()), jnp.float32(0.0))
  return nll + penalty, (nll, aux)


def routing_metrics(routing: dict) -> dict:
  """Per MoE layer: load per expert (a vector), MaxVio, dropped share, entropy, bias range."""
  out = {}
  for layer, s in routing.items():
    for k in ("load", "max_vio", "dropped_fraction", "entropy", "bias_min", "bias_max",
              "aux_loss"):
      out[f"moe/{layer}/{k}"] = s[k]
  if routing:
    out["moe/max_vio_mean"] = jnp.mean(jnp.stack([s["max_vio"] for s in routing.values()]))
  return out


def train_step(state, batch, *, config):
  """One update. A non-finite gradient leaves params, optimizer moments and router unchanged."""
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  (total, (nll, aux)), grads = grad_fn(state.params, state.router, state.apply_fn, batch)
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
      "penalty": total - nll,
      "grad_norm": grad_norm,
      **optim.routing_grad_norm(config, grads),
      "learning_rate": optim.learning_rate(config, state.step),
      "skipped_updates": optim.skipped_updates(new_state.opt_state),
      **routing_metrics(aux["routing"]),
  }
  return new_state, metrics


def eval_step(params, router_vars, batch, *, apply_fn):
  """Sums over the batch: NLL (nats), predicted tokens, predicted bytes, correct predictions."""
  nll_BxT, logits_BxTxV, _ = _nll(params, router_vars, apply_fn, batch)
  mask_BxT = batch["loss_mask"]
  correct_BxT = (jnp.argmax(logits_BxTxV, -1) == batch["targets"]) * mask_BxT
  return {
      "nll_sum": nll_BxT.sum(),
      "tokens": mask_BxT.sum(),
      "bytes": (mask_BxT * (batch["targets"] < 256)).sum(),
      "correct": correct_BxT.sum(),
  }


def jit_train_step(config, state_shardings, batch_sharding):
  return jax.jit(functools.partial(train_step, config=config),
                 in_shardings=(state_shardings, batch_sharding),
                 out_shardings=(state_shardings, None), donate_argnums=0)


def jit_eval_step(apply_fn, state_shardings, batch_sharding):
  return jax.jit(functools.partial(eval_step, apply_fn=apply_fn),
                 in_shardings=(state_shardings.params, state_shardings.router, batch_sharding))


def summarize_eval(sums) -> dict[str, float]:
  """Validation loss per token, bits per byte (total bits / text bytes), accuracy."""
  nll, tokens = float(sums["nll_sum"]), max(float(sums["tokens"]), 1.0)
  return {
      "loss": nll / tokens,
      "bits_per_byte": nll / jnp.log(2.0).item() / max(float(sums["bytes"]), 1.0),
      "accuracy": float(sums["correct"]) / tokens,
  }
