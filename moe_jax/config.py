"""Config validation: every bad field fails here, before any tracing or compile. The entry
points call validate() (train_and_evaluate, train_grpo, the scripts); what the fields mean
is in fields.py, which the rest of the package reads."""

import ml_collections

from moe_jax.data import image_tasks as tasks_lib, prepared, tokenizer
from moe_jax.fields import (BALANCERS, DECODE_DISPATCH, DISPATCH, DOCUMENT_SOURCES, DTYPES,
                            GLOB_SOURCES, GROUPED_MATMULS, INIT_REG_PARAMS, MESH_AXES, MIN_VOCAB,
                            MIXERS, REMAT_POLICIES, ROUTER_DTYPES, ROUTER_SCORES, ROUTING_PARAMS,
                            SCHEDULES, SOURCES, SYNTHETIC_TASKS, image_tasks, param_names,
                            parse_tokenizer, synthetic_tasks, tokenizer_spec)
from moe_jax.parallel import ring_attention
from moe_jax.rl import advantages, environments, loss, rewards
from moe_jax.train import xla_flags


def _fail(field, value, accepted):
  raise ValueError(f"{field} must be {accepted}, got {value!r}")


def _positive_int(field, value):
  if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
    _fail(field, value, "a positive integer")


def _non_negative_int(field, value):
  if not isinstance(value, int) or isinstance(value, bool) or value < 0:
    _fail(field, value, "a non-negative integer")


