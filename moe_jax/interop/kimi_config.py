"""Kimi Linear's config.json ⇄ a moe_jax run config.

Reads both forms a Kimi-Linear config.json takes: the released one (Moonshot's,
`linear_attn_config.kda_layers` / `full_attn_layers` 1-based, `first_k_dense_replace`,
`num_experts`...) and the one transformers writes (the same plus `layer_types`,
`mlp_layer_types`). Anything the two models would compute differently is refused with a
ValueError naming the field, in both directions: nothing is silently dropped.
"""

import ml_collections

from configs import base
from moe_jax.data import tokenizer
from moe_jax.model.kda import kda_heads
from moe_jax.model.transformer import mixer_kind

MODEL_TYPE = "kimi_linear"
KINDS = {"linear_attention": "K", "full_attention": "A"}
# transformers' KimiLinearAttention builds kv_a_layernorm / q_a_layernorm with the RMSNorm
# default, 1e-6, not config.rms_norm_eps (as DeepSeek-V3 does).
LATENT_NORM_EPS = 1e-6


def _fail(field, value, accepted):
  raise ValueError(f"{field} must be {accepted}, got {value!r}")


def _get(hf: dict, *names, default=None):
  """The first of `names` (a field and its aliases, transformers' attribute_map) present."""
  for n in names:
    if n in hf and hf[n] is not None:
      return hf[n]
  return default


def layer_kinds(hf: dict) -> str:
  """One letter a layer, K (KDA) or A (MLA): from layer_types, else linear_attn_config's
  1-based kda_layers / full_attn_layers, else transformers' default (MLA at 0-based
  4, 8, ...)."""
  L = hf["num_hidden_layers"]
  types = hf.get("layer_types")
  if types is None:
    lac = hf.get("linear_attn_config") or {}
    if "kda_layers" in lac and "full_attn_layers" in lac:
      types = [None] * L
      for kind, key in (("linear_attention", "kda_layers"), ("full_attention", "full_attn_layers")):
        for layer in lac[key]:
          if not 1 <= layer <= L:
            _fail(f"linear_attn_config.{key}", lac[key], f"1-based layer numbers in [1, {L}]")
          if types[layer - 1] is not None:
            _fail("linear_attn_config", lac, "each layer in exactly one of kda_layers, "
                  "full_attn_layers")
          types[layer - 1] = kind
    else:
      types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(L)]
  if len(types) != L or any(t not in KINDS for t in types):
    _fail("layer_types", types, f"{L} entries of {tuple(KINDS)}")
  return "".join(KINDS[t] for t in types)


def first_dense(hf: dict) -> int:
  """How many leading layers have a dense FFN (the rest MoE)."""
  L = hf["num_hidden_layers"]
  types = hf.get("mlp_layer_types")
  if types is None:
    if _get(hf, "moe_layer_freq", default=1) != 1:
      _fail("moe_layer_freq", hf["moe_layer_freq"], "1 (MoE in every layer after the dense ones)")
    return min(_get(hf, "first_k_dense_replace", default=1), L)
  n = 0
  while n < len(types) and types[n] == "dense":
    n += 1
  if types != ["dense"] * n + ["sparse"] * (L - n):
    _fail("mlp_layer_types", types, "'dense' layers first, then 'sparse' ones")
  return n


