"""Kimi-Linear-48B-A3B's shape (moonshotai/Kimi-Linear-48B-A3B-Instruct, config.json).

27 layers, d_model 2304, hybrid 3:1 KDA:MLA with full attention at layers
4, 8, …, 24 and 27 (1-based), 32 heads; KDA head dim 128; MLA NoPE with a
512-rank KV latent and full-rank queries; layer 1 a dense SwiGLU (9216), the
other 26 MoE: 256 experts of hidden 1024, 8 active, 1 shared, sigmoid router.
Vocabulary 163840, untied head.

  python scripts/param_count.py --config=configs/kimi_linear_48b.py

Differences from the release: MLA's 64 decoupled-RoPE query/key dims are
dropped (we are NoPE throughout; ~35M parameters), and the data pipeline here
is byte-level, so training this config on it wastes most of the vocabulary.
"""

from configs import base


def get_config(arg=None):
  del arg
  c = base.get_config()
  m = c.model
  m.vocab_size = 163840
  m.d_model = 2304
  m.n_layers = 27
  m.layer_pattern = "KKKA" * 6 + "KKA"
  m.n_heads = 32
  m.tie_embeddings = False
  m.kda_head_dim = 128
  m.kda_chunk_size = 64
  m.mla_q_lora_rank = 0
  m.mla_kv_lora_rank = 512
  m.mla_qk_head_dim = 128
  m.mla_v_head_dim = 128
  m.ffn_hidden = 9216
  m.remat = True
  e = m.moe
  e.num_experts = 256
  e.top_k = 8
  e.num_shared = 1
  e.expert_hidden = 1024
  e.first_dense = 1
  e.score = "sigmoid"

  c.data.seq_len = 4096
  c.data.batch_size = 256
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.mesh.expert = 8
  return c
