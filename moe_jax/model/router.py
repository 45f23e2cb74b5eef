"""Top-k routing, routing statistics, and the balancers (pure state transforms).

Selection uses `score + bias`; the combine weights use the unbiased scores of the
chosen experts, renormalised over the k and times `route_scale`. The bias lives
in the `router` variable collection (not a parameter: no gradient reaches it);
a balancer moves it between steps:

  state = update(moe_cfg, state, stats, step)      # inside the jitted train step

`stats` is what `routing_stats` returned for the batch (global over all shards,
since it is computed under jit on sharded arrays).
"""

import jax
import jax.numpy as jnp

from moe_jax.fields import ROUTER_DTYPES

BIAS_BALANCERS = ("loss_free", "quantile_ema", "quantile_exact")


def logits(z_NxW, kernel_WxE, router_dtype: str):
  """Router logits [N,E] in fp32. "float32": an fp32 product (TF32 on a GPU's tensor cores).
  "bfloat16": bf16 operands, fp32 accumulation, and a backward of bf16 products too; on a
  GPU every one of the three is then a plain cuBLAS bf16 GEMM, where the fp32 form needs
  the [N,W] activations converted to fp32 on each side (benchmarks/train.md). The bf16
  activations are exact either way; the kernel rounds to 8 mantissa bits instead of TF32's
  10. ("" is resolved to the model's dtype by the caller.)"""
  if router_dtype not in ROUTER_DTYPES[1:]:
    raise ValueError(f"model.moe.router_dtype must be one of {ROUTER_DTYPES[1:]}, "
                     f"got {router_dtype!r}")
  if router_dtype == "bfloat16":
    return _bf16_logits(z_NxW, kernel_WxE)
  return jnp.dot(z_NxW.astype(jnp.float32), kernel_WxE)


@jax.custom_vjp
def _bf16_logits(z_NxW, kernel_WxE):
  return _bf16_logits_fwd(z_NxW, kernel_WxE)[0]


def _bf16_logits_fwd(z_NxW, kernel_WxE):
  z16_NxW, k16_WxE = z_NxW.astype(jnp.bfloat16), kernel_WxE.astype(jnp.bfloat16)
  out_NxE = jnp.dot(z16_NxW, k16_WxE, preferred_element_type=jnp.float32)
  # The dtypes ride along as zero-size arrays (residuals must be arrays).
  return out_NxE, (z16_NxW, k16_WxE, jnp.zeros((0,), z_NxW.dtype),
                   jnp.zeros((0,), kernel_WxE.dtype))


def _bf16_logits_bwd(res, g_NxE):
  z16_NxW, k16_WxE, z_tag, k_tag = res
  g16_NxE = g_NxE.astype(jnp.bfloat16)
  dz_NxW = jnp.dot(g16_NxE, k16_WxE.T, preferred_element_type=jnp.float32)
  dk_WxE = jnp.dot(z16_NxW.T, g16_NxE, preferred_element_type=jnp.float32)
  return dz_NxW.astype(z_tag.dtype), dk_WxE.astype(k_tag.dtype)


_bf16_logits.defvjp(_bf16_logits_fwd, _bf16_logits_bwd)


def scores_from_logits(logits_NxE, score: str):
  """Router scores in fp32: independent sigmoids (DeepSeek-V3 / Kimi) or a softmax."""
  logits_NxE = logits_NxE.astype(jnp.float32)
  return jax.nn.sigmoid(logits_NxE) if score == "sigmoid" else jax.nn.softmax(logits_NxE, -1)


def select(logits_NxE, bias_E, top_k: int, score: str, route_scale: float):
  """(expert ids [N,k], combine weights [N,k]): the bias moves selection, never the weights."""
  scores_NxE = scores_from_logits(logits_NxE, score)
  _, idx_NxK = jax.lax.top_k(scores_NxE + jax.lax.stop_gradient(bias_E), top_k)
  return idx_NxK, combine_weights(logits_NxE, idx_NxK, score, route_scale)


def combine_weights(logits_NxE, idx_NxK, score: str, route_scale: float):
  """The chosen experts' scores renormalised over the k, times route_scale, as a softmax of
  their log-scores (log σ(l) for sigmoid scores; l for softmax scores, whose normaliser
  cancels). The same function as s_k / Σ s_j, but finite in value and gradient for any
  logits: when a drifting router's logits reach ≈ −55, every chosen sigmoid score is
  ~1e-24, and the term s / (Σ s)² of the plain quotient's gradient divides by an underflowed
  square (NaN; benchmarks/moe_stability.md)."""
  chosen_NxK = jnp.take_along_axis(logits_NxE.astype(jnp.float32), idx_NxK, axis=-1)
  log_s_NxK = jax.nn.log_sigmoid(chosen_NxK) if score == "sigmoid" else chosen_NxK
  return jax.nn.softmax(log_s_NxK, axis=-1) * route_scale


def load_fraction(idx_NxK, num_experts: int):
  """Share of the N·k assignments each expert received (sums to 1)."""
  counts_E = jnp.bincount(idx_NxK.reshape(-1), length=num_experts)
  return counts_E.astype(jnp.float32) / idx_NxK.size


def max_violation(load_E):
  """MaxVio = max_i load_i / mean load − 1 (0 when perfectly balanced)."""
  return load_E.max() / load_E.mean() - 1.0


