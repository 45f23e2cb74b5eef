"""Long-context inference on one GPU: prefill tokens/s and decode ms/token, hybrid vs all-MLA.

  python -m benchmarks.bench_long_context --out=$OUT [--contexts=8192,65536,262144,1048576]

configs/long_context_1b.py (≈1.15B total, 3:1 KDA:MLA, MoE) and its `:all_mla` variant,
bf16, batch --batch (1), random weights (benchmarks/random_variables.py) and tokens. Each
variant preallocates one cache for the longest context (attention only visits the filled
part), so its prefill step and decode loop compile once, before timing. Per context: the prompt is prefilled in chunks of
--prefill_chunk, then --decode_tokens tokens are decoded greedily. Peak device memory is
read from the allocator. A variant that fails (out of memory) or whose prefill passes
--max_seconds stops there. Results are written after every row.
"""

import json
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from configs import base, long_context_1b
from moe_jax.infer.cache import init_cache
from moe_jax.infer.generate import decode, inference_model, make_step
from moe_jax.train.state import frozen_model_config
from benchmarks.random_variables import random_variables

_CONTEXTS = flags.DEFINE_string("contexts", "8192,65536,262144,1048576", "Prompt lengths.")
_VARIANTS = flags.DEFINE_string("variants", "hybrid,all_mla", "hybrid | all_mla")
_CHUNK = flags.DEFINE_integer("prefill_chunk", 8192, "Prompt tokens per prefill step (at most "
                               "the shortest context).")
_DECODE = flags.DEFINE_integer("decode_tokens", 128, "Tokens decoded after the prompt.")
_MAX_SECONDS = flags.DEFINE_float("max_seconds", 240.0, "Skip longer contexts past this.")
_OUT = flags.DEFINE_string("out", None, "Folder for the JSON and markdown results.")
_SMALL = flags.DEFINE_bool("small", False, "Shrink the model (a CPU smoke run of the script).")
_DECODE_ONLY = flags.DEFINE_bool(
    "decode_only", False, "Skip the prefill: decode over a cache filled to each context with "
    "random latents and states (decode cost depends on the shapes and the filled length, not "
    "the values), so contexts and batches whose prefill would take minutes can be timed.")
_DECODE_DISPATCH = flags.DEFINE_string(
    "decode_dispatch", "", "model.moe.decode_dispatch for this run: auto (fused on GPU from 8 "
    "assignments, else gather) | gather (N·k expert copies "
    "read by a gather-einsum) | fused (the same copies read by Pallas kernels) | grouped "
    "(sort + grouped matmul) | layer (router, experts and shared expert as three kernels); "
    "'' keeps the config's.")
_DECODE_MATMUL = flags.DEFINE_string(
    "decode_matmul", "", "model.decode_matmul for this run: xla | pallas (few-rows kernel for "
    "the projections); '' keeps the config's.")
_KDA_DECODE = flags.DEFINE_string(
    "kda_decode", "", "model.kda_decode for this run: auto | xla | kernel (a KDA layer's decode "
    "step as one Pallas kernel); '' keeps the config's.")
_BATCH = flags.DEFINE_integer("batch", 1, "Prompts decoded together (each of the full context); "
                              "decode ms/token is per step, i.e. per token of every row.")


# The model's decode-path options, recorded in each decode row (rows made with other values
# are kept apart), with configs/base.py's values as their defaults. (KDA's input projections
# are always fused at inference: infer/generate.py inference_variables.)
_BASE = base.get_config().model
DECODE_OPTIONS = {"kda_decode": _BASE.kda_decode, "decode_dispatch": _BASE.moe.decode_dispatch,
                  "decode_matmul": _BASE.decode_matmul}


def decode_options(model_cfg) -> dict:
  return {k: (model_cfg.moe if k == "decode_dispatch" else model_cfg).get(k, v)
          for k, v in DECODE_OPTIONS.items()}


