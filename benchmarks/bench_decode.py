"""Decode at long contexts: ms per step and tokens/s from batch 1 up to the largest batch
that fits, hybrid against all-MLA, into benchmarks/decode.json and decode.md.

  python -m benchmarks.bench_decode --out=$OUT [--contexts=131072,262144,1048576]

configs/long_context_1b.py and its `:all_mla` variant (bf16, random weights, the model's
defaults: no benchmark-only switch) decode --decode_tokens tokens greedily over a cache
filled to each context with random latents and states (bench_long_context.py
--decode_only: decode cost depends on the shapes and the filled length, not the values).
Per (variant, context) the batch doubles from 1 until a batch does not fit, then bisects
between the last batch that fit and the first that did not, so the largest batch that
fits has a row at the next batch tried with `oom: true` (--resolution apart; 1: the
exact largest batch). Each batch: one decode to compile
and warm up, then the median of --repeats timed decodes.

Rows: context, batch, variant, ms_per_token (one decode step of the whole batch),
tokens_per_s (= batch · 1000 / ms_per_token), floor_ms (the step's floor on an H200:
benchmarks/decode_floors.py, the bytes it must read at 4.8 TB/s), peak_gib (the compiled
decode's arguments, outputs and temporaries, without the buffers it donates and gets
back), memory_limit_gib (what the allocator may use: XLA_PYTHON_CLIENT_MEM_FRACTION, 0.95
here unless set), oom, the decode options the model ran with (kda_decode,
moe.decode_dispatch, decode_matmul), xla_flags (the XLA_FLAGS of the run:
rows with flags are kept apart from the defaults' and out of the max-batch ratio), date,
commit.
"""

import gc
import os
import statistics
import time

# The largest batch is a question about the GPU's memory, so let the allocator have nearly all
# of it rather than JAX's default 75% (both variants alike; set the variable to override).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402

from benchmarks import bench_long_context as blc, decode_floors, provenance, xprof_tables  # noqa: E402
from benchmarks.batch_search import is_oom, search_batches  # noqa: E402
from benchmarks.random_variables import random_variables  # noqa: E402
from moe_jax.infer.generate import decode, inference_model, make_step  # noqa: E402

_BATCHES = flags.DEFINE_list("batches", [], "Batches to time instead of the search.")
_MAX_BATCH = flags.DEFINE_integer("max_batch", 1024, "The search stops here.")
_START_BATCH = flags.DEFINE_integer("start_batch", 1, "The search doubles from here (a start "
                                    "near benchmarks/decode_floors.py's largest batch saves "
                                    "compiles).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed decodes per batch (median).")
_RESOLUTION = flags.DEFINE_integer("resolution", 1, "The bisection stops when the batch that "
                                   "did not fit is at most this far above the one that did.")
_TRACE = flags.DEFINE_string("trace_dir", None, "Also trace one more decode of each batch with "
                             "the JAX profiler here and print its kernel launches and device "
                             "time per token beside the wall time (needs xprof): where the "
                             "step's time goes that its kernels do not take.")

GIB = 1 << 30


def measure_decode(variant: str, model, variables, L: int, batch: int) -> dict:
  n, repeats = blc._DECODE.value, _REPEATS.value
  max_len = L + n * (repeats + 1)
  step = make_step(model)
  jdecode = jax.jit(lambda v, cache, logits: decode(
      step, v, cache, logits, jax.random.key(0), max_new=n, temperature=0.0,
      stop_tokens=(-1,)), donate_argnums=1)
  cache = blc.random_cache(model.cfg, batch, max_len, L)
  logits = jax.random.normal(jax.random.key(1), (batch, model.cfg.vocab_size), jnp.float32)
  compiled = jdecode.lower(variables, cache, logits).compile()
  mem = compiled.memory_analysis()
  peak = None
  if mem is not None:
    peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes) / GIB
  out, _, cache = compiled(variables, cache, logits)   # warm-up
  jax.block_until_ready(out)
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    out, _, cache = compiled(variables, cache, logits)
    jax.block_until_ready(out)
    times.append(time.perf_counter() - t)
  ms = 1e3 * statistics.median(times) / n
  print(f"{variant} {L} × {batch}: {ms:.3f} ms/token, {batch * 1e3 / ms:,.0f} tokens/s",
        flush=True)
  if _TRACE.value:
    trace_dir = os.path.join(_TRACE.value, f"{variant}_{L}_{batch}")
    with jax.profiler.trace(trace_dir):
      t = time.perf_counter()
      out, _, cache = compiled(variables, cache, logits)
      jax.block_until_ready(out)
      traced_ms = 1e3 * (time.perf_counter() - t) / n
    print(xprof_tables.hlo_op_table(trace_dir, f"{variant} {L} × {batch}, {n} tokens", top=40))
    table, launches, device_us = xprof_tables.kernels_by_scope(trace_dir, compiled.as_text(), n,
                                                               top=60)
    print(f"\nkernels by scope, {variant} {L} × {batch}, per decoded token:\n{table}")
    print(f"{variant} {L} × {batch}, traced: {traced_ms:.3f} ms/token wall, "
          f"{launches / n:.0f} kernel launches and {device_us / n / 1e3:.3f} ms of kernel time "
          f"per token", flush=True)
  limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
  return {"ms_per_token": ms, "tokens_per_s": batch * 1e3 / ms, "peak_gib": peak,
          "memory_limit_gib": limit / GIB if limit else None,
          "ms_per_token_runs": [1e3 * t / n for t in times]}


