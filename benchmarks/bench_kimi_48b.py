"""Kimi-Linear-48B-A3B's exact shapes on one GPU: prefill 128K and 1M tokens at batch 1,
then decode; tokens/s, ms per token and peak memory.

  python -m benchmarks.bench_kimi_48b --out=$OUT [--contexts=131072,1048576]
  python -m benchmarks.bench_kimi_48b --memory_only      # any GPU: the compiled programs' memory

configs/kimi_linear_48b.py in bf16 with random weights (benchmarks/random_variables.py:
49.1 B parameters, 98 GB) and random tokens; the prefill and decode loops of
benchmarks/bench_long_context.py (its flags: --prefill_chunk, --decode_tokens, --batch,
--max_seconds, --small, and the decode options --kda_decode and --decode_dispatch, which
each row records). Before running, the memory plan: weights,
the MLA latent cache at each context (7 layers × (512 + 64) numbers a token) and the KDA
states. A context that does not fit is a row with its error and the plan's numbers.
--memory_only compiles the prefill step and the decode loop for the longest context from
shapes alone (no weights allocated, so any GPU can check the plan) and prints their
arguments, outputs and temporaries (jax's memory analysis).
Writes kimi_48b_h200.json and kimi_48b_h200.md (date, commit, machine, shapes) into --out.

A 1M prefill can take longer than a time-limited job may run, so it can run in parts:
--state_dir=DIR --part_seconds=S stops a process S seconds after its launch, between
chunks, saving the cache, the last logits, the next chunk and the prefill seconds so far
(orbax) in DIR; the next process with the same flags restores them and goes on. The row's
prefill_s is the sum of the parts' timed chunks (start-up, compile, save and restore not
counted), and `prefill_parts` says how many processes it took.
"""

import time

_LAUNCH = time.time()


import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from absl import app, flags  # noqa: E402

from benchmarks import bench_long_context as blc, provenance  # noqa: E402
from benchmarks.random_variables import random_variables  # noqa: E402
from configs import kimi_linear_48b  # noqa: E402
from moe_jax import params as params_lib  # noqa: E402
from moe_jax.infer.cache import init_cache  # noqa: E402
from moe_jax.infer.generate import decode, inference_model, make_step  # noqa: E402

FLAGS = flags.FLAGS
GIB = 1 << 30
_MEMORY_ONLY = flags.DEFINE_bool("memory_only", False, "Only compile the prefill step and the "
                                 "decode loop from shapes and print their memory.")
_STATE_DIR = flags.DEFINE_string("state_dir", "", "Where a prefill in parts keeps its state "
                                 "between processes (with --part_seconds).")
_PART_SECONDS = flags.DEFINE_float("part_seconds", 0.0, "With --state_dir: a process stops "
                                   "this long after its launch, between prefill chunks, and "
                                   "saves the prefill's state; 0 runs it whole.")


def _one_device():
  """Where every cache lives: committed to the first device, as orbax restores a saved one
  (a cache committed or not is a different jit signature: a recompile inside the timing)."""
  return jax.sharding.SingleDeviceSharding(jax.devices()[0])


class PrefillPaused(Exception):
  """A prefill in parts saved its state; run the same command again to go on."""


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
                                jax.device_put(init_cache(model.cfg, FLAGS.batch, max_len),
                                               _one_device()))
        jax.block_until_ready(jdecode(variables, scratch, logits[:, -1]))
        del scratch, logits
      logits_BxV, cache, prefill_s, parts = prefill(L, variables, model, jstep, max_len, chunk)
      t0 = time.perf_counter()
      out, _, cache = jdecode(variables, cache, logits_BxV)
      jax.block_until_ready(out)
      row.update(prefill_s=prefill_s, prefill_tok_s=FLAGS.batch * L / prefill_s,
                 prefill_parts=parts,
                 decode_ms_per_token=1e3 * (time.perf_counter() - t0) / FLAGS.decode_tokens,
                 peak_gib=blc.peak_bytes() / GIB)
      del cache, out
    except PrefillPaused as e:   # the rows before it are saved
      print(e, flush=True)
      return
    except Exception:  # noqa: BLE001 — not fitting is a result, with the plan beside it
      row["error"] = traceback.format_exc()[-1500:]
      print(row["error"], flush=True)
    rows.append(row)
    print(row, flush=True)
    save()
  save()
  print(table(rows, base))


def prefill(L: int, variables, model, jstep, max_len: int, chunk: int):
  """Prefills L random tokens (bench_long_context's) in chunks of `chunk`; returns the last
  position's logits [B, V], the cache, the timed seconds and the number of processes the
  prefill took. With --state_dir and --part_seconds, resumes a saved prefill and raises
  PrefillPaused after saving one that must go on in another process."""
  B = FLAGS.batch
  tokens_BxL = np.random.default_rng(L).integers(0, 256, (B, L)).astype(np.int32)
  live_BxC = np.ones((B, chunk), bool)
  path = os.path.join(os.path.abspath(_STATE_DIR.value), f"prefill_{L}") if _STATE_DIR.value else ""
  meta_path = path + ".json"
  if path and os.path.exists(meta_path):
    with open(meta_path) as f:
      meta = json.load(f)
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_one_device()),
        {"cache": jax.eval_shape(lambda: init_cache(model.cfg, B, max_len)),
         "logits": jax.ShapeDtypeStruct((B, model.cfg.vocab_size), jnp.float32)})
    saved = ocp.StandardCheckpointer().restore(os.path.join(path, str(meta["part"])), target)
    cache, logits_BxV = saved["cache"], saved["logits"]
    print(f"{time.strftime('%H:%M:%S')} resumed at chunk {meta['next_chunk']}", flush=True)
  else:
    meta = {"next_chunk": 0, "seconds": 0.0, "part": 0}
    cache, logits_BxV = jax.device_put(init_cache(model.cfg, B, max_len), _one_device()), None
  n_chunks = L // chunk
  for c in range(meta["next_chunk"], n_chunks):
    t0 = time.perf_counter()
    logits_BxCxV, cache = jstep(variables, tokens_BxL[:, c * chunk:(c + 1) * chunk], live_BxC,
                                cache)
    logits_BxV = logits_BxCxV[:, -1]
    jax.block_until_ready(cache)
    meta["seconds"] += time.perf_counter() - t0
    if (path and _PART_SECONDS.value and c + 1 < n_chunks
        and time.time() - _LAUNCH > _PART_SECONDS.value):
      meta.update(next_chunk=c + 1, part=meta["part"] + 1)
      checkpointer = ocp.StandardCheckpointer()
      checkpointer.save(os.path.join(path, str(meta["part"])),
                        {"cache": cache, "logits": logits_BxV})
      checkpointer.wait_until_finished()
      with open(meta_path, "w") as f:
        json.dump(meta, f)
      shutil.rmtree(os.path.join(path, str(meta["part"] - 1)), ignore_errors=True)
      raise PrefillPaused(f"{time.strftime('%H:%M:%S')} prefill of {L} paused after chunk "
                          f"{c + 1} of {n_chunks} ({meta['seconds']:.1f} s timed), state in "
                          f"{path}: run the same command again")
  if path:   # done: the next run of this context starts afresh
    shutil.rmtree(path, ignore_errors=True)
    if os.path.exists(meta_path):
      os.remove(meta_path)
  return logits_BxV, cache, meta["seconds"], meta["part"] + 1


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
