"""Tiny hybrid KDA/MLA MoE model on the embedded stdlib corpus: the CPU default (minutes).

  python scripts/train.py --config=configs/tiny.py --workdir=workdir/tiny
  python scripts/train.py --config=configs/tiny.py:mqar --workdir=workdir/mqar
  python scripts/train.py --config=configs/tiny.py:small --workdir=workdir/small  # ~1 min
"""

from configs import base


def get_config(arg=None):
  c = base.get_config()
  m = c.model
  m.d_model = 128
  m.n_layers = 4
  m.layer_pattern = "KKKA"
  m.n_heads = 4
  m.dtype = "float32"           # CPU: bf16 matmuls are emulated and slower than fp32
  m.tie_embeddings = True
  m.kda_head_dim = 32
  m.kda_chunk_size = 16          # CPU: the XLA chunked path is cheapest at 16
  m.mla_q_lora_rank = 64
  m.mla_kv_lora_rank = 64
  m.mla_qk_head_dim = 32
  m.mla_v_head_dim = 32
  m.ffn_hidden = 384
  m.moe.num_experts = 8          # layers 1-3: 8 routed experts, top-2, + 1 shared (same active
  m.moe.top_k = 2                # FFN width as the dense layer 0: 128 shared + 2 x 128 routed)
  m.moe.num_shared = 1
  m.moe.expert_hidden = 128
  m.moe.first_dense = 1
  m.moe.bias_rate = 1e-2         # loss_free: a 300-step run needs a faster bias than 1e-3

  c.data.seq_len = 256
  c.data.batch_size = 16
  c.optim.learning_rate = 3e-3
  c.optim.weight_decay = 0.01
  c.schedule.total_steps = 300
  c.schedule.warmup_steps = 20
  c.eval.every_steps = 100
  c.eval.num_batches = 16
  c.checkpoint.every_steps = 100
  c.log.every_steps = 20

  if arg == "mqar":
    c.data.source = "mqar"
    c.data.seq_len = 128
  elif arg == "small":   # a step in ~0.1 s on a 2-core CPU: the notebooks, the tests' base
    m.update(d_model=64, n_heads=2, n_layers=2, layer_pattern="KA", kda_head_dim=16,
             mla_q_lora_rank=32, mla_kv_lora_rank=32, mla_qk_head_dim=16, mla_v_head_dim=16,
             ffn_hidden=128)
    c.data.seq_len, c.data.batch_size = 128, 8
    c.eval.num_batches = 2
  elif arg not in (None, ""):
    raise ValueError(f"configs/tiny.py arg must be one of '', 'mqar', 'small'; got {arg!r}")
  return c
