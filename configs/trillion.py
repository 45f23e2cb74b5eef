"""A ≈1T-total / ≈30B-active hybrid MoE for a TPU pod (Kimi-K2-sized MoE, 3:1 KDA:MLA mixers).

61 layers at d_model 7168: layer 1 dense SwiGLU (18432), then 60 MoE layers of
384 experts (hidden 2048), 8 active + 1 shared. 32 heads; KDA head dim 128;
MLA NoPE with a 512-rank KV latent and a 1536-rank query bottleneck.

Layout for a TPU v5p-4096 slice (v5p:8x16x16, 2048 chips), chosen by compiling the train
step for it on a CPU host (scripts/aot_compile.py; benchmarks/tpu.md): fsdp 64 × expert 16
× sequence 2, capacity-factor dispatch, 1024 rows of 8192 tokens per step (8.4 M tokens;
4096 tokens per chip). XLA plans 67.3 of 95.7 GB per chip (16.7 GB of state, 50.2 GB of
temporaries), with every Mosaic kernel in (MLA's ring steps as TPU flash kernels). On 1024
chips (v5p:8x8x16, fsdp 32, 512 rows) it is 90.9 GB: 5% spare, too little. What does not
fit on 2048: dropless dispatch (its all-to-all buffers are sized for every assignment
landing on one of 16 expert shards: 240 GB of temporaries), and a `data` axis, which
replicates the expert weights (31 GB of state per chip at data 4 × fsdp 32).

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

  e.dispatch = "capacity"       # dropless EP buffers are 16× the balanced size at expert 16
  e.capacity_factor = 1.25

  c.data.seq_len = 8192
  c.data.batch_size = 1024
  c.mesh.data = 1
  c.mesh.fsdp = 64
  c.mesh.expert = 16
  c.mesh.sequence = 2           # 4096 tokens per chip: KDA state passing, MLA ring attention
  return c
