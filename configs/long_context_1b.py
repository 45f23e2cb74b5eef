"""≈1B-total hybrid MoE for long-context inference benchmarks (benchmarks/bench_long_context.py).

16 layers at d_model 1024, 3:1 KDA:MLA, 16 heads of 64; MLA latent rank 256; layer 0 a
dense SwiGLU, then MoE with 32 experts (hidden 704) top-4 + 1 shared. Variant `:all_mla`
replaces every mixer by MLA (the full-attention baseline); `:scanned` keeps its layers
scanned and the SwiGLU gradient out of the dx kernel, the layout single_h200, stages.py:h200
and grpo.py:h200 were timed and run with.

  python scripts/param_count.py --config=configs/long_context_1b.py
  python -m benchmarks.bench_long_context --out=$OUT
"""

from configs import base


def get_config(arg=None):
  c = base.get_config()
  m = c.model
  m.d_model = 1024
  m.n_layers = 16
  m.layer_pattern = "KKKA"
  m.n_heads = 16
  m.kda_head_dim = 64
  m.kda_chunk_size = 64
  m.mla_q_lora_rank = 512
  m.mla_kv_lora_rank = 256
  m.mla_qk_head_dim = 64
  m.mla_v_head_dim = 64
  m.ffn_hidden = 2816
  e = m.moe
  e.num_experts = 32
  e.top_k = 4
  e.num_shared = 1
  e.expert_hidden = 704
  e.first_dense = 1
  # Training at 8K: the scanned layers keep the kernels' outputs and their custom-VJP
  # residuals but KDA's prologue outputs, and recompute the rest (model/remat.py;
  # benchmarks/train.md: "residuals" was 3% faster than "kernels" for 11 GiB more; the
  # prologue's second launch costs less than storing q̂, k̂ and G: 2.4 GiB less).
  m.remat = True
  m.remat_policy = "residuals_recompute_prologue"
  # Layers unrolled, not scanned: a scanned stack copies each custom call's outputs into
  # its stacked residuals and back out in the backward (18 ms a step of device-to-device
  # copies the compute stream waits for). Unrolled, the 8K step on an H100 is 279.8 →
  # 253.2 ms and 9.5 GiB lighter, for a cold compile about 9 s longer; and the down
  # projection's dx kernel then writes the SwiGLU gradient without a copy of h out of the
  # stack: 248.8 ms (benchmarks/train.md, 2026-12-08).
  m.scan_layers = False
  e.swiglu_grad_in_kernel = True
  if arg == "all_mla":
    m.layer_pattern = "A"
  elif arg == "scanned":
    m.scan_layers = True
    e.swiglu_grad_in_kernel = False
  elif arg not in (None, ""):
    raise ValueError("configs/long_context_1b.py arg must be '', 'all_mla' or 'scanned'; "
                     f"got {arg!r}")
  return c
