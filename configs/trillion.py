"""A ≈1T-total / ≈30B-active hybrid MoE for a TPU pod (Kimi-K2-sized MoE, 3:1 KDA:MLA mixers).

61 layers at d_model 7168: layer 1 dense SwiGLU (18432), then 60 MoE layers of
384 experts (hidden 2048), 8 active + 1 shared. 32 heads; KDA head dim 128;
MLA NoPE with a 512-rank KV latent and a 1536-rank query bottleneck.

Layout for a TPU v5p-3072 slice (v5p:8x12x16, 1536 chips), the smallest that fits with a
margin, chosen by compiling the train step for each slice on a CPU host
(scripts/aot_compile.py; benchmarks/tpu.md): fsdp 32 × expert 24 × sequence 2,
capacity-factor dispatch, 768 rows of 8192 tokens per step (6.3 M tokens; 4096 tokens per
chip). XLA plans 76.2 of 95.7 GB per chip (22.9 GB of state, 51.3 GB of temporaries; 20%
spare), with every Mosaic kernel in. Tried and rejected: 1024 chips (v5p:8x8x16, fsdp 32 ×
expert 16, 512 rows), 90.9 GB, 5% spare; the same 1536 chips as fsdp 16 × expert 48,
81.0 GB (the dense weights shard only 16 ways). On 2048 chips (v5p:8x16x16, fsdp 64 ×
expert 16, 1024 rows) it is 67.3 GB. What does not fit: dropless dispatch (its all-to-all
buffers are sized for every assignment landing on one expert shard: 240 GB of temporaries
at expert 16), and a `data` axis, which replicates the expert weights (31 GB of state per
chip at data 4 × fsdp 32). fsdp must divide d_model 7168 (so no factor 3: the slice's 3
goes to the expert axis, 384 / 24 = 16 experts per shard).

  python scripts/param_count.py --config=configs/trillion.py
"""

from configs import base


def get_config(arg=None):
  del arg
  c = base.get_config()
  m = c.model
  m.vocab_size = 163840
  m.d_model = 7168
  m.n_layers = 61
  m.layer_pattern = "KKKA"
  m.n_heads = 32
  m.tie_embeddings = False
  m.kda_head_dim = 128
  m.kda_chunk_size = 64
  m.mla_q_lora_rank = 1536
  m.mla_kv_lora_rank = 512
  m.mla_qk_head_dim = 128
  m.mla_v_head_dim = 128
  m.ffn_hidden = 18432
  m.remat = True
  e = m.moe
  e.num_experts = 384
  e.top_k = 8
  e.num_shared = 1
  e.expert_hidden = 2048
  e.first_dense = 1
  e.score = "sigmoid"
  e.route_scale = 2.5

  e.dispatch = "dropless"       # all-to-all rounds of load-sized buffers: nothing dropped
  e.ep_buffer_factor = 1.25     # slots: 1.25 × the balanced load, as capacity had

  c.data.seq_len = 8192
  c.data.batch_size = 768       # one row per (fsdp, expert) pair
  c.mesh.data = 1
  c.mesh.fsdp = 32
  c.mesh.expert = 24
  c.mesh.sequence = 2           # 4096 tokens per chip: KDA state passing, MLA ring attention
  return c