def model_config(variant):
  c = long_context_1b.get_config("all_mla" if variant == "all_mla" else None)
  c.model.dtype = "bfloat16"
  if _DECODE_DISPATCH.value:
    c.model.moe.decode_dispatch = _DECODE_DISPATCH.value
  if _DECODE_MATMUL.value:
    c.model.decode_matmul = _DECODE_MATMUL.value
  if _KDA_DECODE.value:
    c.model.kda_decode = _KDA_DECODE.value
  if _SMALL.value:
    c.model.update({"d_model": 64, "n_layers": 4, "n_heads": 2, "kda_head_dim": 32,
                    "mla_q_lora_rank": 32, "mla_kv_lora_rank": 32, "mla_qk_head_dim": 32,
                    "mla_v_head_dim": 32, "ffn_hidden": 128, "kda_chunk_size": 16})
    c.model.moe.update({"num_experts": 4, "top_k": 2, "expert_hidden": 32})
  return frozen_model_config(c)


def peak_bytes():
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use", float("nan"))


def run(variant, L, variables, model, jstep, jdecode, max_len, chunk):
  B = _BATCH.value
  tokens = np.random.default_rng(L).integers(0, 256, (B, L)).astype(np.int32)
  live = np.ones((B, chunk), bool)
  cache = init_cache(model.cfg, B, max_len)
  t0 = time.perf_counter()
  for c in range(L // chunk):
    logits, cache = jstep(variables, tokens[:, c * chunk:(c + 1) * chunk], live, cache)
  jax.block_until_ready(cache)
  prefill_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  out, _, cache = jdecode(variables, cache, logits[:, -1])
  jax.block_until_ready(out)
  decode_s = time.perf_counter() - t0
  return {"variant": variant, "context": L, "batch": B, "prefill_s": prefill_s,
          "prefill_tok_s": B * L / prefill_s, "decode_ms_per_token": 1e3 * decode_s / _DECODE.value,
          "filled_cache_gb": filled_cache_bytes(cache, (L + _DECODE.value) / max_len) / 1e9,
          "peak_gb": peak_bytes() / 1e9}


def random_cache(cfg, B, max_len, L):
  """A cache filled to length L with random values: MLA latents of unit scale, KDA states
  and conv tails small (what a prefill leaves has the same shapes and no special values)."""
  shapes = jax.eval_shape(lambda: init_cache(cfg, B, max_len))  # nothing allocated twice
  leaves, tree = jax.tree.flatten(shapes["layers"])
  keys = jax.random.split(jax.random.key(L), len(leaves))
  fill = jax.jit(lambda key, shape, dtype: (
      jax.random.normal(key, shape, dtype) * (1.0 if len(shape) == 3 else 0.1)
      if jnp.issubdtype(dtype, jnp.floating) else jnp.ones(shape, dtype)), static_argnums=(1, 2))
  leaves = [fill(key, x.shape, x.dtype) for key, x in zip(keys, leaves)]
  return {"length": jnp.full((B,), L, jnp.int32), "layers": jax.tree.unflatten(tree, leaves)}


def run_decode_only(variant, L, variables, model, jdecode, max_len):
  B = _BATCH.value
  print(f"{variant} {L}: {time.strftime('%H:%M:%S')} filling the cache", flush=True)
  cache = random_cache(model.cfg, B, max_len, L)
  logits = jax.random.normal(jax.random.key(1), (B, model.cfg.vocab_size), jnp.float32)
  jax.block_until_ready(cache)
  print(f"{variant} {L}: {time.strftime('%H:%M:%S')} decoding", flush=True)
  t0 = time.perf_counter()
  out, _, cache = jdecode(variables, cache, logits)
  jax.block_until_ready(out)
  decode_s = time.perf_counter() - t0
  return {"variant": variant, "context": L, "batch": B, "prefill_s": float("nan"),
          "prefill_tok_s": float("nan"), "decode_ms_per_token": 1e3 * decode_s / _DECODE.value,
          "filled_cache_gb": filled_cache_bytes(cache, (L + _DECODE.value) / max_len) / 1e9,
          "peak_gb": peak_bytes() / 1e9}


def filled_cache_bytes(cache, fraction):
  """KDA state and conv tails in full, MLA latents for the filled fraction of positions."""
  total = 0
  for path, x in jax.tree_util.tree_leaves_with_path(cache):
    share = fraction if getattr(path[-1], "key", None) == "ckv" else 1.0
    total += x.size * x.dtype.itemsize * share
  return total


def table(rows):
  by = {(r["variant"], r["context"]): r for r in rows}
  lines = ["| context | batch | variant | prefill tok/s | decode ms/token | MLA+KDA cache GB ¹ | "
           "peak GB | decode: hybrid × faster |", "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    other = by.get(("all_mla", r["context"]))
    ratio = (f"{other['decode_ms_per_token'] / r['decode_ms_per_token']:.2f}"
             if r["variant"] == "hybrid" and other else "")
    lines.append(f"| {r['context']} | {r['batch']} | {r['variant']} | {r['prefill_tok_s']:.0f} | "
                 f"{r['decode_ms_per_token']:.3f} | {r['filled_cache_gb']:.2f} | "
                 f"{r['peak_gb']:.1f} | {ratio} |")
  return "\n".join(lines)


def main(argv):
  del argv
  rows, errors = [], []
  contexts = sorted(int(x) for x in _CONTEXTS.value.split(","))
  chunk = min(_CHUNK.value, contexts[0])
  max_len = contexts[-1] + _DECODE.value

  def save():
    if _OUT.value:
      os.makedirs(_OUT.value, exist_ok=True)
      with open(os.path.join(_OUT.value, "bench_long_context.json"), "w") as f:
        json.dump({"rows": rows, "errors": errors, "device": str(jax.devices()[0])}, f,
                  indent=2)

  for variant in _VARIANTS.value.split(","):
    try:
      print(f"{variant}: {time.strftime('%H:%M:%S')} initialising", flush=True)
      model = inference_model(model_config(variant))
      step = make_step(model)
      T = model.cfg.kda_chunk_size
      variables = random_variables(model, T)  # the initialiser's shapes, not its compile
      B = _BATCH.value
      jstep = jax.jit(step, donate_argnums=3)
      jdecode = jax.jit(lambda v, cache, logits: decode(
          step, v, cache, logits, jax.random.key(0), max_new=_DECODE.value, temperature=0.0,
          stop_tokens=(-1,)), donate_argnums=1)
      t0 = time.perf_counter()  # compile on a scratch cache
      # Phase lines with timestamps: a run that outlives its time limit shows where it was.
      print(f"{variant}: {time.strftime('%H:%M:%S')} compiling (batch {B})", flush=True)
      if _DECODE_ONLY.value:
        logits = jnp.zeros((B, 1, model.cfg.vocab_size), jnp.float32)
        scratch = random_cache(model.cfg, B, max_len, chunk)
      else:
        logits, scratch = jstep(variables, np.zeros((B, chunk), np.int32),
                                np.ones((B, chunk), bool), init_cache(model.cfg, B, max_len))
      jax.block_until_ready(jdecode(variables, scratch, logits[:, -1]))
      del scratch
      print(f"{variant}: compiled in {time.perf_counter() - t0:.0f} s", flush=True)
    except Exception:  # noqa: BLE001
      errors.append(f"{variant} compile:\n{traceback.format_exc()[-2000:]}")
      print(errors[-1], flush=True)
      continue
    for L in contexts:
      try:
        rows.append(run_decode_only(variant, L, variables, model, jdecode, max_len)
                    if _DECODE_ONLY.value else
                    run(variant, L, variables, model, jstep, jdecode, max_len, chunk))
        print(rows[-1], flush=True)
        save()
        if rows[-1]["prefill_s"] > _MAX_SECONDS.value:
          errors.append(f"{variant}: stopped after {L} (prefill {rows[-1]['prefill_s']:.0f} s)")
          break
      except Exception:  # noqa: BLE001 — out of memory at long contexts is a result
        errors.append(f"{variant} {L}:\n{traceback.format_exc()[-2000:]}")
        print(errors[-1], flush=True)
        break
  save()
  m = model_config("hybrid")
  print(f"\n{jax.devices()[0]}; batch {_BATCH.value}, bf16, prefill chunk {chunk}, "
        f"{_DECODE.value} decoded tokens, MoE decode dispatch {m.moe.decode_dispatch}, "
        f"projections {m.decode_matmul}; ¹ cache bytes for the filled length")
  print("\n".join(e.splitlines()[0] for e in errors))
  print(table(rows))


if __name__ == "__main__":
  app.run(main)