def quantile_target_bias(scores_NxE, bias_E, top_k: int):
  """The bias that, on this batch, gives every expert ≈ k·N/E tokens (each expert solved alone).

  With z = score + bias, expert e wins token n iff z_ne beats the best competitor
  for n's k-th place: the (k+1)-th largest z_n if e is in n's top k, else the
  k-th. The margin m_ne = z_ne − competitor is > 0 exactly for e's tokens, so
  shifting b_e by −(the (k·N/E)-th largest margin of e) leaves e exactly k·N/E
  tokens. The shifts are centred (top-k ignores a common shift).
  """
  N, E = scores_NxE.shape
  z_NxE = jax.lax.stop_gradient(scores_NxE) + bias_E
  top_NxK1, idx_NxK1 = jax.lax.top_k(z_NxE, top_k + 1)
  chosen_NxE = jnp.zeros((N, E), bool).at[jnp.arange(N)[:, None], idx_NxK1[:, :top_k]].set(True)
  competitor_NxE = jnp.where(chosen_NxE, top_NxK1[:, top_k:], top_NxK1[:, top_k - 1:top_k])
  m = max(1, round(top_k * N / E))
  tau_E = jax.lax.top_k((z_NxE - competitor_NxE).T, m)[0][:, -1]
  shift_E = -(tau_E - tau_E.mean())
  return bias_E + shift_E


def routing_stats(moe_cfg, logits_NxE, scores_NxE, idx_NxK, bias_E, dropped_fraction):
  """Per-layer scalars and vectors for balancers, losses and logs (all fp32)."""
  E = scores_NxE.shape[-1]
  load_E = load_fraction(idx_NxK, E)
  probs_NxE = scores_NxE / scores_NxE.sum(-1, keepdims=True)
  stats = {
      "load": load_E,
      "max_vio": max_violation(load_E),
      "dropped_fraction": jnp.asarray(dropped_fraction, jnp.float32),
      "entropy": -(probs_NxE * jnp.log(probs_NxE + 1e-20)).sum(-1).mean(),
      "bias_min": bias_E.min(),
      "bias_max": bias_E.max(),
      # Switch Transformer load-balancing loss: E · Σ_i f_i · P_i (1 when uniform).
      "aux_loss": E * jnp.sum(jax.lax.stop_gradient(load_E) * probs_NxE.mean(0)),
      "z_loss": jnp.mean(jax.nn.logsumexp(logits_NxE.astype(jnp.float32), -1) ** 2),
  }
  if moe_cfg.balancer == "quantile_exact":
    stats["target_bias"] = quantile_target_bias(scores_NxE, bias_E, moe_cfg.top_k)
  return stats


def init_state(moe_cfg, num_experts: int) -> dict:
  """The balancer state of one MoE layer: the bias, plus an EMA for quantile_ema."""
  state = {"bias": jnp.zeros((num_experts,), jnp.float32)}
  if moe_cfg.balancer == "quantile_ema":
    state["ema_load"] = jnp.zeros((num_experts,), jnp.float32)
  return state


def update(moe_cfg, state: dict, stats: dict, step) -> dict:
  """One balancer step for one layer: a pure function of (state, batch stats, step)."""
  kind, clamp = moe_cfg.balancer, moe_cfg.bias_clamp
  bias_E, load_E = state["bias"], jax.lax.stop_gradient(stats["load"])
  new = dict(state)
  if kind == "loss_free":
    bias_E = bias_E + moe_cfg.bias_rate * jnp.sign(load_E.mean() - load_E)
  elif kind == "quantile_ema":
    decay = 1.0 - 1.0 / moe_cfg.ema_window
    ema_E = decay * state["ema_load"] + (1.0 - decay) * load_E
    new["ema_load"] = ema_E
    ema_E = ema_E / (1.0 - decay ** (jnp.asarray(step, jnp.float32) + 1.0))  # de-biased
    hi, lo = jnp.quantile(ema_E, 0.75), jnp.quantile(ema_E, 0.25)
    # Experts outside the interquartile band move towards the mean load, by at most `step`,
    # in proportion to their relative excess (a pure ±step never settles: see the docs).
    excess_E = jnp.clip(ema_E / ema_E.mean() - 1.0, -1.0, 1.0)
    outside_E = ((ema_E > hi) | (ema_E < lo)).astype(jnp.float32)
    bias_E = bias_E - moe_cfg.quantile_step * outside_E * excess_E
  elif kind == "quantile_exact":
    target_E = jax.lax.stop_gradient(stats["target_bias"])
    bias_E = bias_E + moe_cfg.exact_damping * (target_E - bias_E)
  else:
    return state
  new["bias"] = jnp.clip(bias_E, -clamp, clamp)
  return new


def update_all(moe_cfg, router_vars: dict, routing: dict, step) -> dict:
  """Applies `update` to every MoE layer: router_vars[layer]["ffn"] ↔ routing[layer]."""
  if moe_cfg.balancer not in BIAS_BALANCERS:
    return router_vars
  out = dict(router_vars)
  for layer, stats in routing.items():
    ffn = dict(router_vars[layer]["ffn"])
    ffn.update(update(moe_cfg, {k: ffn[k] for k in ("bias", "ema_load") if k in ffn},
                      stats, step))
    out[layer] = {**router_vars[layer], "ffn": ffn}
  return out
