"""Prefill and decode: prompts → cache (chunked, so activations are bounded by the chunk) →
a jitted `lax.while_loop` that samples one token per row per step until every row has hit a
stop token or the budget.

  model = inference_model(cfg)
  variables = inference_variables(cfg, train_variables)   # per-layer layout, once
  step = make_step(model)
  cache = init_cache(model.cfg, B, max_len)
  logits_BxV, cache = prefill(step, variables, cache, tokens_BxT, lengths_B, chunk=256)
  new_BxN, n_new_B, cache = decode(step, variables, cache, logits_BxV, key, max_new=64)

A recording step (`make_step(model, record_routes=True)`) also returns the top-k experts of
every fed token: `prefill` then returns them for the prompt, and `decode_turn` (the loop
under `decode`, with a done mask, stop sequences and the sampled tokens' log-probs) for each
generated token. GRPO rollouts (moe_jax/rl/rollout.py) are built on these.
"""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from moe_jax.data import images as images_lib, tokenizer, tokenizers
from moe_jax.fields import is_moe
from moe_jax.infer import sampling
from moe_jax.infer.cache import init_cache
from moe_jax.model import kda, layer_stack
from moe_jax.model.layers import dtype_of
from moe_jax.model.transformer import HybridMoE


def inference_model(model_cfg) -> HybridMoE:
  """The same model with dropless MoE dispatch (no token is ever dropped at inference),
  layers unscanned and KDA's input projections fused: the layout inference_variables
  gives."""
  c = ml_collections.ConfigDict(model_cfg.to_dict())
  if is_moe(c):
    c.moe.dispatch = "dropless"
  c.remat = False
  c.scan_layers = False   # each layer's weights and cache read in place (model/layer_stack.py)
  c.fused_projections = True   # what the model initialises; applied, it reads either layout
  return HybridMoE(ml_collections.FrozenConfigDict(c))


def inference_variables(model_cfg, variables: dict) -> dict:
  """Training variables (params, router; scanned layers stacked or not) in the per-layer
  layout the inference model reads, each KDA mixer's six input projections fused into one
  `in_proj`, and every matrix it uses in the model's dtype: each MoE layer's expert weights
  and every layer's `kernel`. Call once, outside the decode loop.

  Why fused: at decode every matmul is its own kernels, and the six are narrow (f_a, g_a
  [D, K], b_proj [D, H]); one read of the concatenated kernel took the 1M-token batch-1
  step of long_context_1b 1.859 → 1.717 ms on the H100 (benchmarks/decode.md). The values
  are the same: each output column is the same dot product.

  Why the dtype: every consumer rounds these weights to the model's dtype before use (Dense
  layers in the model dtype, the MoE and KDA decode kernels, MLA's absorbed k_b / v_b), so the values
  the model computes with are the same. But a step reads them as stored: where a kernel (a
  Pallas or grouped-matmul custom call) reads the experts, XLA cannot fuse the cast into
  it, so every decode step wrote a converted copy of every expert (184 MB of fp32 in, 92 MB
  out per layer of long_context_1b), and the projections' fp32 weights were read at twice
  their bytes. Norm scales, gate parameters (A_log, dt_bias), biases, embeddings and the
  router stay as stored: some enter fp32 arithmetic, the rest are small."""
  out = {k: layer_stack.unstack(model_cfg, v) for k, v in variables.items()}
  if "params" in out:
    dtype = dtype_of(model_cfg)
    out["params"] = jax.tree_util.tree_map_with_path(
        lambda path, w: w.astype(dtype) if _is_matrix(path) else w,
        kda.fuse_projections(out["params"]))
  return out


def _is_matrix(path) -> bool:
  """A layer's `kernel`, or an MoE layer's stacked experts (ffn/gate_up, ffn/down: arrays,
  where a dense FFN's are Dense modules holding a `kernel`)."""
  keys = [str(getattr(entry, "key", entry)) for entry in path]
  return keys[-1] == "kernel" or keys[-2:] in (["ffn", "gate_up"], ["ffn", "down"])