def markdown(rows: list[dict], stamp: dict) -> str:
  lines = [f"## {stamp['date']}, commit {stamp['commit']}, {stamp['machine']}", "",
           "| context | variant | decode options | batch | ms/token (a step of the batch) | "
           "tokens/s | peak GiB | floor ms (of it) |", "|---|---|---|---|---|---|---|---|"]
  for r in sorted(rows, key=lambda r: (r["context"], r["variant"], options(r), r["batch"])):
    head = f"| {r['context']} | {r['variant']} | {options(r)} | {r['batch']} |"
    if r["oom"]:
      lines.append(f"{head} out of memory | | | |")
    else:
      peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "—"
      floor = (f"{r['floor_ms']:.3f} ({r['floor_ms'] / r['ms_per_token']:.0%})"
               if r.get("floor_ms") else "—")
      lines.append(f"{head} {r['ms_per_token']:.3f} | {r['tokens_per_s']:,.0f} | {peak} | "
                   f"{floor} |")
  lines += ["", "Largest batch that fits, and the hybrid's tokens/s over all-MLA's there (both "
            "with the default decode options):", ""]
  for L in sorted({r["context"] for r in rows}):
    best = {v: max((r for r in rows if r["context"] == L and r["variant"] == v
                    and not r["oom"] and options(r) == "defaults"),
                   key=lambda r: r["batch"], default=None)
            for v in ("hybrid", "all_mla")}
    if all(best.values()):
      h, a = best["hybrid"], best["all_mla"]
      lines.append(f"* {L}: hybrid batch {h['batch']} ({h['tokens_per_s']:,.0f} tokens/s), "
                   f"all-MLA batch {a['batch']} ({a['tokens_per_s']:,.0f}): "
                   f"**{h['tokens_per_s'] / a['tokens_per_s']:.2f}×**")
  lines += ["", "The ratio tends to the variants' cache bytes per row at their largest batches "
            "(benchmarks/decode_floors.md)."]
  return "\n".join(lines) + "\n"


def options(r) -> str:
  """The row's decode options that differ from configs/base.py's, and the XLA_FLAGS it ran
  with, or "defaults"."""
  changed = [k if v is True else f"{k}={v}" for k, d in blc.DECODE_OPTIONS.items()
             if (v := r.get(k, d)) != d]
  if r.get("xla_flags"):
    changed.append(f"XLA_FLAGS={r['xla_flags']}")
  return ", ".join(changed) or "defaults"


def _key(r):
  """A row replaces an earlier one of the same variant, context, batch, options and machine.
  Rows from before inference always fused KDA's input projections say which layout they
  read (`fused_projections`, False: six matmuls); later rows read the fused one."""
  return (r["variant"], r["context"], r["batch"], r.get("xla_flags", ""), r.get("machine"),
          r.get("fused_projections", True), *(r.get(k, v) for k, v in blc.DECODE_OPTIONS.items()))


def main(argv):
  del argv
  stamp = provenance.stamp()
  contexts = sorted(int(x) for x in blc._CONTEXTS.value.split(","))
  out = blc._OUT.value and os.path.join(blc._OUT.value, "decode.json")
  rows = []
  for variant in blc._VARIANTS.value.split(","):
    m = blc.model_config(variant)
    counts = decode_floors.count(m)
    model = inference_model(m)
    variables = random_variables(model, model.cfg.kda_chunk_size)
    for L in contexts:
      def row(r, L=L):
        return {"variant": variant, "context": L, **r, **blc.decode_options(model.cfg),
                "xla_flags": os.environ.get("XLA_FLAGS", "").strip(),
                "floor_ms": decode_floors.step_floor(m, L, r["batch"], counts)["ms"], **stamp}

      def measure(b, L=L):
        # each row as it is measured, a batch that did not fit too: a run cut short keeps
        # what it found
        try:
          r = measure_decode(variant, model, variables, L, b)
        except Exception as e:  # noqa: BLE001 — recorded if out of memory, raised either way
          if out and is_oom(e):
            provenance.merge_rows(out, [row({"batch": b, "oom": True})], _key)
          raise
        finally:
          gc.collect()
        if out:
          provenance.merge_rows(out, [row({**r, "batch": b, "oom": False})], _key)
        return r
      found = ([{**measure(int(b)), "batch": int(b), "oom": False} for b in _BATCHES.value]
               if _BATCHES.value else search_batches(
                   measure, _MAX_BATCH.value, _RESOLUTION.value, _START_BATCH.value))
      rows += [row(r) for r in found]
      if out:
        provenance.merge_rows(out, rows, _key)
  if out:
    with open(os.path.join(blc._OUT.value, "decode.md"), "a") as f:
      f.write("\n" + markdown(rows, stamp))
  print(markdown(rows, stamp))


if __name__ == "__main__":
  app.run(main)
