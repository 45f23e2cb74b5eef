"""A ≈1T-total / ≈30B-active hybrid MoE for a TPU pod (Kimi-K2-sized MoE, 3:1 KDA:MLA mixers).

61 layers at d_model 7168: layer 1 dense SwiGLU (18432), then 60 MoE layers of
384 experts (hidden 2048), 8 active + 1 shared. 32 heads; KDA head dim 128;
MLA NoPE with a 512-rank KV latent and a 1536-rank query bottleneck.

Layout for a TPU v5p-3072 slice (v5p:8x12x16, 1536 chips), the smallest that fits with a
margin, chosen by compiling the train step for each slice on a CPU host
(scripts/aot_compile.py; benchmarks/tpu.md): fsdp 32 × expert 24 × sequence 2, 768 rows of
8192 tokens per step (6.3 M tokens; 4096 tokens per chip), and **dropless** dispatch: the
expert-parallel all-to-all runs in rounds of buffers sized at 2× the balanced load
(model.moe.ep_buffer_factor), the overflow of a skewed batch going in more rounds, so no
token is ever dropped. XLA plans 80.5 of 95.7 GB per chip (22.9 GB of state, 54.4 GB of
temporaries, 3.2 GB of code; 16% spare; 78.5 GB at a factor of 1.25), with every Mosaic
kernel in. The same plan with
buffers for the worst case (every assignment on one shard, the dispatch before rounds)
needs 109 GB of temporaries and does not compile. A `data` axis replicates the expert
weights (31 GB of state per chip at data 4 × fsdp 32); fsdp must divide d_model 7168 (so
no factor 3: the slice's 3 goes to the expert axis, 384 / 24 = 16 experts per shard).

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
  e.ep_buffer_factor = 2.0      # slots per round: 2 × the balanced load (base's default)

  c.data.seq_len = 8192
  c.data.batch_size = 768       # one row per (fsdp, expert) pair
  c.mesh.data = 1
  c.mesh.fsdp = 32
  c.mesh.expert = 24
  c.mesh.sequence = 2           # 4096 tokens per chip: KDA state passing, MLA ring attention
  return c
