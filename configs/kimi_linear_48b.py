"""Kimi-Linear-48B-A3B, exactly: moonshotai/Kimi-Linear-48B-A3B-Instruct's config.json,
field by field (tests/test_kimi_hf.py reads that file in its published form and checks
every field below against it).

27 layers, d_model 2304; KDA at every layer but 4, 8, 12, 16, 20, 24 and 27 (1-based),
which are MLA. KDA: 32 heads of 128, short conv 4, Kimi's unbounded gate
-exp(A_log)·softplus(f + dt_bias), no output-gate bias. MLA: 32 heads, full-rank queries,
512-rank KV latent, 128 per-head query/key dims plus 64 shared key dims (qk_rope, never
rotated: NoPE), values 128, no output gate. Layer 1 a dense SwiGLU (9216); the other 26
MoE: 256 experts of hidden 1024, top 8 by sigmoid score + e_score_correction_bias (the
aux-loss-free bias), weights renormalised × 2.446, 1 shared expert. RMSNorm eps 1e-5
(the MLA latents' 1e-6). Vocabulary 163840, untied head. 49.1 B parameters (48.4 B
without the embedding and head: the "48B"), 3.1 B active per token (the "A3B"):

  python scripts/param_count.py --config=configs/kimi_linear_48b.py

Variant `:h200_slice`: the same layer shapes, cut to the first 4 layers (KKKA: one dense
KDA layer, two MoE KDA layers, one MoE MLA layer) so that training at 8K fits one H200:
6.43 B parameters (0.78 B active), 103 GB of fp32 parameters, gradients and AdamW
moments, one 8K row a step, 107 GiB at the peak, so the allocator may take 95% of the GPU
(train.memory_fraction) (benchmarks/bench_train.py, row `h200_slice`; benchmarks/train.md). It keeps what toy shapes hide: 256
experts of width 1024 make many small grouped matmuls, and the 163840-token head is a
large share of the step. A fifth layer (another MoE layer: +1.82 B parameters, +29 GB, 132 GB
before activations) does not fit the H200's 141 GB.

Released weights load with moe_jax.interop.kimi_hf (scripts/convert_checkpoint.py); the
byte-level data pipeline wastes most of this vocabulary: train it with data.tokenizer set
to Kimi's tokenizer (docs/kimi_linear.md).
"""

from configs import base


VARIANTS = ("", "h200_slice")


def get_config(arg=None):
  if (arg or "") not in VARIANTS:
    raise ValueError(f"configs/kimi_linear_48b.py arg must be one of {VARIANTS}; got {arg!r}")
  c = base.get_config()
  m = c.model
  m.vocab_size = 163840
  m.d_model = 2304
  m.n_layers = 27
  m.layer_pattern = "KKKA" * 6 + "KKA"
  m.n_heads = 32
  m.norm_eps = 1e-5
  m.tie_embeddings = False
  m.kda_n_heads = 32
  m.kda_head_dim = 128
  m.kda_conv_size = 4
  m.kda_chunk_size = 64
  m.kda_lower_bound = None
  m.kda_output_gate_bias = False
  m.mla_q_lora_rank = 0
  m.mla_kv_lora_rank = 512
  m.mla_qk_head_dim = 128
  m.mla_qk_rope_dim = 64
  m.mla_v_head_dim = 128
  m.mla_output_gate = False
  m.mla_latent_norm_eps = 1e-6
  m.ffn_hidden = 9216
  m.remat = True
  e = m.moe
  e.num_experts = 256
  e.top_k = 8
  e.num_shared = 1
  e.expert_hidden = 1024
  e.first_dense = 1
  e.score = "sigmoid"
  e.route_scale = 2.446
  e.balancer = "loss_free"

  c.data.seq_len = 4096
  c.data.batch_size = 256
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.mesh.expert = 8
  if arg == "h200_slice":
    m.n_layers = 4
    m.layer_pattern = "KKKA"
    # as configs/long_context_1b.py trains at 8K on one GPU
    m.remat_policy = "residuals_recompute_prologue"
    c.data.seq_len = 8192
    c.data.batch_size = 1
    c.mesh.fsdp = 1
    c.mesh.expert = 1
    # 107 GiB a step: past JAX's default 75% of the H200 (XLA then fails to plan it)
    c.train.memory_fraction = 0.95
  return c
