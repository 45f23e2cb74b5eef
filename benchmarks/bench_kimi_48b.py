"""Kimi-Linear-48B-A3B's exact shapes on one GPU: prefill 128K and 1M tokens at batch 1,
then decode; tokens/s, ms per token and peak memory.

  python -m benchmarks.bench_kimi_48b --out=$OUT [--contexts=131072,1048576]
  python -m benchmarks.bench_kimi_48b --memory_only      # any GPU: the compiled programs' memory

configs/kimi_linear_48b.py in bf16 with random weights (benchmarks/random_variables.py:
49.1 B parameters, 98 GB) and random tokens; the prefill and decode loops of
benchmarks/bench_long_context.py (its flags: --prefill_chunk, --decode_tokens, --batch,
--max_seconds, --small, and the decode options --kda_decode, --decode_dispatch,
--fused_projections, which each row records). Before running, the memory plan: weights,
the MLA latent cache at each context (7 layers × (512 + 64) numbers a token) and the KDA
states. A context that does not fit is a row with its error and the plan's numbers.
--memory_only compiles the prefill step and the decode loop for the longest context from
shapes alone (no weights allocated, so any GPU can check the plan) and prints their
arguments, outputs and temporaries (jax's memory analysis).
Writes kimi_48b_h200.json and kimi_48b_h200.md (date, commit, machine, shapes) into --out.
"""

import json
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks import bench_long_context as blc, provenance
from benchmarks.random_variables import random_variables
from configs import kimi_linear_48b
from moe_jax import params as params_lib
from moe_jax.infer.cache import init_cache
from moe_jax.infer.generate import decode, inference_model, make_step

FLAGS = flags.FLAGS
GIB = 1 << 30
_MEMORY_ONLY = flags.DEFINE_bool("memory_only", False, "Only compile the prefill step and the "
                                 "decode loop from shapes and print their memory.")


def model_config():
  c = kimi_linear_48b.get_config()
  c.model.dtype = "bfloat16"
  if FLAGS.small:   # a CPU smoke run of the script: the same layer kinds, tiny widths
    c.model.update({"d_model": 64, "n_layers": 4, "layer_pattern": "KKKA", "n_heads": 2,
                    "kda_n_heads": 2, "kda_head_dim": 32, "mla_kv_lora_rank": 32,
                    "mla_qk_head_dim": 16, "mla_qk_rope_dim": 8, "mla_v_head_dim": 16,
                    "ffn_hidden": 128, "kda_chunk_size": 16, "vocab_size": 512})
    c.model.moe.update({"num_experts": 8, "top_k": 2, "expert_hidden": 32})
  # bench_long_context's decode options, where given (each row records them)
  if blc._KDA_DECODE.value:
    c.model.kda_decode = blc._KDA_DECODE.value
  if blc._DECODE_DISPATCH.value:
    c.model.moe.decode_dispatch = blc._DECODE_DISPATCH.value
  if blc._FUSED.value is not None:
    c.model.fused_projections = blc._FUSED.value
  return c


def memory_plan(c, L: int, total_params: int) -> dict:
  """Bytes the run must hold, from shapes: bf16 weights, the bf16 MLA latent cache for
  L + decoded positions, the fp32 KDA states and conv tails."""
  m = c.model
  weights = total_params * 2
  cache = jax.eval_shape(lambda: init_cache(m, FLAGS.batch, L + FLAGS.decode_tokens))
  cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
  return {"weights_gib": weights / GIB, "cache_gib": cache_bytes / GIB,
          "logits_chunk_gib": FLAGS.batch * FLAGS.prefill_chunk * m.vocab_size * 4 / GIB}