def from_hf(hf: dict) -> ml_collections.ConfigDict:
  """A Kimi-Linear config.json (as a dict) → a run config (configs/base.py plus the
  model's fields). Fields that change nothing in the forward (ids, lengths, dtypes) are
  kept by the caller's template, not here."""
  if hf.get("model_type") != MODEL_TYPE:
    _fail("model_type", hf.get("model_type"), repr(MODEL_TYPE))
  checks = {  # field: (value, accepted values, what is accepted)
      "hidden_act": (_get(hf, "hidden_act", default="silu"), ("silu",), "'silu'"),
      "tie_word_embeddings": (_get(hf, "tie_word_embeddings", default=False), (False,),
                              "false (moe_jax's tied head is scaled by 1/sqrt(d_model))"),
      "attention_bias": (_get(hf, "attention_bias", default=False), (False,), "false"),
      "mla_use_nope": (_get(hf, "mla_use_nope", default=True), (True,),
                       "true (moe_jax's MLA has no rotary embedding)"),
      "moe_renormalize": (_get(hf, "moe_renormalize", "norm_topk_prob", default=True), (True,),
                          "true (top-k weights renormalised)"),
      "moe_router_activation_func": (_get(hf, "moe_router_activation_func", default="sigmoid"),
                                     ("sigmoid",), "'sigmoid'"),
  }
  for field, (value, ok, accepted) in checks.items():
    if value not in ok:
      _fail(field, value, accepted)
  heads = hf["num_attention_heads"]
  if _get(hf, "num_key_value_heads", default=heads) != heads:
    _fail("num_key_value_heads", hf["num_key_value_heads"],
          f"num_attention_heads={heads} (MLA expands every head from the latent)")
  groups = _get(hf, "num_expert_group", "n_group", default=1)
  if groups != 1 and _get(hf, "topk_group", default=1) != groups:
    _fail("topk_group", hf.get("topk_group"), f"num_expert_group={groups} (group-limited "
          "routing is not implemented; with every group kept it is plain top-k)")
  shared = _get(hf, "num_shared_experts", "n_shared_experts", default=1)
  if shared < 1:
    _fail("num_shared_experts", shared, ">= 1")
  lac = hf.get("linear_attn_config") or {}

  c = base.get_config()
  m = c.model
  m.vocab_size = hf["vocab_size"]
  m.d_model = hf["hidden_size"]
  m.n_layers = hf["num_hidden_layers"]
  m.layer_pattern = layer_kinds(hf)
  m.n_heads = heads
  m.norm_eps = float(_get(hf, "rms_norm_eps", default=1e-5))
  m.tie_embeddings = False
  m.kda_n_heads = _get(hf, "linear_num_heads", default=lac.get("num_heads", 32))
  m.kda_head_dim = _get(hf, "linear_head_dim", default=lac.get("head_dim", 128))
  m.kda_conv_size = _get(hf, "linear_conv_kernel_dim",
                         default=lac.get("short_conv_kernel_size", 4))
  m.kda_lower_bound = None          # -exp(A_log)·softplus(f + dt_bias)
  m.kda_output_gate_bias = False
  m.mla_q_lora_rank = _get(hf, "q_lora_rank", default=0)
  m.mla_kv_lora_rank = hf["kv_lora_rank"]
  m.mla_qk_head_dim = hf["qk_nope_head_dim"]
  m.mla_qk_rope_dim = _get(hf, "qk_rope_head_dim", default=0)
  m.mla_v_head_dim = hf["v_head_dim"]
  m.mla_output_gate = False
  m.mla_latent_norm_eps = LATENT_NORM_EPS
  m.ffn_hidden = hf["intermediate_size"]
  m.attn_res = "none"
  e = m.moe
  e.num_experts = _get(hf, "num_experts", "num_local_experts", "n_routed_experts")
  e.top_k = _get(hf, "num_experts_per_token", "num_experts_per_tok")
  e.num_shared = shared
  e.expert_hidden = hf["moe_intermediate_size"]
  e.first_dense = first_dense(hf)
  e.score = "sigmoid"
  e.route_scale = float(_get(hf, "routed_scaling_factor", default=1.0))
  e.latent_dim = 0
  e.balancer = "loss_free"          # e_score_correction_bias is an aux-loss-free bias
  return c


