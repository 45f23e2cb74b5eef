"""What the hardware allows a decode step: its floor time (the bytes it must read at the HBM
bandwidth, or its FLOPs at the bf16 peak, whichever is longer), the largest batch whose
cache fits beside the weights, and the tokens/s that batch could reach at its floor.

  python -m benchmarks.decode_floors --contexts=131072,262144,1048576 [--out=benchmarks]

Bytes one step must read (a lower bound: no cache or fusion avoids them):
  weights    every non-expert weight once in the model's dtype; the batch's embedding rows;
             of each MoE layer's routed experts, those some row picks: E·(1 − (1 − k/E)^B)
             expected under uniform routing (k at batch 1, nearly all E at large batches);
  MLA cache  each row's filled latents, [context, R + Dr] in the model's dtype per layer;
  KDA cache  each row's fp32 state [H, K, V] read and written, and its conv tails.
FLOPs: 2 per active weight per row (the lm_head included), and per MLA layer the absorbed
attention's 2·H·context·(2R + Dr) per row (scores over R + Dr, values over R).

Why a ceiling on the hybrid's advantage follows: at its largest batch each variant's cache
fills the memory the weights leave, and the step reads that cache once, so its tokens/s
tend to HBM bandwidth / (cache bytes per row per token). The ratio of two variants' best
tokens/s tends to the ratio of their cache bytes per row: for long_context_1b (4 MLA
layers of 16) against its all-MLA variant that is 16/4 = 4×, less the KDA state.
"""

import os
import types

from absl import app, flags

from moe_jax import params
from moe_jax.fields import is_moe

PEAK_FLOPS = 989e12        # H100/H200 dense bf16 spec
HBM_BYTES_PER_S = 4.8e12   # H200 spec (H100 SXM: 3.35e12)
HBM_BYTES = 141e9          # H200 spec (H100: 80e9)


def _itemsize(m) -> int:
  return {"bfloat16": 2, "float16": 2, "float32": 4}[m.dtype]


def count(m) -> dict:
  """params.count for a model config (what bench_decode holds) rather than a run config."""
  return params.count(types.SimpleNamespace(model=m))


def _mixers(m) -> list[str]:
  from moe_jax.model.transformer import mixer_kind
  return [mixer_kind(m, i) for i in range(m.n_layers)]


def cache_bytes_per_row(m, context: int) -> dict:
  """{"mla": latent bytes of one row filled to `context`, "kda": its state and conv tails}."""
  from moe_jax.model.kda import kda_heads
  kinds = _mixers(m)
  width = m.mla_kv_lora_rank + m.get("mla_qk_rope_dim", 0)
  H, K = kda_heads(m), m.kda_head_dim
  tails = 3 * (m.kda_conv_size - 1) * (H * K * _itemsize(m) + 4)
  return {"mla": kinds.count("A") * context * width * _itemsize(m),
          "kda": kinds.count("K") * (H * K * K * 4 + tails)}


def experts_read(E: int, k: int, batch: int) -> float:
  """Expected distinct experts that `batch` rows pick, k each, under uniform routing."""
  return E * (1.0 - (1.0 - k / E) ** batch)


def step_floor(m, context: int, batch: int, counts: dict | None = None,
               hbm_bytes_per_s: float = HBM_BYTES_PER_S, peak_flops: float = PEAK_FLOPS) -> dict:
  """{"bytes", "flops", "ms", "bound"} for one decode step of model config m's `batch` rows
  at `context`."""
  counts = counts or count(m)
  total, active = counts["total"], counts["active"]
  size = _itemsize(m)
  dense = sum(v for k, v in total.items() if k not in ("embedding", "routed_experts"))
  weights = dense + min(batch * m.d_model, total["embedding"])
  if is_moe(m):
    E, k = m.moe.num_experts, m.moe.top_k
    weights += total["routed_experts"] * experts_read(E, k, batch) / E
  cache = cache_bytes_per_row(m, context)
  byts = weights * size + batch * (cache["mla"] + 2 * cache["kda"])
  attn = 2 * m.n_heads * context * (2 * m.mla_kv_lora_rank + m.get("mla_qk_rope_dim", 0))
  flops = batch * (2 * (counts["active_sum"] - active["embedding"])
                   + _mixers(m).count("A") * attn)
  t_bytes, t_flops = byts / hbm_bytes_per_s, flops / peak_flops
  return {"bytes": byts, "flops": flops, "ms": 1e3 * max(t_bytes, t_flops),
          "bound": "memory" if t_bytes >= t_flops else "compute"}