def main(argv):
  del argv
  c = model_config()
  contexts = sorted(int(x) for x in FLAGS.contexts.split(","))
  chunk = min(FLAGS.prefill_chunk, contexts[0])
  base = {"date": provenance.today(), "commit": provenance.commit(),
          "machine": str(jax.devices()[0].device_kind), "batch": FLAGS.batch,
          "prefill_chunk": chunk, "decode_tokens": FLAGS.decode_tokens, "dtype": "bfloat16",
          "total_params": params_lib.count(c)["total_sum"]}
  rows = []

  def save():
    if FLAGS.out:
      os.makedirs(FLAGS.out, exist_ok=True)
      with open(os.path.join(FLAGS.out, "kimi_48b_h200.json"), "w") as f:
        json.dump({"rows": rows, **base}, f, indent=2)
      with open(os.path.join(FLAGS.out, "kimi_48b_h200.md"), "w") as f:
        f.write(table(rows, base))

  model = inference_model(c.model)
  step = make_step(model)
  jstep = jax.jit(step, donate_argnums=3)
  jdecode = jax.jit(lambda v, cache, logits: decode(
      step, v, cache, logits, jax.random.key(0), max_new=FLAGS.decode_tokens, temperature=0.0,
      stop_tokens=(-1,)), donate_argnums=1)
  max_len = contexts[-1] + FLAGS.decode_tokens
  if _MEMORY_ONLY.value:
    print(json.dumps(compiled_memory(model, jstep, jdecode, max_len, chunk), indent=1))
    return
  print(f"{time.strftime('%H:%M:%S')} initialising {base['total_params'] / 1e9:.1f} B params",
        flush=True)
  variables = random_variables(model, model.cfg.kda_chunk_size)
  for L in contexts:
    plan = memory_plan(c, L, base["total_params"])
    print(f"{time.strftime('%H:%M:%S')} context {L}: plan {plan}", flush=True)
    row = {"context": L, **{k: round(v, 2) for k, v in plan.items()},
           **blc.decode_options(c.model)}
    try:
      if not rows:   # compile both loops on a scratch cache, once
        logits, scratch = jstep(variables, np.zeros((FLAGS.batch, chunk), np.int32),
                                np.ones((FLAGS.batch, chunk), bool),
                                init_cache(model.cfg, FLAGS.batch, max_len))
        jax.block_until_ready(jdecode(variables, scratch, logits[:, -1]))
        del scratch, logits
      r = blc.run("kimi_48b", L, variables, model, jstep, jdecode, max_len, chunk)
      row.update(prefill_s=r["prefill_s"], prefill_tok_s=r["prefill_tok_s"],
                 decode_ms_per_token=r["decode_ms_per_token"],
                 peak_gib=blc.peak_bytes() / GIB)
    except Exception:  # noqa: BLE001 — not fitting is a result, with the plan beside it
      row["error"] = traceback.format_exc()[-1500:]
      print(row["error"], flush=True)
    rows.append(row)
    print(row, flush=True)
    save()
  save()
  print(table(rows, base))


def compiled_memory(model, jstep, jdecode, max_len: int, chunk: int) -> dict:
  """GiB of arguments, outputs and temporaries of the prefill step (one chunk) and the
  decode loop over a cache of max_len positions, compiled from shapes alone."""
  S = jax.ShapeDtypeStruct
  variables = jax.eval_shape(lambda: random_variables(model, model.cfg.kda_chunk_size))
  cache = jax.eval_shape(lambda: init_cache(model.cfg, FLAGS.batch, max_len))
  B = FLAGS.batch
  programs = {
      "prefill_step": jstep.lower(variables, S((B, chunk), jnp.int32), S((B, chunk), bool),
                                  cache),
      "decode_loop": jdecode.lower(variables, cache, S((B, model.cfg.vocab_size), jnp.float32))}
  out = {"cache_positions": max_len, "prefill_chunk": chunk}
  for name, lowered in programs.items():
    m = lowered.compile().memory_analysis()
    out[name] = {"argument_gib": m.argument_size_in_bytes / GIB,
                 "output_gib": m.output_size_in_bytes / GIB,
                 "temp_gib": m.temp_size_in_bytes / GIB}
  return out


def table(rows, base) -> str:
  lines = [f"# Kimi-Linear-48B-A3B shapes on one GPU ({base['machine']})", "",
           f"{base['date']}, commit {base['commit']}; configs/kimi_linear_48b.py, bf16 random "
           f"weights ({base['total_params'] / 1e9:.1f} B params), batch {base['batch']}, prefill "
           f"chunk {base['prefill_chunk']}, {base['decode_tokens']} greedy decoded tokens "
           "(benchmarks/bench_kimi_48b.py).", "",
           "| context | prefill s | prefill tok/s | decode ms/token | peak GiB | weights GiB | "
           "cache GiB |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['context']} | did not fit: {r['error'].strip().splitlines()[-1][:120]} "
                   f"| | | | {r['weights_gib']:.1f} | {r['cache_gib']:.1f} |")
    else:
      lines.append(f"| {r['context']} | {r['prefill_s']:.1f} | {r['prefill_tok_s']:.0f} | "
                   f"{r['decode_ms_per_token']:.2f} | {r['peak_gib']:.1f} | "
                   f"{r['weights_gib']:.1f} | {r['cache_gib']:.1f} |")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  FLAGS.set_default("contexts", "131072,1048576")
  FLAGS.set_default("decode_tokens", 64)
  FLAGS.set_default("max_seconds", 1e9)
  app.run(main)
