"""Base config: every field a run reads, with defaults sized for a real (GPU/TPU) run.

  python scripts/train.py --config=configs/base.py --workdir=/tmp/base \
      --config.model.d_model=1024 --config.data.seq_len=4096

Dimension letters used in code: B batch, T sequence, D d_model, H heads,
K key head dim, V value head dim, F FFN hidden, E experts, C chunk.
"""

import ml_collections


def get_config(arg=None):
  del arg
  c = ml_collections.ConfigDict()
  c.seed = 0

  m = c.model = ml_collections.ConfigDict()
  m.vocab_size = 259            # byte tokenizer: 256 bytes + BOS/EOS/PAD
  m.d_model = 1024
  m.n_layers = 16
  m.layer_pattern = "KKKA"      # K = KDA, A = gated MLA; applied cyclically over layers
  m.n_heads = 16
  m.dtype = "bfloat16"          # compute dtype; params and optimiser state stay fp32
  m.tie_embeddings = False
  m.norm_eps = 1e-6
  m.remat = False
  m.remat_policy = "full"       # with remat: full | dots | kernels | residuals |
                                # residuals_recompute_prologue (model/remat.py)
  m.remat_expert_rows = False   # with remat, also save the routed experts' input rows, SwiGLU
                                # activation and token-order outputs: no gather or SwiGLU rerun
                                # in the backward, N·k·(2D + F) values a MoE layer (model/remat.py)
  m.scan_layers = True          # one nn.scan over the periods of layer_pattern (layer_stack.py)
  # KDA (linear attention) mixer.
  m.kda_head_dim = 64           # K = V per head; heads * kda_head_dim need not equal d_model
  m.kda_n_heads = 0             # KDA heads; 0 = n_heads (MLA's)
  m.kda_lower_bound = -5.0      # bounded gate g in [lower_bound, 0); None = Kimi Linear's
                                # unbounded gate -exp(A_log)·softplus(f + dt_bias)
  m.kda_output_gate_bias = True  # a bias on the output gate's g_b (Kimi Linear: none)
  m.kda_conv_size = 4
  m.kda_chunk_size = 64
  m.kda_implementation = ""     # "" = best for platform; or xla | recurrent | pallas_gpu | triton | pallas_tpu
  m.kda_conv_implementation = ""  # the q/k/v short conv: "" = xla; or triton (pallas_kernels/kda/triton_gpu_short_conv.py)
  m.kda_gate_in_kernel = True   # q/k L2 norm, gate and chunk cumsum inside the KDA op (False: in XLA)
  # Gated MLA (NoPE) mixer.
  m.attn_res = "none"            # residual: none | block | full | mix (model/attn_res.py)
  m.attn_res_block_size = 4       # sub-layers (mixer or FFN) per block (block, mix)
  m.attn_res_mix_coef = 0.2       # mix: weight of the block-start stream, in [0.1, 0.3]
  m.mla_implementation = ""     # "" = by platform; or xla | gpu (Pallas: training, prefill, decode) | cudnn (gpu, with cuDNN for training) | tpu (Mosaic flash: training)
  m.mla_q_lora_rank = 384       # 0 = full-rank query projection
  m.mla_kv_lora_rank = 256      # the latent an inference cache stores
  m.mla_qk_head_dim = 64        # per-head query/key dims (Kimi Linear's qk_nope_head_dim)
  m.mla_qk_rope_dim = 0         # + dims of one key part all heads share (Kimi Linear's
                                # qk_rope_head_dim; never rotated: NoPE, model/mla.py)
  m.mla_rope_theta = 0.0        # > 0: rotate those shared dims and the queries' matching
                                # dims by RoPE at this base (10000: standard, no scaling);
                                # 0 = NoPE. The positional control of configs/stages.py:h200
  m.mla_v_head_dim = 64
  m.mla_output_gate = True      # sigmoid gate on each head's output (Kimi Linear: none)
  m.mla_latent_norm_eps = 0.0   # RMSNorm epsilon of the q / kv latents; 0 = norm_eps
                                # (Kimi Linear, DeepSeek: 1e-6 beside a norm_eps of 1e-5)
  # Projections of ≤ 16 rows (decoding) on GPU: xla (two kernels each, see
  # pallas_kernels/matmul/pallas_gpu_few_rows.py) | pallas (one kernel reading the weight
  # once; more rows, and other platforms, run lax.dot_general either way).
  m.decode_matmul = "pallas"
  # One matmul for all six projections a KDA layer makes of its input (q, k, v, f_a, b_proj,
  # g_a) instead of six, in training: its own parameter layout (`in_proj`). Inference reads
  # them fused either way (infer/generate.py inference_variables).
  m.fused_projections = False
  # A KDA layer's decode step (T = 1) from its input projections to o_proj: xla (some twenty
  # small kernels) | kernel (one Pallas kernel: pallas_kernels/kda/pallas_gpu_decode.py) |
  # auto (the kernel on GPU where it fits, xla elsewhere: model/kda.py decode_by_kernel).
  m.kda_decode = "auto"
  # FFN: dense SwiGLU in the first `moe.first_dense` layers (and everywhere if moe.num_experts == 0).
  m.ffn_hidden = 2816
  # Images in the token stream (model/vision.py, data/images.py); patch_size 0 = text only.
  v = m.vision = ml_collections.ConfigDict()
  v.patch_size = 0              # P: an image is cut into P×P patches, one position each
  v.channels = 1                # C: 1 grey, 3 RGB
  v.max_rows = 32               # learned row / column embeddings: the largest image is
  v.max_cols = 32               # max_rows·P × max_cols·P pixels
  v.patch_loss_weight = 0.0     # weight of the next-patch reconstruction loss (0 = off)
  # Mixture of experts (moe_jax/model/moe.py, router.py).
  moe = m.moe = ml_collections.ConfigDict()
  moe.num_experts = 64          # routed experts E; 0 = dense FFN in every layer
  moe.top_k = 6
  moe.num_shared = 1            # shared experts (one dense SwiGLU of num_shared * expert_hidden)
  moe.expert_hidden = 512
  moe.first_dense = 1           # the first layers keep the dense FFN
  moe.score = "sigmoid"         # router score: sigmoid | softmax
  moe.route_scale = 1.0         # combine weights: top-k scores renormalised, times this
  moe.dispatch = "dropless"     # dropless (sort + grouped matmul) | capacity ([E, C, D] batched)
  moe.capacity_factor = 1.25    # capacity path: C = ceil(factor * tokens * top_k / E)
  # Dropless with an expert mesh axis P > 1 (parallel/expert.py): all-to-all slots per
  # destination = this x the balanced load (tokens * top_k / P); the overflow goes in more
  # rounds, never dropped. Larger: fewer rounds when routing is skewed, more memory.
  moe.ep_buffer_factor = 2.0
  moe.grouped_matmul = ""       # "" = triton (GPU) / tokamax (TPU) for bf16, else xla; or xla | tokamax | mosaic | triton
  # On triton, one-device dropless: the down projection's dx kernel writes the SwiGLU's
  # gradient (pallas_kernels/moe/ops.swiglu_down): 3.8 ms less kernel time in the 1B's step,
  # no faster a step while scanned layers copy h out of the stack for it (train.md), so off
  # here; on with unrolled layers (configs/long_context_1b.py).
  moe.swiglu_grad_in_kernel = False
  # One-device dropless: each assignment's weight scales its SwiGLU activation before the down
  # projection, (w·a)·down, and the combine sums; the backward then needs no expert output
  # rows, so none is stored (model/moe.py dropless); with swiglu_grad_in_kernel, in its kernel.
  moe.weights_before_down = False
  # dropless with N·k ≤ E (decoding): auto (fused on GPU from 8 assignments, else gather) |
  # gather | grouped | fused | layer (router, experts and shared expert as three kernels)
  moe.decode_dispatch = "auto"
  # The router logits' product (router.logits; logits and scores are fp32 either way):
  # "" = model.dtype | float32 | bfloat16 (bf16 operands, fp32 accumulation).
  moe.router_dtype = ""
  moe.router_init_scale = 0.006  # std of the router kernel at init (small: near-uniform scores)
  moe.latent_dim = 0            # latent MoE: route and run experts on an R-wide projection (0 = off)
  moe.router_init_reg = 0.0     # coefficient of Σ ||p - p(init)||^2 over init_reg_params, in the loss
  moe.init_reg_params = "router_kernel"   # comma-separated: router_kernel, latent_down
  moe.z_loss = 0.0              # coefficient of mean(logsumexp(router logits)^2)
  # Balancer: none | aux_loss | loss_free | quantile_ema | quantile_exact (router.py).
  moe.balancer = "loss_free"
  moe.aux_loss_coef = 0.01      # aux_loss: Switch load-balancing loss coefficient
  moe.bias_rate = 1e-3          # loss_free: b_i += bias_rate * sign(mean_load - load_i)
  moe.bias_clamp = 1.0          # every bias balancer clamps the bias to [-clamp, clamp]
  moe.ema_window = 1000         # quantile_ema: EMA window W in steps (decay 1/W)
  moe.quantile_step = 0.01      # quantile_ema: bias step for experts outside the quartiles
  moe.exact_damping = 0.5       # quantile_exact: b += damping * (target - b)

  d = c.data = ml_collections.ConfigDict()
  d.source = "stdlib"           # stdlib (embedded default, a document per file) |
                                # stdlib_packages (a document per package) | files (text) |
                                # jsonl | parquet | array_record (a document per record) |
                                # prepared (scripts/prepare_data.py's packed shards) | mqar |
                                # tasks (demonstrations of data.tasks: GRPO's warm-up)
  d.paths = ""                  # files / jsonl / parquet / array_record: a glob;
                                # prepared: the directory
  d.text_field = "text"         # jsonl / parquet: the field holding a record's text
  d.tokenizer = "bytes"         # bytes | sentencepiece:<model file> | hf:<tokenizer.json>
                                # (scripts/train_tokenizer.py); model.vocab_size follows it
  d.seq_len = 2048
  d.batch_size = 32
  d.val_percent = 5             # share of documents (by path hash) held out for validation
  d.shuffle_seed = 0
  d.read_threads = 1            # grain threads making train batches ahead of the step (0: in
                                # next()); the sources are in memory, so more only contend with
                                # the step's trace for the GIL (benchmarks/train.md)
  d.prefetch_batches = 2        # train batches those threads keep ready
  d.mqar_num_pairs = 16         # MQAR: key-value pairs per sequence
  d.mqar_vocab = 256            # MQAR: keys and values drawn from disjoint halves of this range
  d.synthetic_fraction = 0.0    # text sources: this share of train rows is synthetic retrieval
  d.synthetic_tasks = "passkey"  # comma-separated: passkey | mqar (taken in turn)
  d.tasks = "addition,retrieval"  # source tasks and GRPO: addition | reversal | retrieval | tools
  d.retrieval_pairs = 12        # retrieval: at most this many key:value pairs (at least 4)
  d.addition_reversed = False   # addition: the sum written least-significant digit first
  d.demo_mistake_rate = 0.0     # tasks: the warm-up's imperfect teacher (rl/tasks.py): on prompts
                                # ending in an odd digit, this share of demonstrations is wrong
  d.image_fraction = 0.0        # text sources: this share of train rows is image documents
  d.image_tasks = "digits,charts"  # comma-separated: digits | charts (data/image_tasks.py)

  o = c.optim = ml_collections.ConfigDict()
  o.learning_rate = 3e-4
  o.b1 = 0.9
  o.b2 = 0.95
  o.eps = 1e-8
  o.weight_decay = 0.1
  o.grad_clip_norm = 1.0
  o.router_grad_clip_norm = 1.0  # routing params are clipped on their own first (0 = off)
  # ...these ones (comma-separated): router_kernel, latent_down, latent_norm, latent_up
  o.router_clip_params = "router_kernel"

  s = c.schedule = ml_collections.ConfigDict()
  s.kind = "cosine"             # cosine | wsd (warmup-stable-decay)
  s.total_steps = 10_000
  s.warmup_steps = 500
  s.decay_fraction = 0.2        # wsd: final share of steps spent decaying
  s.final_lr_fraction = 0.1

  e = c.eval = ml_collections.ConfigDict()
  e.every_steps = 500
  e.num_batches = 16

  k = c.checkpoint = ml_collections.ConfigDict()
  k.every_steps = 1000
  k.max_to_keep = 3
  k.async_save = True

  t = c.train = ml_collections.ConfigDict()
  # Persistent XLA compilation cache (train/compile_cache.py); "" = off.
  t.compile_cache_dir = "~/.cache/moe_jax/xla"
  # XLA flags the entry points set before jax starts (train/xla_flags.py; XLA_FLAGS wins):
  # GEMM autotuning without checking each candidate's output (5 s off the 1B's cold compile);
  # no Triton GEMM fusions, cuBLAS for every product (11-18 s off; benchmarks/train.md);
  # no dynamic-slice fusions, which ran KDA's Triton kernels twice in the scanned layers
  # (1B: 11.5 ms of kernel time a step and 6 s of compile off).
  # The train step as two programs, gradients then update (train/step.py jit_step_halves):
  # XLA optimises a program on one thread, so the halves compile side by side (the 1B's
  # cold compile on the H200: 28.5 s against 36.5 for the one program).
  t.split_step = True
  t.xla_flags = ("--xla_gpu_autotune_level=1 --xla_gpu_enable_triton_gemm=false "
                 "--xla_gpu_enable_dynamic_slice_fusion=false")
  # Share of GPU memory the allocator may take (XLA_PYTHON_CLIENT_MEM_FRACTION, which wins);
  # 0 = JAX's default, 0.75. XLA plans the step for this limit (train/xla_flags.py).
  t.memory_fraction = 0.0
  g = t.guard = ml_collections.ConfigDict()  # divergence guard (moe_jax/train/guard.py)
  g.enabled = False
  g.spike_factor = 3.0          # a loss above this x the EMA of healthy losses is a spike...
  g.ema_steps = 100             # ... EMA over about this many steps
  g.warmup_steps = 100          # healthy steps before spikes are checked
  g.max_skipped = 10            # this many skipped (non-finite) updates in a row also trigger
  g.skip_batches = 100          # batches skipped past the one that triggered, after a rollback
  g.max_rollbacks = 3           # one more trigger than this stops the run

  lg = c.log = ml_collections.ConfigDict()
  lg.every_steps = 10
  lg.stage = ""                 # a context-extension stage's name: tags every metric line
  # MoE: log moe/route_fluctuation, the fraction of (token, layer) top-k sets that changed
  # over one step, on the first validation batch (train/probe.py; one extra forward at each
  # logging step and the step before).
  lg.route_fluctuation = False

  mesh = c.mesh = ml_collections.ConfigDict()
  # Sizes of ("data", "fsdp", "expert", "sequence", "tensor"); -1 = all remaining devices.
  mesh.data = -1
  mesh.fsdp = 1
  mesh.expert = 1
  mesh.sequence = 1
  mesh.tensor = 1
  return c
