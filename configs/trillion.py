"""A ≈1T-total / ≈30B-active hybrid MoE for a TPU pod (Kimi-K2-sized MoE, 3:1 KDA:MLA mixers).

61 layers at d_model 7168: layer 1 dense SwiGLU (18432), then 60 MoE layers of
384 experts (hidden 2048), 8 active + 1 shared. 32 heads; KDA head dim 128;
MLA NoPE with a 512-rank KV latent and a 1536-rank query bottleneck.

Mesh for 2048 chips (e.g. a TPU v5p-4096 slice, 2048 chips): data 4 × fsdp 32 × expert
16. Experts shard 16 ways over `expert` (24 per shard) and their d_model axis
32 ways over `fsdp`, so each chip holds 1/512 of the expert weights (≈2 B
parameters, ≈24 GB with fp32 Adam state); the batch splits 2048 ways.

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

  c.data.seq_len = 8192
  c.data.batch_size = 4096
  c.mesh.data = 4
  c.mesh.fsdp = 32
  c.mesh.expert = 16
  return c