def forward_logits(config, variables: dict, tokens_BxT, segment_ids_BxT=None):
  """float32 logits [B, T, V] of whole sequences: one forward, no cache. `config` is a run
  config (what interop.kimi_hf.load and infer.workdir.load return) or its model part;
  segment_ids [B, T] (0 = padding) packs documents into a row, as in training."""
  model_cfg = config.model if "model" in config else config
  model = HybridMoE(ml_collections.FrozenConfigDict(model_cfg))
  tokens_BxT = jnp.asarray(tokens_BxT, jnp.int32)
  if segment_ids_BxT is None:
    segment_ids_BxT = jnp.ones_like(tokens_BxT)
  batch = {"tokens": tokens_BxT, "segment_ids": jnp.asarray(segment_ids_BxT, jnp.int32)}
  logits_BxTxV, _ = _forward(model, variables, batch)
  return logits_BxTxV


@functools.partial(jax.jit, static_argnums=0)
def _forward(model, variables, batch):
  return model.apply(variables, batch)


def make_step(model: HybridMoE, record_routes: bool = False):
  """(variables, tokens [B,T], live [B,T] bool, cache[, images]) → (logits [B,T,V], cache),
  and with record_routes a third item: {MoE layer name: its top-k expert ids [B,T,K]}.
  `images` ({"patches" [B,T,P·P·C], "patch_rows", "patch_cols"}, data/images.py) feeds image
  positions to a multimodal model; without it every position is text."""
  def step(variables, tokens_BxT, live_BxT, cache, images=None):
    B, T = tokens_BxT.shape
    batch = {"tokens": tokens_BxT, "segment_ids": live_BxT.astype(jnp.int32), **(images or {})}
    if not record_routes:
      logits_BxTxV, aux = model.apply(variables, batch, cache)
      return logits_BxTxV, aux["cache"]
    (logits_BxTxV, aux), out = model.apply(variables, batch, cache, mutable=["intermediates"])
    routes = {layer: v["ffn"]["topk"][0].reshape(B, T, -1)
              for layer, v in out["intermediates"].items() if "ffn" in v}
    return logits_BxTxV, aux["cache"], routes
  step.records_routes = record_routes
  return step


