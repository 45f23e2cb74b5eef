"""Next-token sampling from logits [B, V]: greedy, temperature, top-k, top-p (nucleus)."""

import jax
import jax.numpy as jnp


def filter_logits(logits_BxV, *, top_k: int = 0, top_p: float = 1.0):
  """Logits with everything outside the top-k and outside the top-p mass set to -inf."""
  logits_BxV = logits_BxV.astype(jnp.float32)
  if top_k:
    kth_Bx1 = jax.lax.top_k(logits_BxV, top_k)[0][:, -1:]
    logits_BxV = jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)
  if top_p < 1.0:
    sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
    probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before
    # it is still below top_p.
    before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
    n_keep_B = jnp.maximum((before_BxV < top_p).sum(-1), 1)
    cutoff_Bx1 = jnp.take_along_axis(sorted_BxV, n_keep_B[:, None] - 1, axis=-1)
    logits_BxV = jnp.where(logits_BxV < cutoff_Bx1, -jnp.inf, logits_BxV)
  return logits_BxV


def sample(logits_BxV, key, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
  """Token ids [B]. temperature 0 = greedy (argmax); otherwise categorical after filtering."""
  if temperature == 0.0:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  filtered = filter_logits(logits_BxV / temperature, top_k=top_k, top_p=top_p)
  return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)


def validate(temperature: float, top_k: int, top_p: float):
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
  if top_k < 0:
    raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k!r}")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")
