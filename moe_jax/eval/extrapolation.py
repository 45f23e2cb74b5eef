"""Length-extrapolation evals of a trained model, at lengths beyond the trained one:

* loss by position bucket on held-out long documents (bits per byte; the documents joined
  end to end at lengths no one of them reaches),
* passkey and MQAR retrieval accuracy,
* entropy of each MLA layer's attention over the last positions.

Everything runs through the inference path (moe_jax/infer: KDA state + MLA latent cache,
in chunks), so memory is bounded by the chunk, not by the length squared.

  for row in evaluate_lengths(model_cfg, variables, docs, lengths, ...):   # one per length
"""

import functools
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from moe_jax.data import mqar, passkey, tokenizer
from moe_jax.infer.cache import init_cache
from moe_jax.infer.generate import inference_model, inference_variables
from moe_jax.model.mla import with_shared_key

LN2 = math.log(2.0)


@functools.lru_cache(maxsize=8)
def _jitted_step(model):
  """One chunk through the model with the cache; one jitted function per model, so calls
  at the same shapes reuse its compilation."""
  @jax.jit
  def step(variables, tokens_BxC, next_BxC, cache):
    batch = {"tokens": tokens_BxC, "segment_ids": jnp.ones_like(tokens_BxC)}
    (logits_BxCxV, aux), inter = model.apply(variables, batch, cache, mutable=["intermediates"])
    logp_BxCxV = jax.nn.log_softmax(logits_BxCxV, axis=-1)
    # Only the next token's log-prob leaves the device, not [B, C, V] per chunk.
    logp_BxC = jnp.take_along_axis(logp_BxCxV, next_BxC[..., None], -1)[..., 0]
    return logp_BxC, logits_BxCxV.argmax(-1), aux["cache"], inter
  return step