def refuse_unmapped(m):
  """Raises ValueError for a moe_jax model field Kimi Linear (transformers 5.23's
  kimi_linear) has no counterpart for: exporting it would change the maths."""
  checks = (  # (field, value, the value Kimi Linear computes)
      ("model.kda_lower_bound", m.kda_lower_bound, None),
      ("model.kda_output_gate_bias", m.get("kda_output_gate_bias", True), False),
      ("model.mla_output_gate", m.get("mla_output_gate", True), False),
      ("model.attn_res", m.attn_res, "none"),
      ("model.tie_embeddings", m.tie_embeddings, False),
      ("model.mla_rope_theta", m.get("mla_rope_theta", 0.0), 0.0),
      ("model.vision.patch_size", m.vision.patch_size, 0),
      ("model.moe.latent_dim", m.moe.latent_dim, 0),
      ("model.moe.score", m.moe.score, "sigmoid"),
      ("model.mla_latent_norm_eps", m.get("mla_latent_norm_eps", 0.0) or m.norm_eps,
       LATENT_NORM_EPS),
  )
  for field, value, kimi in checks:
    if value != kimi:
      raise ValueError(f"{field}={value!r} has no counterpart in Kimi Linear's config "
                       f"(transformers 5.23 kimi_linear); only {kimi!r} can be exported")
  if m.moe.num_experts <= 0 or m.moe.num_shared < 1:
    raise ValueError(f"model.moe.num_experts={m.moe.num_experts}, num_shared="
                     f"{m.moe.num_shared}: Kimi Linear has routed experts and >= 1 shared")


def to_hf(c: ml_collections.ConfigDict, template: dict | None = None) -> dict:
  """A run config → Kimi-Linear config.json fields, in the released form (which
  transformers' from_pretrained and Moonshot's remote code both read). `template`: a
  config.json whose other fields (token ids, dtype, max length...) are kept."""
  m = c.model
  refuse_unmapped(m)
  L, pattern = m.n_layers, "".join(mixer_kind(m, i) for i in range(m.n_layers))
  hf = dict(template or {})
  for stale in ("layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim",
                "linear_conv_kernel_dim", "qk_head_dim"):
    hf.pop(stale, None)   # derived fields: rebuilt from the ones below by the reader
  if "attention_bias" in hf:
    hf["attention_bias"] = False
  hf.setdefault("architectures", ["KimiLinearForCausalLM"])
  # Without a template, the special ids of moe_jax's byte tokenizer (transformers' defaults
  # are Kimi's, past the end of a small vocabulary).
  for field, default in (("bos_token_id", tokenizer.BOS), ("eos_token_id", tokenizer.EOS),
                         ("pad_token_id", tokenizer.PAD)):
    hf.setdefault(field, default)
  hf.update(
      model_type=MODEL_TYPE, vocab_size=m.vocab_size, hidden_size=m.d_model,
      num_hidden_layers=L, num_attention_heads=m.n_heads, num_key_value_heads=m.n_heads,
      rms_norm_eps=m.norm_eps, tie_word_embeddings=False, hidden_act="silu", mla_use_nope=True,
      q_lora_rank=m.mla_q_lora_rank or None, kv_lora_rank=m.mla_kv_lora_rank,
      qk_nope_head_dim=m.mla_qk_head_dim, qk_rope_head_dim=m.get("mla_qk_rope_dim", 0),
      v_head_dim=m.mla_v_head_dim, intermediate_size=m.ffn_hidden,
      moe_intermediate_size=m.moe.expert_hidden, num_experts=m.moe.num_experts,
      num_experts_per_token=m.moe.top_k, num_shared_experts=m.moe.num_shared,
      first_k_dense_replace=min(m.moe.first_dense, L), moe_layer_freq=1,
      moe_renormalize=True, moe_router_activation_func="sigmoid",
      routed_scaling_factor=m.moe.route_scale, use_grouped_topk=True, num_expert_group=1,
      topk_group=1,
      linear_attn_config={
          "kda_layers": [i + 1 for i in range(L) if pattern[i] == "K"],
          "full_attn_layers": [i + 1 for i in range(L) if pattern[i] == "A"],
          "num_heads": kda_heads(m), "head_dim": m.kda_head_dim,
          "short_conv_kernel_size": m.kda_conv_size})
  return hf
