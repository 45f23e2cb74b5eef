"""Prefill and decode: prompts → cache (chunked, so activations are bounded by the chunk) →
a jitted `lax.while_loop` that samples one token per row per step until every row has hit a
stop token or the budget.

  model = inference_model(cfg)
  variables = inference_variables(cfg, train_variables)   # per-layer layout, once
  step = make_step(model)
  cache = init_cache(model.cfg, B, max_len)
  logits_BxV, cache = prefill(step, variables, cache, tokens_BxT, lengths_B, chunk=256)
  new_BxN, n_new_B, cache = decode(step, variables, cache, logits_BxV, key, max_new=64)
"""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from moe_jax.data import tokenizer
from moe_jax.infer import sampling
from moe_jax.infer.cache import init_cache
from moe_jax.model import layer_stack
from moe_jax.model.transformer import HybridMoE


def inference_model(model_cfg) -> HybridMoE:
  """The same model with dropless MoE dispatch: no token is ever dropped at inference."""
  c = ml_collections.ConfigDict(model_cfg.to_dict())
  if c.moe.num_experts:
    c.moe.dispatch = "dropless"
  c.remat = False
  c.scan_layers = False   # each layer's weights and cache read in place (model/layer_stack.py)
  return HybridMoE(ml_collections.FrozenConfigDict(c))


def inference_variables(model_cfg, variables: dict) -> dict:
  """Training variables (params, router; scanned layers stacked or not) in the per-layer
  layout the inference model reads. Call once, outside the decode loop."""
  return {k: layer_stack.unstack(model_cfg, v) for k, v in variables.items()}


def make_step(model: HybridMoE):
  """(variables, tokens [B,T], live [B,T] bool, cache) → (logits [B,T,V], cache)."""
  def step(variables, tokens_BxT, live_BxT, cache):
    batch = {"tokens": tokens_BxT, "segment_ids": live_BxT.astype(jnp.int32)}
    logits_BxTxV, aux = model.apply(variables, batch, cache)
    return logits_BxTxV, aux["cache"]
  return step


def prefill(step, variables, cache, tokens_BxT, lengths_B, *, chunk: int):
  """Runs right-padded prompts (row b's first lengths_B[b] tokens) through the model in
  chunks of `chunk` tokens. Returns (logits after each row's last prompt token [B, V], cache).
  """
  tokens_BxT, lengths_B = np.asarray(tokens_BxT, np.int32), np.asarray(lengths_B, np.int32)
  B, T = tokens_BxT.shape
  if lengths_B.min() < 1 or lengths_B.max() > T:
    raise ValueError(f"prompt lengths must be in [1, {T}], got {lengths_B.tolist()}")
  chunk = min(chunk, T)
  n_chunks = -(-T // chunk)
  tokens_BxT = np.pad(tokens_BxT, ((0, 0), (0, n_chunks * chunk - T)),
                      constant_values=tokenizer.PAD)
  jstep = jax.jit(step, donate_argnums=3)
  last_BxV = None
  for c in range(n_chunks):
    pos_T = c * chunk + np.arange(chunk)
    live_BxT = pos_T[None, :] < lengths_B[:, None]
    logits_BxTxV, cache = jstep(variables, tokens_BxT[:, c * chunk:(c + 1) * chunk], live_BxT,
                                cache)
    idx_B = lengths_B - 1 - c * chunk
    here_B = (idx_B >= 0) & (idx_B < chunk)
    picked_BxV = logits_BxTxV[np.arange(B), np.clip(idx_B, 0, chunk - 1)]
    last_BxV = picked_BxV if last_BxV is None else jnp.where(here_B[:, None], picked_BxV, last_BxV)
  return last_BxV, cache


@functools.partial(jax.jit, static_argnames=("step", "max_new", "temperature", "top_k", "top_p",
                                             "stop_tokens"), donate_argnames=("cache",))
def decode(step, variables, cache, logits_BxV, key, *, max_new: int, temperature: float = 1.0,
           top_k: int = 0, top_p: float = 1.0, stop_tokens: tuple[int, ...] = (tokenizer.EOS,)):
  """Samples up to max_new tokens per row. Returns (tokens [B, max_new] (PAD after a row's
  stop token), tokens generated per row incl. the stop token [B], cache)."""
  B = logits_BxV.shape[0]
  stops = jnp.asarray(stop_tokens, jnp.int32)

  def cond(carry):
    i, _, _, done_B, _, _, _ = carry
    return (i < max_new) & ~done_B.all()

  def body(carry):
    i, cache, logits_BxV, done_B, out_BxN, n_new_B, key = carry
    n_new_B = n_new_B + ~done_B  # counted here: a sampled PAD id is still a generated token
    key, sub = jax.random.split(key)
    tok_B = sampling.sample(logits_BxV, sub, temperature=temperature, top_k=top_k, top_p=top_p)
    tok_B = jnp.where(done_B, tokenizer.PAD, tok_B)
    out_BxN = out_BxN.at[:, i].set(tok_B)
    # Rows already done feed padding: their state and length stay as they are.
    logits_Bx1xV, cache = step(variables, tok_B[:, None], ~done_B[:, None], cache)
    done_B = done_B | jnp.isin(tok_B, stops)
    return i + 1, cache, logits_Bx1xV[:, 0], done_B, out_BxN, n_new_B, key

  out_BxN = jnp.full((B, max_new), tokenizer.PAD, jnp.int32)
  carry = (jnp.int32(0), cache, logits_BxV, jnp.zeros((B,), bool), out_BxN,
           jnp.zeros((B,), jnp.int32), key)
  _, cache, _, _, out_BxN, n_new_B, _ = jax.lax.while_loop(cond, body, carry)
  return out_BxN, n_new_B, cache


def complete(model_cfg, variables, prompts: list[str], *, max_new: int, key, prefill_chunk=256,
             temperature=1.0, top_k=0, top_p=1.0, stop_tokens=(tokenizer.EOS,)) -> list[str]:
  """Text in, text out: byte-tokenize (BOS, no EOS), prefill, decode, detokenize."""
  sampling.validate(temperature, top_k, top_p)
  if max_new < 1:
    raise ValueError(f"max_new must be >= 1, got {max_new!r}")
  ids = [tokenizer.encode(p, eos=False) for p in prompts]
  lengths_B = np.array([len(x) for x in ids], np.int32)
  tokens_BxT = np.full((len(ids), lengths_B.max()), tokenizer.PAD, np.int32)
  for b, x in enumerate(ids):
    tokens_BxT[b, :len(x)] = x
  model = inference_model(model_cfg)
  variables = inference_variables(model_cfg, variables)
  step = make_step(model)
  cache = init_cache(model.cfg, len(ids), int(lengths_B.max()) + max_new)
  logits_BxV, cache = prefill(step, variables, cache, tokens_BxT, lengths_B, chunk=prefill_chunk)
  out_BxN, n_new_B, _ = decode(step, variables, cache, logits_BxV, key, max_new=max_new,
                               temperature=temperature, top_k=top_k, top_p=top_p,
                               stop_tokens=tuple(stop_tokens))
  out_BxN, n_new_B = np.asarray(out_BxN), np.asarray(n_new_B)
  return [tokenizer.decode(out_BxN[b, :n_new_B[b]]) for b in range(len(ids))]
