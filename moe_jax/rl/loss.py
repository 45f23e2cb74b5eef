"""The GRPO objective: PPO's clipped surrogate with the importance ratio against the rollout
policy, plus a k3 KL penalty to a frozen reference, on the trained tokens only.

Per trained token t of completion i (mask m = 1; prompt, padding and tool output have m = 0):

  ρ = exp(logp − logp_rollout)
  pg = −min(ρ·A_i, clip(ρ, 1 − ε_low, 1 + ε_high)·A_i)
  kl = exp(logp_ref − logp) − (logp_ref − logp) − 1          (k3, Schulman; ≥ 0)
  ℓ = pg + β·kl

Reported, not optimised: kl_rollout, the k3 KL from the rollout policy, exp(logp_rollout −
logp) − (logp_rollout − logp) − 1. On a rollout batch's first pass the params are the
rollout's, so it measures how far the training forward's policy is from the one that
sampled (routing, numerics): what routing replay exists to shrink.

Normalisation (rl.loss_norm):
  token     Σ ℓ·m / Σ m over the batch (every token weighs the same; DAPO)
  sequence  mean over completions of Σ_t ℓ·m / Σ_t m (GRPO as published)
  constant  Σ ℓ·m / (completions · max_tokens) (Dr. GRPO: no length bias)
"""

import jax
import jax.numpy as jnp

NORMS = ("token", "sequence", "constant")


def token_logprobs(logits_BxTxV, targets_BxT, temperature: float):
  """log softmax(logits / temperature) at each target, fp32 (the sampled policy's)."""
  return token_logprobs_and_entropy(logits_BxTxV, targets_BxT, temperature)[0]


def token_logprobs_and_entropy(logits_BxTxV, targets_BxT, temperature: float):
  """(token_logprobs, the sampled policy's entropy at each position in nats), from one
  log-softmax. The entropy is reported, not optimised (its gradient is stopped): whether
  updates sharpen the policy (greedy gains) or flatten it (greedy losses)."""
  logp_BxTxV = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32) / temperature, axis=-1)
  ent_BxT = jax.lax.stop_gradient(-(jnp.exp(logp_BxTxV) * logp_BxTxV).sum(-1))
  return jnp.take_along_axis(logp_BxTxV, targets_BxT[..., None], -1)[..., 0], ent_BxT


def denominators(mask_BxT) -> dict:
  """What each normalisation divides by, over a whole rollout batch: trained tokens,
  completions with a trained token, rows. A micro-batch's `grpo_loss` given the batch's
  denominators returns its share: the shares sum to the whole batch's loss and metrics."""
  mask_BxT = mask_BxT.astype(jnp.float32)
  return {"tokens": jnp.maximum(mask_BxT.sum(), 1.0),
          "sequences": jnp.maximum((mask_BxT.sum(1) > 0).sum().astype(jnp.float32), 1.0),
          "rows": jnp.float32(mask_BxT.shape[0])}


def grpo_loss(logp_BxT, old_logp_BxT, adv_B, mask_BxT, *, ref_logp_BxT=None,
              clip_low: float = 0.2, clip_high: float = 0.2, kl_coef: float = 0.0,
              norm: str = "token", max_tokens: int | None = None, denom: dict | None = None):
  """(scalar loss, metrics {"clip_fraction", "kl", "kl_rollout", "ratio"}: means over
  trained tokens). `denom` (`denominators` of the whole batch) when this is one micro-batch
  of it; default: this batch's own."""
  if norm not in NORMS:
    raise ValueError(f"rl.loss_norm must be one of {NORMS}, got {norm!r}")
  denom = denominators(mask_BxT) if denom is None else denom
  mask_BxT = mask_BxT.astype(jnp.float32)
  adv_Bx1 = adv_B[:, None].astype(jnp.float32)
  ratio_BxT = jnp.exp(logp_BxT - old_logp_BxT)
  clipped_BxT = jnp.clip(ratio_BxT, 1.0 - clip_low, 1.0 + clip_high)
  loss_BxT = -jnp.minimum(ratio_BxT * adv_Bx1, clipped_BxT * adv_Bx1)
  kl_BxT = jnp.zeros_like(loss_BxT)
  if ref_logp_BxT is not None and kl_coef:
    kl_BxT = _k3(ref_logp_BxT - logp_BxT)
    loss_BxT = loss_BxT + kl_coef * kl_BxT
  n = denom["tokens"]
  if norm == "token":
    loss = (loss_BxT * mask_BxT).sum() / n
  elif norm == "sequence":   # rows without a trained token add 0
    per_seq_B = (loss_BxT * mask_BxT).sum(1) / jnp.maximum(mask_BxT.sum(1), 1.0)
    loss = per_seq_B.sum() / denom["sequences"]
  else:
    loss = (loss_BxT * mask_BxT).sum() / (denom["rows"] * (max_tokens or mask_BxT.shape[1]))
  # A token is clipped where the clip, not the ratio, set its surrogate (no gradient flows).
  was_clipped_BxT = ((ratio_BxT < 1.0 - clip_low) & (adv_Bx1 < 0)) | (
      (ratio_BxT > 1.0 + clip_high) & (adv_Bx1 > 0))
  metrics = {"clip_fraction": (was_clipped_BxT * mask_BxT).sum() / n,
             "kl": (kl_BxT * mask_BxT).sum() / n,
             "kl_rollout": (_k3(old_logp_BxT - logp_BxT) * mask_BxT).sum() / n,
             "ratio": (ratio_BxT * mask_BxT).sum() / n}
  return loss, metrics


def _k3(d_BxT):
  """Schulman's k3 estimator of KL(π‖π_other) from d = logp_other − logp: unbiased, ≥ 0.
  As expm1(d) − d: exp(d) − d − 1 in float32 cancels to a few 1e-9 below 0 when the two
  policies agree (|d| ~ 1e-5, as between the rollout and the first training pass)."""
  return jnp.maximum(jnp.expm1(d_BxT) - d_BxT, 0.0)