def run_chunks(model, variables, tokens_BxT, chunk: int, *, capture_last: bool = False):
  """Teacher-forced forward over [B, T] tokens in chunks of `chunk` (T a multiple of it).

  Returns (log-prob of each next token [B, T-1] (positions 1..T-1 given the ones
  before), the greedy prediction after each position [B, T-1], and with capture_last the
  last chunk's sown MLA queries and the final cache).
  """
  B, T = tokens_BxT.shape
  if T % chunk:
    raise ValueError(f"length {T} must be a multiple of the eval chunk {chunk}")
  cache = init_cache(model.cfg, B, T)
  step = _jitted_step(model)
  logps, preds, inter = [], [], None
  for c in range(T // chunk):
    tok_BxC = jnp.asarray(tokens_BxT[:, c * chunk:(c + 1) * chunk], jnp.int32)
    nxt = tokens_BxT[:, c * chunk + 1:(c + 1) * chunk + 1]       # next tokens in this chunk
    n = nxt.shape[1]                                              # chunk - 1 in the last
    nxt_BxC = jnp.asarray(np.pad(nxt, ((0, 0), (0, chunk - n))), jnp.int32)
    logp_BxC, pred_BxC, cache, inter = step(variables, tok_BxC, nxt_BxC, cache)
    logps.append(np.asarray(logp_BxC[:, :n]))
    preds.append(np.asarray(pred_BxC[:, :n]))
  out = (np.concatenate(logps, 1), np.concatenate(preds, 1))
  return (*out, inter, cache) if capture_last else out


def loss_by_position(logp_BxN, buckets: int) -> list[float]:
  """Mean next-token loss (bits) in `buckets` equal spans of positions."""
  edges = np.linspace(0, logp_BxN.shape[1], buckets + 1).astype(int)
  return [float(-logp_BxN[:, a:b].mean() / LN2) for a, b in zip(edges[:-1], edges[1:])]


def attention_entropy(params, inter, cache, n_queries: int) -> dict[str, float]:
  """Mean entropy (nats) of each MLA layer's attention for the last n_queries positions,
  and the same divided by log(visible keys) (1 = uniform over everything visible)."""
  out = {}
  for path, leaves in _sown_queries(inter["intermediates"]):
    q_BxCxHxD = leaves["q"][0]
    mixer_params = params
    for key in path:
      mixer_params = mixer_params[key]
    w_kb_RxHxDqk = mixer_params["k_b"]["kernel"]     # [R, H, Dqk]: the latent → key map
    R = w_kb_RxHxDqk.shape[0]
    layer = path[0]
    ckv_BxSxW = cache["layers"][layer]["ckv"].astype(jnp.float32)   # W = R + shared dims
    B, C, H, D = q_BxCxHxD.shape
    S = ckv_BxSxW.shape[1]
    n = min(n_queries, C)
    k_BxSxHxD = with_shared_key(jnp.einsum("bsr,rhd->bshd", ckv_BxSxW[..., :R], w_kb_RxHxDqk),
                                ckv_BxSxW[..., R:])
    s_BxHxNxS = jnp.einsum("bnhd,bshd->bhns", q_BxCxHxD[:, C - n:].astype(jnp.float32),
                           k_BxSxHxD) * D ** -0.5
    pos_N = S - n + jnp.arange(n)
    visible_NxS = jnp.arange(S)[None, :] <= pos_N[:, None]
    logp = jax.nn.log_softmax(jnp.where(visible_NxS, s_BxHxNxS, -jnp.inf), axis=-1)
    ent_BxHxN = -jnp.sum(jnp.where(visible_NxS, jnp.exp(logp) * logp, 0.0), axis=-1)
    out[f"{layer}/entropy"] = float(ent_BxHxN.mean())
    out[f"{layer}/entropy_normalised"] = float((ent_BxHxN / jnp.log(pos_N + 1.0)).mean())
  return out


def _sown_queries(tree, path=()):
  """(module path, its sown leaves) for every module that sowed "q" (the MLA mixers)."""
  if "q" in tree:
    yield path, tree
    return
  for key, sub in tree.items():
    if isinstance(sub, dict):
      yield from _sown_queries(sub, path + (key,))


def document_windows(docs: list[bytes], length: int, max_windows: int) -> np.ndarray:
  """Up to max_windows windows [W, length] of token ids, each inside one document,
  longest documents first (documents shorter than `length` are not used)."""
  windows = []
  for d in sorted(docs, key=len, reverse=True):
    ids = tokenizer.encode(d)
    for start in range(0, len(ids) - length + 1, length):
      windows.append(ids[start:start + length])
      if len(windows) == max_windows:
        return np.stack(windows)
  return np.stack(windows) if windows else np.zeros((0, length), np.int32)


def joined_windows(docs: list[bytes], length: int, max_windows: int) -> np.ndarray:
  """Up to max_windows windows [W, length] of the documents joined end to end (longest
  first, each framed by BOS/EOS as in training rows): held-out text at lengths no one
  document reaches, so that every eval length has its bits/byte by position."""
  ids = np.concatenate([tokenizer.encode(d) for d in sorted(docs, key=len, reverse=True)]
                       or [np.zeros(0, np.int32)])
  n = min(len(ids) // length, max_windows)
  return ids[:n * length].reshape(n, length)


def eval_windows(docs: list[bytes], length: int, max_windows: int) -> tuple[np.ndarray, bool]:
  """(windows, joined): `document_windows`, or where no document is `length` long,
  `joined_windows` (joined = True)."""
  win = document_windows(docs, length, max_windows)
  return (win, False) if len(win) else (joined_windows(docs, length, max_windows), True)


def retrieval_accuracy(model, variables, task: str, length: int, rows: int, chunk: int,
                       cfg_data, depth: float = -1.0) -> dict[str, float]:
  """Greedy (teacher-forced) accuracy on the answer tokens: per token, and rows with every
  answer token right. Passkey rows put the key at `depth` of the filler (negative: a random
  depth per row), keyed `passkey@<depth>/…` when fixed."""
  if task == "passkey":
    src = passkey.PasskeyRows(length, depth=depth, seed=10_000)
    task = task if depth < 0 else f"passkey@{depth:g}"
  else:
    src = mqar.MQARRows(length, cfg_data.mqar_num_pairs, cfg_data.mqar_vocab, seed=10_000)
  examples = [src[i] for i in range(rows)]
  tokens = np.stack([e["tokens"] for e in examples])
  mask = np.stack([e["loss_mask"] for e in examples])[:, :length - 1] > 0   # at position t
  _, pred = run_chunks(model, variables, tokens, chunk)     # pred[:, t] guesses token t + 1
  right = (pred == tokens[:, 1:]) & mask
  per_row = mask.sum(1)
  return {f"{task}/token_acc": float(right.sum() / max(per_row.sum(), 1)),
          f"{task}/row_acc": float(np.mean(right.sum(1) == per_row))}


def evaluate_lengths(model_cfg, variables, docs: list[bytes], lengths: list[int], *,
                     chunk: int, buckets: int, max_windows: int,
                     retrieval_rows: int | dict[int, int], entropy_queries: int,
                     tasks: tuple[str, ...], cfg_data,
                     passkey_depths: tuple[float, ...] = ()) -> Iterator[dict]:
  """Yields one row per length as it finishes (a caller can keep each): windows used, mean
  bits/byte, loss per bucket, retrieval over `retrieval_rows` rows per task (an int, or
  per length; passkey also at each of passkey_depths) and MLA attention entropy."""
  model = inference_model(model_cfg)
  variables = inference_variables(model_cfg, variables)
  for L in tqdm(lengths, unit="length", desc="extrapolation evals"):
    ch = min(chunk, L)
    n_rows = retrieval_rows[L] if isinstance(retrieval_rows, dict) else retrieval_rows
    row = {"length": L, "retrieval_rows": n_rows}
    win, row["windows_joined"] = eval_windows(docs, L, max_windows)
    row["windows"] = len(win)
    if len(win):
      logp, _, inter, cache = run_chunks(model, variables, win, ch, capture_last=True)
      row["bits_per_byte"] = float(-logp.mean() / LN2)
      row["bits_by_bucket"] = loss_by_position(logp, buckets)
      row.update(attention_entropy(variables["params"], inter, cache, entropy_queries))
    for task in tasks:
      row.update(retrieval_accuracy(model, variables, task, L, n_rows, ch, cfg_data))
      for depth in passkey_depths if task == "passkey" else ():
        row.update(retrieval_accuracy(model, variables, task, L, n_rows, ch, cfg_data, depth))
    yield row