def validate(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Raises ValueError naming the field, its value and what is accepted."""
  m = c.model
  for f in ("vocab_size", "d_model", "n_layers", "n_heads", "kda_head_dim", "kda_conv_size",
            "mla_kv_lora_rank", "mla_qk_head_dim", "mla_v_head_dim", "ffn_hidden"):
    _positive_int(f"model.{f}", m[f])
  if m.vocab_size < MIN_VOCAB:
    _fail("model.vocab_size", m.vocab_size, f">= {MIN_VOCAB} (byte tokenizer size)")
  if m.d_model % m.n_heads:
    _fail("model.n_heads", m.n_heads, f"a divisor of model.d_model={m.d_model}")
  pattern = m.layer_pattern
  if not isinstance(pattern, str) or not pattern or any(ch not in MIXERS for ch in pattern):
    _fail("model.layer_pattern", pattern,
          "a non-empty string of letters " + ", ".join(f"{k} ({v})" for k, v in MIXERS.items()))
  if m.dtype not in DTYPES:
    _fail("model.dtype", m.dtype, f"one of {DTYPES}")
  for f in ("kda_n_heads", "mla_qk_rope_dim"):
    _non_negative_int(f"model.{f}", m[f])
  if not isinstance(m.mla_latent_norm_eps, (int, float)) or m.mla_latent_norm_eps < 0:
    _fail("model.mla_latent_norm_eps", m.mla_latent_norm_eps, ">= 0 (0 = model.norm_eps)")
  theta = m.get("mla_rope_theta", 0.0)
  if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta < 0:
    _fail("model.mla_rope_theta", theta, "0 (NoPE) or a positive RoPE base such as 10000.0")
  if theta and (m.mla_qk_rope_dim <= 0 or m.mla_qk_rope_dim % 2):
    _fail("model.mla_qk_rope_dim", m.mla_qk_rope_dim,
          f"a positive even number of dims for RoPE to rotate (model.mla_rope_theta={theta})")
  for f in ("kda_output_gate_bias", "mla_output_gate"):
    if not isinstance(m[f], bool):
      _fail(f"model.{f}", m[f], "True or False")
  if m.mla_q_lora_rank < 0:
    _fail("model.mla_q_lora_rank", m.mla_q_lora_rank, "0 (full rank) or a positive integer")
  lb = m.kda_lower_bound
  if lb is not None and not -5.0 <= lb < 0.0:
    _fail("model.kda_lower_bound", lb, "in [-5, 0), or None for the legacy unbounded gate")
  chunk = m.kda_chunk_size
  if chunk not in (16, 32, 64, 128):
    _fail("model.kda_chunk_size", chunk, "one of (16, 32, 64, 128)")
  impls = ("", "xla", "recurrent", "pallas_gpu", "triton", "pallas_tpu")
  if m.kda_implementation not in impls:
    _fail("model.kda_implementation", m.kda_implementation, f"one of {impls}")
  conv_impls = ("", "xla", "triton")
  if m.get("kda_conv_implementation", "") not in conv_impls:
    _fail("model.kda_conv_implementation", m.kda_conv_implementation, f"one of {conv_impls}")
  if not isinstance(m.kda_gate_in_kernel, bool):
    _fail("model.kda_gate_in_kernel", m.kda_gate_in_kernel, "True or False")
  if m.attn_res not in ("none", "block", "full", "mix"):
    _fail("model.attn_res", m.attn_res, "one of ('none', 'block', 'full', 'mix')")
  if not isinstance(m.attn_res_block_size, int) or m.attn_res_block_size < 1:
    _fail("model.attn_res_block_size", m.attn_res_block_size, "a positive integer")
  if not 0.1 <= m.attn_res_mix_coef <= 0.3:
    _fail("model.attn_res_mix_coef", m.attn_res_mix_coef, "in [0.1, 0.3]")
  if m.mla_implementation not in ("", "xla", "gpu", "cudnn", "tpu"):
    _fail("model.mla_implementation", m.mla_implementation,
          "one of ('', 'xla', 'gpu', 'cudnn', 'tpu')")
  for f in ("remat", "scan_layers", "fused_projections"):
    if not isinstance(m.get(f), bool):
      _fail(f"model.{f}", m.get(f), "True or False")
  if m.remat_policy not in REMAT_POLICIES:
    _fail("model.remat_policy", m.remat_policy, f"one of {REMAT_POLICIES}")
  if not isinstance(m.get("remat_expert_rows", False), bool):
    _fail("model.remat_expert_rows", m.remat_expert_rows, "True or False")
  if m.decode_matmul not in ("xla", "pallas"):
    _fail("model.decode_matmul", m.decode_matmul, "one of ('xla', 'pallas')")
  if m.get("kda_decode", "auto") not in ("auto", "xla", "kernel"):
    _fail("model.kda_decode", m.kda_decode, "one of ('auto', 'xla', 'kernel')")
  if m.get("kda_decode") == "kernel":
    K = m.kda_head_dim
    if K < 16 or K & (K - 1):
      _fail("model.kda_head_dim", K, "a power of two >= 16 with model.kda_decode='kernel'")
    if m.kda_conv_size < 2:
      _fail("model.kda_conv_size", m.kda_conv_size, ">= 2 with model.kda_decode='kernel'")

  _validate_moe(c)
  _validate_vision(c)

  d = c.data
  if d.source not in SOURCES:
    _fail("data.source", d.source, f"one of {SOURCES}")
  _validate_corpus(c)
  if d.source == "tasks" or "rl" in c:
    environments.make_tasks(d)
  _positive_int("data.seq_len", d.seq_len)
  _positive_int("data.batch_size", d.batch_size)
  for f in ("read_threads", "prefetch_batches"):
    _non_negative_int(f"data.{f}", d[f])
  if not 0 < d.val_percent < 100:
    _fail("data.val_percent", d.val_percent, "in (0, 100)")
  shards = max(c.mesh.sequence, 1)
  if d.seq_len % shards:
    _fail("data.seq_len", d.seq_len, f"a multiple of mesh.sequence = {shards}")
  per_shard = d.seq_len // shards
  if ("A" in pattern and shards > 1 and per_shard > ring_attention.SUB
      and per_shard % ring_attention.MIN_SUB):
    _fail("data.seq_len", d.seq_len, f"such that seq_len / mesh.sequence ({per_shard}) is at "
          f"most {ring_attention.SUB} or a multiple of {ring_attention.MIN_SUB} (ring "
          "attention's sub-blocks)")
  if "K" in pattern and d.seq_len % (chunk * max(c.mesh.sequence, 1)):
    _fail("data.seq_len", d.seq_len,
          f"a multiple of model.kda_chunk_size * mesh.sequence = {chunk * max(c.mesh.sequence, 1)}"
          " (each sequence shard holds whole KDA chunks)")
  if not 0.0 <= d.synthetic_fraction < 1.0:
    _fail("data.synthetic_fraction", d.synthetic_fraction, "in [0, 1)")
  tasks = synthetic_tasks(d)
  if d.synthetic_fraction and (not tasks or any(t not in SYNTHETIC_TASKS for t in tasks)):
    _fail("data.synthetic_tasks", d.synthetic_tasks,
          f"a comma-separated list of {SYNTHETIC_TASKS} when data.synthetic_fraction > 0")
  if d.synthetic_fraction and d.source == "mqar":
    _fail("data.synthetic_fraction", d.synthetic_fraction, "0 with data.source='mqar'")
  if ((d.source == "mqar" or (d.synthetic_fraction and "mqar" in tasks))
      and 4 * d.mqar_num_pairs + 1 > d.seq_len):
    _fail("data.mqar_num_pairs", d.mqar_num_pairs,
          f"at most (data.seq_len - 1) // 4 = {(d.seq_len - 1) // 4}")

  s = c.schedule
  if s.kind not in SCHEDULES:
    _fail("schedule.kind", s.kind, f"one of {SCHEDULES}")
  _positive_int("schedule.total_steps", s.total_steps)
  if not 0 <= s.warmup_steps < s.total_steps:
    _fail("schedule.warmup_steps", s.warmup_steps,
          f"in [0, schedule.total_steps={s.total_steps})")
  if not 0.0 < s.decay_fraction <= 1.0:
    _fail("schedule.decay_fraction", s.decay_fraction, "in (0, 1]")
  if c.optim.learning_rate <= 0:
    _fail("optim.learning_rate", c.optim.learning_rate, "> 0")
  for f in ("every_steps", "num_batches"):
    _positive_int(f"eval.{f}", c.eval[f])
  if c.optim.router_grad_clip_norm < 0:
    _fail("optim.router_grad_clip_norm", c.optim.router_grad_clip_norm, ">= 0 (0 = off)")
  _positive_int("checkpoint.every_steps", c.checkpoint.every_steps)
  _positive_int("checkpoint.max_to_keep", c.checkpoint.max_to_keep)
  _validate_guard(c.train.guard)
  if not isinstance(c.train.get("split_step"), bool):
    _fail("train.split_step", c.train.get("split_step"), "True or False")
  if not xla_flags.is_memory_fraction(c.train.get("memory_fraction", 0.0)):
    _fail("train.memory_fraction", c.train.memory_fraction,
          "a number in [0, 1] (0: JAX's default, 0.75)")
  if "rl" in c:
    _validate_rl(c)
  for axis in MESH_AXES:
    size = c.mesh[axis]
    if not isinstance(size, int) or (size <= 0 and size != -1):
      _fail(f"mesh.{axis}", size, "a positive integer or -1 (all remaining devices)")
  if sum(c.mesh[a] == -1 for a in MESH_AXES) > 1:
    _fail("mesh", {a: c.mesh[a] for a in MESH_AXES}, "at most one axis set to -1")
  return c


def _validate_corpus(c: ml_collections.ConfigDict):
  """Paths, text field and tokenizer of the text sources (data/records.py, prepared.py,
  tokenizers.py)."""
  d = c.data
  if d.source in GLOB_SOURCES and not d.paths:
    _fail("data.paths", d.paths, f"a glob of {d.source} files when data.source={d.source!r}")
  if d.source == "prepared" and not d.paths:
    _fail("data.paths", d.paths, "a directory written by scripts/prepare_data.py")
  if d.source in ("jsonl", "parquet") and (not isinstance(d.text_field, str) or not d.text_field):
    _fail("data.text_field", d.text_field, "the name of the records' text field")
  tok = d.tokenizer
  if parse_tokenizer(tok)[0] != "bytes":
    if d.source not in DOCUMENT_SOURCES + ("prepared",):
      _fail("data.tokenizer", tok, f"'bytes' with data.source={d.source!r} (a learned "
            f"tokenizer reads text sources: {DOCUMENT_SOURCES + ('prepared',)})")
    for field, value in (("data.synthetic_fraction", d.synthetic_fraction),
                         ("data.image_fraction", d.image_fraction),
                         ("model.vision.patch_size", c.model.vision.patch_size)):
      if value:
        _fail(field, value, f"0 with data.tokenizer={tok!r} (byte-level tasks and images "
              "need the byte tokenizer)")
    if "rl" in c:
      _fail("data.tokenizer", tok, "'bytes' for GRPO (its tasks are byte-level)")
  if d.source == "prepared":
    meta = prepared.read_meta(d.paths)
    if d.seq_len != meta["seq_len"]:
      _fail("data.seq_len", d.seq_len, f"{meta['seq_len']}, as {d.paths!r} was prepared with "
            "(or prepare the corpus again)")
    if tokenizer_spec(tok) != tokenizer_spec(meta["tokenizer"]):
      _fail("data.tokenizer", tok, f"{meta['tokenizer']!r}, as {d.paths!r} was prepared with "
            "(or prepare the corpus again)")


def _validate_vision(c: ml_collections.ConfigDict):
  """model.vision (model/vision.py) and the image documents of data.image_fraction."""
  v, d = c.model.vision, c.data
  if not isinstance(v.patch_size, int) or isinstance(v.patch_size, bool) or v.patch_size < 0:
    _fail("model.vision.patch_size", v.patch_size, "0 (text only) or a positive integer")
  if v.patch_size:
    for f in ("channels", "max_rows", "max_cols"):
      _positive_int(f"model.vision.{f}", v[f])
    if c.model.vocab_size < tokenizer.MULTIMODAL_VOCAB_SIZE:
      _fail("model.vocab_size", c.model.vocab_size,
            f">= {tokenizer.MULTIMODAL_VOCAB_SIZE} with model.vision.patch_size > 0 (the image "
            "markers follow the bytes and BOS/EOS/PAD)")
  if not v.patch_loss_weight >= 0:
    _fail("model.vision.patch_loss_weight", v.patch_loss_weight, ">= 0")
  if not 0.0 <= d.image_fraction < 1.0:
    _fail("data.image_fraction", d.image_fraction, "in [0, 1)")
  if not d.image_fraction:
    return
  if not v.patch_size:
    _fail("data.image_fraction", d.image_fraction, "0 while model.vision.patch_size is 0 (a "
          "text-only model)")
  if d.source not in ("stdlib", "stdlib_packages", "files"):
    _fail("data.source", d.source, "a text source (stdlib, stdlib_packages, files) with "
          "data.image_fraction > 0")
  if d.synthetic_fraction:
    _fail("data.synthetic_fraction", d.synthetic_fraction, "0 with data.image_fraction > 0")
  tasks = image_tasks(d)
  if not tasks or any(t not in tasks_lib.TASKS for t in tasks):
    _fail("data.image_tasks", d.image_tasks, f"a comma-separated list of {tasks_lib.TASKS}")
  if v.channels != 1:
    _fail("model.vision.channels", v.channels, "1 with data.image_tasks (grey images)")
  for t in tasks:
    H, W = tasks_lib.IMAGE_HW[t]
    if H % v.patch_size or W % v.patch_size:
      _fail("model.vision.patch_size", v.patch_size, f"a divisor of the {t} images' {H}×{W}")
    if H // v.patch_size > v.max_rows or W // v.patch_size > v.max_cols:
      _fail("model.vision.max_rows/max_cols", (v.max_rows, v.max_cols),
            f"at least the {t} images' {H // v.patch_size}×{W // v.patch_size} patches")


def _validate_rl(c: ml_collections.ConfigDict):
  """GRPO's fields (configs/grpo.py, moe_jax/rl/)."""
  rl = c.rl
  for f in ("steps", "prompts_per_step", "max_prompt_tokens", "max_new_tokens", "max_turns",
            "max_tool_tokens", "passes", "eval_every", "eval_prompts"):
    _positive_int(f"rl.{f}", rl[f])
  if not isinstance(rl.eval_samples, int) or rl.eval_samples < 0:
    _fail("rl.eval_samples", rl.eval_samples, "an integer >= 0 (0 = greedy pass@1 only)")
  if not isinstance(rl.group_size, int) or rl.group_size < 2:
    _fail("rl.group_size", rl.group_size, "an integer >= 2 (advantages compare a group)")
  rows, micro = rl.prompts_per_step * rl.group_size, rl.get("micro_batch", 0)
  if not isinstance(micro, int) or micro < 0 or (micro and rows % micro):
    _fail("rl.micro_batch", micro, f"0 (the whole batch) or a divisor of the {rows} rows of "
          "a rollout batch (rl.prompts_per_step × rl.group_size)")
  if not rl.temperature > 0:
    _fail("rl.temperature", rl.temperature, "> 0 (rollouts sample)")
  if not rl.learning_rate > 0:
    _fail("rl.learning_rate", rl.learning_rate, "> 0")
  if not 0 < rl.clip_low < 1:
    _fail("rl.clip_low", rl.clip_low, "in (0, 1)")
  if not rl.clip_high > 0:
    _fail("rl.clip_high", rl.clip_high, "> 0")
  if rl.kl_coef < 0:
    _fail("rl.kl_coef", rl.kl_coef, ">= 0 (0 = no reference model)")
  if rl.advantage_scale not in advantages.SCALES:
    _fail("rl.advantage_scale", rl.advantage_scale, f"one of {advantages.SCALES}")
  if rl.loss_norm not in loss.NORMS:
    _fail("rl.loss_norm", rl.loss_norm, f"one of {loss.NORMS}")
  if rl.routing_replay and not rl.record_routes:
    _fail("rl.routing_replay", rl.routing_replay, "False when rl.record_routes is False "
          "(replay needs the recorded routes)")
  rewards.parse(rl.rewards)
  every = rl.get("warmup_check_every", 0)
  if not isinstance(every, int) or isinstance(every, bool) or every < 0:
    _fail("rl.warmup_check_every", every, "an integer >= 0 (0 = the warm-up's whole schedule)")
  if every:
    _positive_int("rl.warmup_check_prompts", rl.get("warmup_check_prompts"))
    low = rl.get("warmup_min_pass1", -1)
    if not 0 < low <= 1:
      _fail("rl.warmup_min_pass1", low, "in (0, 1]")
    high = rl.get("warmup_max_pass1", 1.0)
    if not low <= high <= 1:
      _fail("rl.warmup_max_pass1", high, f"in [rl.warmup_min_pass1 = {low}, 1]")


def _validate_guard(g: ml_collections.ConfigDict):
  if not g.spike_factor > 1:
    _fail("train.guard.spike_factor", g.spike_factor, "> 1")
  for f in ("ema_steps", "max_skipped"):
    _positive_int(f"train.guard.{f}", g[f])
  for f in ("warmup_steps", "skip_batches", "max_rollbacks"):
    _non_negative_int(f"train.guard.{f}", g[f])


def _validate_moe(c: ml_collections.ConfigDict):
  e = c.model.moe
  if not isinstance(e.num_experts, int) or e.num_experts < 0:
    _fail("model.moe.num_experts", e.num_experts, "0 (dense FFN) or a positive integer")
  if not e.num_experts:
    return
  for f in ("top_k", "expert_hidden", "ema_window"):
    _positive_int(f"model.moe.{f}", e[f])
  if e.top_k > e.num_experts:
    _fail("model.moe.top_k", e.top_k, f"at most model.moe.num_experts={e.num_experts}")
  for f in ("num_shared", "first_dense"):
    _non_negative_int(f"model.moe.{f}", e[f])
  for f, accepted in (("score", ROUTER_SCORES), ("router_dtype", ROUTER_DTYPES),
                      ("dispatch", DISPATCH),
                      ("decode_dispatch", DECODE_DISPATCH),
                      ("grouped_matmul", GROUPED_MATMULS), ("balancer", BALANCERS)):
    if e[f] not in accepted:
      _fail(f"model.moe.{f}", e[f], f"one of {accepted}")
  for f in ("swiglu_grad_in_kernel", "weights_before_down"):
    if not isinstance(e.get(f, False), bool):
      _fail(f"model.moe.{f}", e[f], "True or False")
  for f in ("route_scale", "router_init_scale", "capacity_factor", "bias_clamp",
            "ep_buffer_factor"):
    if not e[f] > 0:
      _fail(f"model.moe.{f}", e[f], "> 0")
  for f in ("router_init_reg", "z_loss", "aux_loss_coef", "bias_rate", "quantile_step"):
    if e[f] < 0:
      _fail(f"model.moe.{f}", e[f], ">= 0")
  if not 0 < e.exact_damping <= 1:
    _fail("model.moe.exact_damping", e.exact_damping, "in (0, 1]")
  if not isinstance(e.latent_dim, int) or isinstance(e.latent_dim, bool) or e.latent_dim < 0:
    _fail("model.moe.latent_dim", e.latent_dim, "0 (off) or a positive integer")
  latent = ("latent_down", "latent_norm", "latent_up")
  for field, spec, accepted in (
      ("model.moe.init_reg_params", e.init_reg_params, INIT_REG_PARAMS),
      ("optim.router_clip_params", c.optim.router_clip_params, ROUTING_PARAMS)):
    names = param_names(str(spec))
    if not names or any(n not in accepted for n in names):
      _fail(field, spec, f"comma-separated names from {accepted}")
    if not e.latent_dim and any(n in latent for n in names):
      _fail(field, spec, f"free of {latent} while model.moe.latent_dim is 0 (no latent MoE)")
  ep = c.mesh.expert
  if ep > 1 and e.num_experts % ep:
    _fail("mesh.expert", ep, f"a divisor of model.moe.num_experts={e.num_experts}")
  if e.get("weights_before_down", False) and (e.dispatch != "dropless" or ep > 1):
    _fail("model.moe.weights_before_down", True,
          f"False unless model.moe.dispatch is 'dropless' on one expert shard (mesh.expert 1); "
          f"got dispatch {e.dispatch!r}, mesh.expert {ep}")
