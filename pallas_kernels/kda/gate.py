"""KDA forget gate: bounded `lower_bound·sigmoid(exp(A_log)·(x + dt_bias))` or legacy unbounded."""

import jax
import jax.numpy as jnp


def check_lower_bound(lower_bound):
  if lower_bound is not None and not -5.0 <= float(lower_bound) < 0.0:
    raise ValueError(f"lower_bound must be in [-5, 0) or None (legacy gate), got {lower_bound}")


def kda_gate(x_BxTxHxK, A_log_H, dt_bias_HK, lower_bound: float | None = -5.0):
  """Per-channel log-decay g ≤ 0, float32 (float64 for float64 inputs), shape [B,T,H,K].

  Bounded (default): g ∈ [lower_bound, 0), so a 16-token sub-chunk decays by at
  most e^(16·lower_bound) ≥ e^-80 and its reciprocal stays finite in fp32.
  lower_bound=None: legacy `-exp(A_log)·softplus(x + dt_bias)`, unbounded below.
  """
  check_lower_bound(lower_bound)
  if x_BxTxHxK.ndim != 4:
    raise ValueError(f"x must be [B,T,H,K], got shape {x_BxTxHxK.shape}")
  _, _, H, K = x_BxTxHxK.shape
  if A_log_H.shape != (H,):
    raise ValueError(f"A_log must have shape [H]=({H},), got {A_log_H.shape}")
  if dt_bias_HK.shape != (H * K,):
    raise ValueError(f"dt_bias must have shape [H*K]=({H * K},), got {dt_bias_HK.shape}")
  dt = jnp.result_type(jnp.float32, x_BxTxHxK.dtype, A_log_H.dtype, dt_bias_HK.dtype)
  x = x_BxTxHxK.astype(dt) + dt_bias_HK.astype(dt).reshape(H, K)
  a_H1 = jnp.exp(A_log_H.astype(dt))[:, None]
  if lower_bound is None:
    return -a_H1 * jax.nn.softplus(x)
  return lower_bound * jax.nn.sigmoid(a_H1 * x)
