"""Rotary position embedding (RoPE, Su et al. 2021) for MLA's shared key dims: the control
that asks whether NoPE's extrapolation is NoPE's (configs/stages.py:h200, run `rope`).

Standard RoPE, no scaling: dims i and i + D/2 of a vector at position p turn by the angle
p · θ^(−2i/D), so a query at m and a key at n score by their offset m − n alone. Positions
count from each packed document's first token, as the data's `positions` do."""

import jax
import jax.numpy as jnp


def document_positions(segment_ids_BxT: jax.Array) -> jax.Array:
  """Each token's index in its document (the run of one segment id it is in), [B, T]."""
  B, T = segment_ids_BxT.shape
  t_T = jnp.arange(T, dtype=jnp.int32)
  starts_BxT = jnp.concatenate([jnp.ones((B, 1), bool),
                                segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1]], 1)
  first_BxT = jax.lax.cummax(jnp.where(starts_BxT, t_T, 0), axis=1)
  return t_T - first_BxT


def rotate(x_BxTx_xD: jax.Array, positions_BxT: jax.Array, theta: float) -> jax.Array:
  """x [B, T, ..., D] (D even) turned by RoPE at `positions`; angles in float32, the
  result in x's dtype."""
  D = x_BxTx_xD.shape[-1]
  inv_freq_H = theta ** (-jnp.arange(0, D, 2, dtype=jnp.float32) / D)   # [D/2]
  angle_BxTxH = positions_BxT.astype(jnp.float32)[..., None] * inv_freq_H
  angle = angle_BxTxH.reshape(*angle_BxTxH.shape[:2], *(1,) * (x_BxTx_xD.ndim - 3), D // 2)
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  x = x_BxTx_xD.astype(jnp.float32)
  x1, x2 = x[..., :D // 2], x[..., D // 2:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_BxTx_xD.dtype)
