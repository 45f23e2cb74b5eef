"""Each train-step phase's floor on one device: its model FLOPs at the dense bf16 peak, or
its unavoidable HBM traffic at the spec bandwidth, whichever takes longer. A phase's
measured time over its floor is how far that phase is from the hardware; the phases are
the named scopes bench_train's profile attributes kernels to.

Memory traffic counted (lower bounds; caches and fusion cannot remove it):
  optimizer      AdamW reads params, grads and two moments and writes params and moments
                 (7 fp32 numbers a parameter);
  moe_experts    every routed expert's weights read by the forward, the input gradient
                 and the weight gradient in the compute dtype, and their fp32 gradient
                 written once;
  moe_dispatch   the tokens permuted into expert order and combined back: T·d read and
                 T·k·d written, and the reverse, forward and backward.
"""

import jax.numpy as jnp

PEAK_FLOPS = 989e12          # H100/H200 dense bf16 spec
# Spec HBM bandwidth by device kind (the same dense bf16 peak for both).
HBM_BY_KIND = {"H100": 3.35e12, "H200": 4.8e12}   # H100 SXM's HBM3, H200's HBM3e
HBM_BYTES_PER_S = HBM_BY_KIND["H200"]              # the default: the project's reference GPU


def hbm_bytes_per_s(device_kind: str | None) -> float:
  """The spec HBM bandwidth of a device kind ("NVIDIA H100 80GB HBM3" → 3.35 TB/s), the
  H200's for any other kind (CPU rows have no meaningful floor)."""
  for name, bw in HBM_BY_KIND.items():
    if name in (device_kind or ""):
      return bw
  return HBM_BYTES_PER_S


def phase_floors_ms(c, flops: dict, peak_flops: float = PEAK_FLOPS,
                    hbm_bytes_per_s: float = HBM_BYTES_PER_S) -> dict:
  """{phase: floor in ms per step} for config c with bench_train's FLOP terms `flops`."""
  from moe_jax import params
  m = c.model
  counts = params.count(c)
  active, total = counts["active"], counts["total"]
  tokens = c.data.batch_size * c.data.seq_len
  act = jnp.dtype(m.dtype).itemsize
  ms = lambda fl=0.0, byts=0.0: 1e3 * max(fl / peak_flops, byts / hbm_bytes_per_s)
  floors = {
      "optimizer": ms(byts=7 * 4 * counts["total_sum"]),
      # the head's matmul (the embedding's transpose when tied)
      "loss": ms(6 * (active["lm_head"] or m.vocab_size * m.d_model) * tokens),
      "kda": ms(6 * active["kda"] * tokens + flops["kda"]),
      "mla": ms(6 * active["mla"] * tokens + flops["mla_attention"]),
      "dense_ffn": ms(6 * active["dense_ffn"] * tokens),
  }
  if m.moe.num_experts:
    k = m.moe.top_k
    floors.update({
        "moe_experts": ms(6 * active["routed_experts"] * tokens,
                          total["routed_experts"] * (3 * act + 4)),
        "moe_dispatch": ms(byts=4 * tokens * (k + 1) * m.d_model * act),
        "router": ms(6 * (active["router"] + active["moe_latent"]) * tokens),
        "shared_experts": ms(6 * active["shared_experts"] * tokens),
    })
  return floors
