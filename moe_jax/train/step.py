"""Jitted train and eval steps (masked next-token cross-entropy in fp32)."""

import functools

import jax
import jax.numpy as jnp
import optax

from moe_jax.train import optim


def _nll(params, apply_fn, batch):
  logits_BxTxV, aux = apply_fn({"params": params}, batch)
  nll_BxT = optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, batch["targets"])
  return nll_BxT * batch["loss_mask"], logits_BxTxV, aux


def loss_fn(params, apply_fn, batch):
  nll_BxT, _, aux = _nll(params, apply_fn, batch)
  return nll_BxT.sum() / jnp.maximum(batch["loss_mask"].sum(), 1.0), aux


def train_step(state, batch, *, config):
  """One update. A non-finite gradient leaves params and optimizer moments unchanged."""
  (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, state.apply_fn, batch)
  new_state = state.apply_gradients(grads=grads)
  metrics = {
      "loss": loss,
      "grad_norm": optax.tree.norm(grads),
      "learning_rate": optim.learning_rate(config, state.step),
      "skipped_updates": optim.skipped_updates(new_state.opt_state),
  }
  return new_state, metrics


def eval_step(params, batch, *, apply_fn):
  """Sums over the batch: NLL (nats), predicted tokens, predicted bytes, correct predictions."""
  nll_BxT, logits_BxTxV, _ = _nll(params, apply_fn, batch)
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


def jit_eval_step(apply_fn, params_shardings, batch_sharding):
  return jax.jit(functools.partial(eval_step, apply_fn=apply_fn),
                 in_shardings=(params_shardings, batch_sharding))


def summarize_eval(sums) -> dict[str, float]:
  """Validation loss per token, bits per byte (total bits / text bytes), accuracy."""
  nll, tokens = float(sums["nll_sum"]), max(float(sums["tokens"]), 1.0)
  return {
      "loss": nll / tokens,
      "bits_per_byte": nll / jnp.log(2.0).item() / max(float(sums["bytes"]), 1.0),
      "accuracy": float(sums["correct"]) / tokens,
  }