def max_batch(m, context: int, counts: dict | None = None, hbm_bytes: float = HBM_BYTES) -> int:
  """The most rows whose caches (preallocated to `context`) fit beside the weights. An
  upper bound: the step's temporaries (logits, partial softmax) are not counted."""
  counts = counts or count(m)
  cache = cache_bytes_per_row(m, context)
  free = hbm_bytes - counts["total_sum"] * _itemsize(m)
  return max(0, int(free // (cache["mla"] + cache["kda"])))


def ceiling(m, context: int, **kw) -> dict:
  """The largest batch and the tokens/s its step floor allows."""
  counts = count(m)
  b = max_batch(m, context, counts, kw.pop("hbm_bytes", HBM_BYTES))
  f = step_floor(m, context, b, counts, **kw)
  return {"batch": b, "ms": f["ms"], "tokens_per_s": b * 1e3 / f["ms"] if b else 0.0}


def markdown(stamp: dict, contexts, batches) -> str:
  from configs import long_context_1b
  configs = {v: long_context_1b.get_config(v if v == "all_mla" else None).model
             for v in ("hybrid", "all_mla")}
  counts = {v: count(m) for v, m in configs.items()}
  lines = [f"## Floors, {stamp['date']}, commit {stamp['commit']}", "",
           f"`configs/long_context_1b.py` (bf16) and `:all_mla`; HBM {HBM_BYTES / 1e9:.0f} GB "
           f"at {HBM_BYTES_PER_S / 1e12:.1f} TB/s, {PEAK_FLOPS / 1e12:.0f} TFLOP/s "
           "(H200 spec). Computed by `benchmarks/decode_floors.py`, not measured.", "",
           "| context | variant | batch | floor ms/step | bound | GB read/step | "
           "tokens/s at floor |", "|---|---|---|---|---|---|---|"]
  summary = []
  for L in contexts:
    best = {}
    for v, c in configs.items():
      top = ceiling(c, L)
      best[v] = top
      for b in [*batches, top["batch"]]:
        f = step_floor(c, L, b, counts[v])
        tag = f"{b} (largest)" if b == top["batch"] else str(b)
        lines.append(f"| {L} | {v} | {tag} | {f['ms']:.3f} | {f['bound']} | "
                     f"{f['bytes'] / 1e9:.2f} | {b * 1e3 / f['ms']:,.0f} |")
    h, a = best["hybrid"], best["all_mla"]
    summary.append(f"* {L}: largest batches {h['batch']} / {a['batch']}; the hybrid's "
                   f"tokens/s over all-MLA's at their floors: "
                   f"**{h['tokens_per_s'] / a['tokens_per_s']:.2f}×**")
  return "\n".join(lines + ["", *summary]) + "\n"


def main(argv):
  del argv
  from benchmarks import provenance
  text = markdown(provenance.stamp(machine="computed"), [int(x) for x in FLAGS.contexts],
                  [int(b) for b in FLAGS.batches])
  print(text)
  if FLAGS.out:
    with open(os.path.join(FLAGS.out, "decode_floors.md"), "w") as f:
      f.write("# Decode floors: what the H200 allows `long_context_1b`\n\n"
              + __doc__.split("\n\n", 1)[1] + "\n" + text)


if __name__ == "__main__":   # flags here only: bench_decode imports this module
  flags.DEFINE_list("contexts", ["131072", "262144", "1048576"], "Filled tokens.")
  flags.DEFINE_list("batches", ["1", "8"], "Batches to tabulate besides the largest.")
  flags.DEFINE_string("out", None, "Folder for decode_floors.md.")
  FLAGS = flags.FLAGS
  app.run(main)