def prefill(step, variables, cache, tokens_BxT, lengths_B, *, chunk: int, last_BxV=None,
            images=None):
  """Runs right-padded prompts (row b's first lengths_B[b] tokens) through the model in
  chunks of `chunk` tokens, each row continuing from its cached length. Returns (logits after
  each row's last prompt token [B, V], cache), and with a recording step the routes of every
  position {layer: [B, T, K]} as a third item.

  Given `last_BxV` (the logits each row ended on), rows may have length 0: they keep it (a
  multi-turn rollout feeds tool output to some rows only). `images` holds the prompts' image
  fields, [B, T, ...] like the tokens (make_step).
  """
  tokens_BxT, lengths_B = np.asarray(tokens_BxT, np.int32), np.asarray(lengths_B, np.int32)
  B, T = tokens_BxT.shape
  shortest = 0 if last_BxV is not None else 1
  if lengths_B.min() < shortest or lengths_B.max() > T:
    raise ValueError(f"prompt lengths must be in [{shortest}, {T}], got {lengths_B.tolist()}")
  chunk = min(chunk, T)
  n_chunks = -(-T // chunk)
  tokens_BxT = np.pad(tokens_BxT, ((0, 0), (0, n_chunks * chunk - T)),
                      constant_values=tokenizer.PAD)
  if images is not None:
    images = {k: np.pad(np.asarray(v), ((0, 0), (0, n_chunks * chunk - T))
                        + ((0, 0),) * (np.ndim(v) - 2)) for k, v in images.items()}
  jstep = jax.jit(step, donate_argnums=3)
  routes = []
  for c in range(n_chunks):
    pos_T = c * chunk + np.arange(chunk)
    live_BxT = pos_T[None, :] < lengths_B[:, None]
    here = slice(c * chunk, (c + 1) * chunk)
    logits_BxTxV, cache, *recorded = jstep(
        variables, tokens_BxT[:, here], live_BxT, cache,
        None if images is None else {k: v[:, here] for k, v in images.items()})
    routes += recorded
    idx_B = lengths_B - 1 - c * chunk
    here_B = (idx_B >= 0) & (idx_B < chunk)
    picked_BxV = logits_BxTxV[np.arange(B), np.clip(idx_B, 0, chunk - 1)]
    last_BxV = picked_BxV if last_BxV is None else jnp.where(here_B[:, None], picked_BxV, last_BxV)
  if not routes:
    return last_BxV, cache
  return last_BxV, cache, jax.tree.map(lambda *xs: jnp.concatenate(xs, 1)[:, :T], *routes)


def decode(step, variables, cache, logits_BxV, key, *, max_new: int, temperature: float = 1.0,
           top_k: int = 0, top_p: float = 1.0, stop_tokens: tuple[int, ...] = (tokenizer.EOS,)):
  """Samples up to max_new tokens per row. Returns (tokens [B, max_new] (PAD after a row's
  stop token), tokens generated per row incl. the stop token [B], cache)."""
  out = decode_turn(step, variables, cache, logits_BxV, key, max_new=max_new,
                    temperature=temperature, top_k=top_k, top_p=top_p, stop_tokens=stop_tokens)
  return out["tokens"], out["n_new"], out["cache"]


@functools.partial(jax.jit, static_argnames=("step", "max_new", "temperature", "top_k", "top_p",
                                             "stop_tokens", "stop_sequences"),
                   donate_argnames=("cache",))
def decode_turn(step, variables, cache, logits_BxV, key, done_B=None, *, max_new: int,
                temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                stop_tokens: tuple[int, ...] = (tokenizer.EOS,),
                stop_sequences: tuple[tuple[int, ...], ...] = ()) -> dict:
  """The sampling loop. Rows already `done_B` generate nothing. A row stops after a stop
  token or once its last tokens spell one of `stop_sequences` (a tool call's closing tag).

  Returns {"tokens" [B, max_new] (PAD after a row stops), "n_new" [B] (incl. the stop
  token), "stopped_on_sequence" [B], "logprobs" [B, max_new] (of each sampled token under
  softmax(logits / temperature), unfiltered: the policy GRPO trains), "cache"}, and with a
  recording step "routes" {layer: [B, max_new, K]} (the experts of each generated token).
  """
  B = logits_BxV.shape[0]
  stops = jnp.asarray(stop_tokens, jnp.int32)
  L = max((len(s) for s in stop_sequences), default=1)
  seqs = [jnp.asarray(s, jnp.int32) for s in stop_sequences]
  routes = None
  if getattr(step, "records_routes", False):
    _, _, shapes = jax.eval_shape(step, variables, jnp.zeros((B, 1), jnp.int32),
                                  jnp.ones((B, 1), bool), cache)
    routes = {k: jnp.zeros((B, max_new, v.shape[-1]), jnp.int32) for k, v in shapes.items()}

  def cond(carry):
    return (carry["i"] < max_new) & ~carry["done"].all()

  def body(carry):
    c = dict(carry)
    i, done_B = c["i"], c["done"]
    c["n_new"] = c["n_new"] + ~done_B  # counted here: a sampled PAD id is still a generated token
    key, sub = jax.random.split(c["key"])
    tok_B = sampling.sample(c["logits"], sub, temperature=temperature, top_k=top_k, top_p=top_p)
    tok_B = jnp.where(done_B, tokenizer.PAD, tok_B)
    logp_BxV = jax.nn.log_softmax(c["logits"] / (temperature or 1.0), axis=-1)
    c["logprobs"] = c["logprobs"].at[:, i].set(
        jnp.where(done_B, 0.0, jnp.take_along_axis(logp_BxV, tok_B[:, None], 1)[:, 0]))
    c["tokens"] = c["tokens"].at[:, i].set(tok_B)
    # Rows already done feed padding: their state and length stay as they are.
    logits_Bx1xV, c["cache"], *recorded = step(variables, tok_B[:, None], ~done_B[:, None],
                                               c["cache"])
    if recorded:
      c["routes"] = {k: v.at[:, i].set(recorded[0][k][:, 0]) for k, v in c["routes"].items()}
    recent_BxL = jnp.concatenate([c["recent"][:, 1:], tok_B[:, None]], 1)
    on_seq_B = jnp.zeros((B,), bool)
    for s in seqs:
      on_seq_B = on_seq_B | (recent_BxL[:, L - len(s):] == s).all(-1)
    on_seq_B = on_seq_B & ~done_B
    c["recent"], c["stopped_on_sequence"] = recent_BxL, c["stopped_on_sequence"] | on_seq_B
    c["done"] = done_B | jnp.isin(tok_B, stops) | on_seq_B
    c["i"], c["logits"], c["key"] = i + 1, logits_Bx1xV[:, 0], key
    return c

  carry = {"i": jnp.int32(0), "cache": cache, "logits": logits_BxV,
           "done": jnp.zeros((B,), bool) if done_B is None else done_B,
           "tokens": jnp.full((B, max_new), tokenizer.PAD, jnp.int32),
           "n_new": jnp.zeros((B,), jnp.int32), "key": key,
           "logprobs": jnp.zeros((B, max_new), jnp.float32),
           "recent": jnp.full((B, L), -1, jnp.int32),
           "stopped_on_sequence": jnp.zeros((B,), bool)}
  if routes is not None:
    carry["routes"] = routes
  out = jax.lax.while_loop(cond, body, carry)
  keep = ("tokens", "n_new", "logprobs", "stopped_on_sequence", "cache", "logits") + (
      ("routes",) if routes is not None else ())
  return {k: out[k] for k in keep}


def encode_prompts(model_cfg, prompts: list, tok=None
                   ) -> tuple[np.ndarray, np.ndarray, dict | None]:
  """Prompts → (tokens [B, T] right-padded, lengths [B], image fields [B, T, ...] or None).
  A prompt is a str, or for a multimodal model a list of str and images [H, W(, C)] in
  [0, 1], in order (data/images.py); each starts with BOS. `tok`: the run's tokenizer
  (data/tokenizers.py; default bytes)."""
  tok = tok or tokenizers.ByteTokenizer()
  v = model_cfg.vision
  has_images = any(not isinstance(p, (str, bytes)) for p in prompts)
  if has_images and not v.patch_size:
    raise ValueError("a prompt holds an image but model.vision.patch_size is 0 (a text-only "
                     "model)")
  enc = [images_lib.encode(p, v.patch_size, v.channels) if has_images
         else {"tokens": tok.encode(p, eos=False)} for p in prompts]
  for e in enc:
    if has_images and (e["patch_rows"].max() >= v.max_rows or e["patch_cols"].max() >= v.max_cols):
      raise ValueError(f"an image of {e['patch_rows'].max() + 1}×{e['patch_cols'].max() + 1} "
                       f"patches exceeds model.vision.max_rows×max_cols = {v.max_rows}×{v.max_cols}")
  lengths_B = np.array([len(e["tokens"]) for e in enc], np.int32)
  B, T = len(enc), int(lengths_B.max())
  tokens_BxT = np.full((B, T), tokenizer.PAD, np.int32)
  fields = None
  if has_images:
    fields = {k: np.zeros((B, T) + enc[0][k].shape[1:], enc[0][k].dtype)
              for k in images_lib.FIELDS[1:]}
  for b, e in enumerate(enc):
    tokens_BxT[b, :lengths_B[b]] = e["tokens"]
    for k in fields or ():
      fields[k][b, :lengths_B[b]] = e[k]
  return tokens_BxT, lengths_B, fields


def complete(model_cfg, variables, prompts: list, *, max_new: int, key, prefill_chunk=256,
             temperature=1.0, top_k=0, top_p=1.0, stop_tokens=None, tok=None) -> list[str]:
  """Text (and images) in, text out: tokenize (BOS, no EOS), prefill, decode, detokenize
  through `tok` (the run's tokenizer, data/tokenizers.py; default bytes), stopping at its
  EOS unless stop_tokens are given. A prompt is a str, or a list of str and images
  (encode_prompts)."""
  tok = tok or tokenizers.ByteTokenizer()
  stop_tokens = (tok.eos,) if stop_tokens is None else stop_tokens
  sampling.validate(temperature, top_k, top_p)
  if max_new < 1:
    raise ValueError(f"max_new must be >= 1, got {max_new!r}")
  tokens_BxT, lengths_B, image_fields = encode_prompts(model_cfg, prompts, tok)
  B = len(prompts)
  model = inference_model(model_cfg)
  variables = inference_variables(model_cfg, variables)
  step = make_step(model)
  cache = init_cache(model.cfg, B, int(lengths_B.max()) + max_new)
  logits_BxV, cache = prefill(step, variables, cache, tokens_BxT, lengths_B, chunk=prefill_chunk,
                              images=image_fields)
  out_BxN, n_new_B, _ = decode(step, variables, cache, logits_BxV, key, max_new=max_new,
                               temperature=temperature, top_k=top_k, top_p=top_p,
                               stop_tokens=tuple(stop_tokens))
  out_BxN, n_new_B = np.asarray(out_BxN), np.asarray(n_new_B)
  return [tok.decode(out_BxN[b, :n_new_B[b]]) for b in range(B)]
