"""Kimi Linear's tensors ⇄ moe_jax's variables, one layer at a time (numpy, host memory).

Two HF namings exist for the same weights:
  released  Kimi-Linear-48B-A3B's safetensors, and what transformers' save_pretrained
            writes: `block_sparse_moe.experts.E.w1|w2|w3`, `self_attn.q_conv1d`,
            `self_attn.A_log` (transformers writes its dense first layer under
            `block_sparse_moe.` too; the release under `mlp.`);
  native    transformers' in-memory modules: `mlp.experts.gate_up_proj` [E, 2F, D],
            `self_attn.conv1d` (q, k, v stacked), `self_attn.forget_gate.*`.
Reading accepts either; writing takes one. torch's Linear stores [out, in]; moe_jax's
kernels are [in, *out]. A torch causal conv1d weight [C, 1, W] multiplies x[t-W+1+i] by
w[i]; moe_jax's ShortConv kernel [W, C] multiplies x[t-j] by w[j]: the taps are reversed.
"""

import numpy as np

from moe_jax.fields import is_moe
from moe_jax.model.kda import kda_heads, split_projection_params
from moe_jax.model.transformer import mixer_kind

NAMINGS = ("released", "native")


def _t(w):          # torch [out, in] → [in, out]
  return np.ascontiguousarray(w.T)


def _split_out(w, *shape):   # torch [prod(shape), in] → [in, *shape]
  return np.ascontiguousarray(w.T.reshape(w.shape[1], *shape))


def _merge_in(w):   # [*in, out] → torch [out, prod(in)]
  return np.ascontiguousarray(w.reshape(-1, w.shape[-1]).T)


def _merge_out(w):  # [in, *out] → torch [prod(out), in]
  return np.ascontiguousarray(w.reshape(w.shape[0], -1).T)


def _conv_to_ours(w_Cx1xW):
  return np.ascontiguousarray(w_Cx1xW[:, 0, ::-1].T)


def _conv_to_hf(w_WxC):
  return np.ascontiguousarray(w_WxC[::-1].T[:, None, :])


class Reader:
  """get(*names): the first of the candidate names the checkpoint holds, as numpy."""

  def __init__(self, get_tensor, names):
    self._get, self.names, self.used = get_tensor, set(names), set()

  def get(self, *names):
    for n in names:
      if n in self.names:
        self.used.add(n)
        return self._get(n)
    raise KeyError(f"the checkpoint has none of {names}")

  def has(self, name) -> bool:
    return name in self.names


def _kda_to_ours(m, r: Reader, p: str) -> dict:
  H, K = kda_heads(m), m.kda_head_dim
  out = {f"{x}_proj": {"kernel": _t(r.get(f"{p}{x}_proj.weight"))} for x in "qkv"}
  if r.has(f"{p}conv1d.weight"):
    convs = np.split(r.get(f"{p}conv1d.weight"), 3, axis=0)
  else:
    convs = [r.get(f"{p}{x}_conv1d.weight") for x in "qkv"]
  for x, w in zip("qkv", convs):
    out[f"{x}_conv"] = {"kernel": _conv_to_ours(w)}
  gate = lambda n: r.get(f"{p}{n}", f"{p}forget_gate.{n}")
  out["A_log"] = gate("A_log").reshape(H)
  out["dt_bias"] = gate("dt_bias").reshape(H * K)
  out["f_a"] = {"kernel": _t(gate("f_a_proj.weight"))}
  out["f_b"] = {"kernel": _split_out(gate("f_b_proj.weight"), H, K)}
  out["b_proj"] = {"kernel": _t(r.get(f"{p}b_proj.weight"))}
  out["g_a"] = {"kernel": _t(r.get(f"{p}g_a_proj.weight"))}
  out["g_b"] = {"kernel": _split_out(r.get(f"{p}g_b_proj.weight"), H, K)}
  out["o_norm"] = {"scale": r.get(f"{p}o_norm.weight")}
  out["o_proj"] = {"kernel": _t(r.get(f"{p}o_proj.weight")).reshape(H, K, -1)}
  return out


def _kda_to_hf(m, w: dict, p: str, naming: str) -> dict:
  H = kda_heads(m)
  w = split_projection_params(w, H, m.kda_head_dim)   # model.fused_projections' layout
  out = {f"{p}{x}_proj.weight": _t(w[f"{x}_proj"]["kernel"]) for x in "qkv"}
  convs = [_conv_to_hf(w[f"{x}_conv"]["kernel"]) for x in "qkv"]
  gp = p if naming == "released" else f"{p}forget_gate."
  if naming == "released":
    out.update({f"{p}{x}_conv1d.weight": c for x, c in zip("qkv", convs)})
  else:
    out[f"{p}conv1d.weight"] = np.concatenate(convs, 0)
  out[f"{gp}A_log"] = w["A_log"].reshape(1, 1, H, 1)
  out[f"{gp}dt_bias"] = w["dt_bias"]
  out[f"{gp}f_a_proj.weight"] = _t(w["f_a"]["kernel"])
  out[f"{gp}f_b_proj.weight"] = _merge_out(w["f_b"]["kernel"])
  out[f"{p}b_proj.weight"] = _t(w["b_proj"]["kernel"])
  out[f"{p}g_a_proj.weight"] = _t(w["g_a"]["kernel"])
  out[f"{p}g_b_proj.weight"] = _merge_out(w["g_b"]["kernel"])
  out[f"{p}o_norm.weight"] = w["o_norm"]["scale"]
  out[f"{p}o_proj.weight"] = _merge_in(w["o_proj"]["kernel"])
  return out


def _mla_to_ours(m, r: Reader, p: str) -> dict:
  H = m.n_heads
  Dn, Dr, Dv = m.mla_qk_head_dim, m.get("mla_qk_rope_dim", 0), m.mla_v_head_dim
  out = {}
  if m.mla_q_lora_rank:
    out["q_a"] = {"kernel": _t(r.get(f"{p}q_a_proj.weight"))}
    out["q_a_norm"] = {"scale": r.get(f"{p}q_a_layernorm.weight")}
    out["q_b"] = {"kernel": _split_out(r.get(f"{p}q_b_proj.weight"), H, Dn + Dr)}
  else:
    out["q_proj"] = {"kernel": _split_out(r.get(f"{p}q_proj.weight"), H, Dn + Dr)}
  out["kv_a"] = {"kernel": _t(r.get(f"{p}kv_a_proj_with_mqa.weight"))}
  out["kv_a_norm"] = {"scale": r.get(f"{p}kv_a_layernorm.weight")}
  kv_b = _split_out(r.get(f"{p}kv_b_proj.weight"), H, Dn + Dv)   # [R, H, Dn + Dv]
  out["k_b"] = {"kernel": np.ascontiguousarray(kv_b[..., :Dn])}
  out["v_b"] = {"kernel": np.ascontiguousarray(kv_b[..., Dn:])}
  out["o_proj"] = {"kernel": _t(r.get(f"{p}o_proj.weight")).reshape(H, Dv, -1)}
  return out


def _mla_to_hf(m, w: dict, p: str) -> dict:
  out = {}
  if m.mla_q_lora_rank:
    out[f"{p}q_a_proj.weight"] = _t(w["q_a"]["kernel"])
    out[f"{p}q_a_layernorm.weight"] = w["q_a_norm"]["scale"]
    out[f"{p}q_b_proj.weight"] = _merge_out(w["q_b"]["kernel"])
  else:
    out[f"{p}q_proj.weight"] = _merge_out(w["q_proj"]["kernel"])
  out[f"{p}kv_a_proj_with_mqa.weight"] = _t(w["kv_a"]["kernel"])
  out[f"{p}kv_a_layernorm.weight"] = w["kv_a_norm"]["scale"]
  kv_b = np.concatenate([w["k_b"]["kernel"], w["v_b"]["kernel"]], -1)
  out[f"{p}kv_b_proj.weight"] = _merge_out(kv_b)
  out[f"{p}o_proj.weight"] = _merge_in(w["o_proj"]["kernel"])
  return out


_SWIGLU = (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj"))


def _moe_to_ours(m, r: Reader, p: str):
  """(params, router state) of one MoE FFN; p ends in "layers.N."."""
  E = m.moe.num_experts
  q = f"{p}block_sparse_moe."
  if not r.has(f"{q}gate.weight"):
    q = f"{p}mlp."
  out = {"router_kernel": _t(r.get(f"{q}gate.weight"))}
  if r.has(f"{q}experts.gate_up_proj"):       # native: [E, 2F, D], [E, D, F]
    gu = r.get(f"{q}experts.gate_up_proj")
    E_, F2, D = gu.shape
    out["gate_up"] = np.ascontiguousarray(gu.reshape(E_, 2, F2 // 2, D).transpose(0, 3, 1, 2))
    out["down"] = np.ascontiguousarray(r.get(f"{q}experts.down_proj").transpose(0, 2, 1))
  else:                                       # released: one [F, D] / [D, F] per expert
    w1 = [r.get(f"{q}experts.{e}.w1.weight") for e in range(E)]
    w3 = [r.get(f"{q}experts.{e}.w3.weight") for e in range(E)]
    out["gate_up"] = np.stack([np.stack([a.T, b.T], 1) for a, b in zip(w1, w3)])
    out["down"] = np.stack([r.get(f"{q}experts.{e}.w2.weight").T for e in range(E)])
  out["shared"] = {ours: {"kernel": _t(r.get(f"{q}shared_experts.{hf}.weight"))}
                   for ours, hf in _SWIGLU}
  router = {"bias": r.get(f"{q}gate.e_score_correction_bias").astype(np.float32)}
  return out, router


def _moe_to_hf(w: dict, router: dict, p: str, naming: str) -> dict:
  q = f"{p}block_sparse_moe." if naming == "released" else f"{p}mlp."
  out = {f"{q}gate.weight": _t(w["router_kernel"]),
         f"{q}gate.e_score_correction_bias": router["bias"]}
  gu, down = w["gate_up"], w["down"]       # [E, D, 2, F], [E, F, D]
  if naming == "native":
    E, D, _, F = gu.shape
    out[f"{q}experts.gate_up_proj"] = np.ascontiguousarray(
        gu.transpose(0, 2, 3, 1).reshape(E, 2 * F, D))
    out[f"{q}experts.down_proj"] = np.ascontiguousarray(down.transpose(0, 2, 1))
  else:
    for e in range(gu.shape[0]):
      out[f"{q}experts.{e}.w1.weight"] = _t(gu[e, :, 0])
      out[f"{q}experts.{e}.w3.weight"] = _t(gu[e, :, 1])
      out[f"{q}experts.{e}.w2.weight"] = _t(down[e])
  out.update({f"{q}shared_experts.{hf}.weight": _t(w["shared"][ours]["kernel"])
              for ours, hf in _SWIGLU})
  return out


def _dense_to_ours(r: Reader, p: str) -> dict:
  get = lambda n: r.get(f"{p}mlp.{n}.weight", f"{p}block_sparse_moe.{n}.weight")
  return {"mlp": {ours: {"kernel": _t(get(hf))} for ours, hf in _SWIGLU}}


def layer_to_ours(m, i: int, r: Reader):
  """(params["layer_i"], router["layer_i"] or None) of layer i."""
  p = f"model.layers.{i}."
  mixer = (_kda_to_ours if mixer_kind(m, i) == "K" else _mla_to_ours)(m, r, f"{p}self_attn.")
  params = {"mixer_norm": {"scale": r.get(f"{p}input_layernorm.weight")},
            "mixer": mixer,
            "ffn_norm": {"scale": r.get(f"{p}post_attention_layernorm.weight")}}
  if is_moe(m, i):
    params["ffn"], router = _moe_to_ours(m, r, p)
    return params, {"ffn": router}
  params["ffn"] = _dense_to_ours(r, p)
  return params, None


def layer_to_hf(m, i: int, params: dict, router: dict | None, naming: str) -> dict:
  if naming not in NAMINGS:
    raise ValueError(f"naming must be one of {NAMINGS}, got {naming!r}")
  p = f"model.layers.{i}."
  out = {f"{p}input_layernorm.weight": params["mixer_norm"]["scale"],
         f"{p}post_attention_layernorm.weight": params["ffn_norm"]["scale"]}
  if mixer_kind(m, i) == "K":
    out.update(_kda_to_hf(m, params["mixer"], f"{p}self_attn.", naming))
  else:
    out.update(_mla_to_hf(m, params["mixer"], f"{p}self_attn."))
  if is_moe(m, i):
    out.update(_moe_to_hf(params["ffn"], router["ffn"], p, naming))
  else:
    out.update({f"{p}mlp.{hf}.weight": _t(params["ffn"]["mlp"][ours]["kernel"])
                for ours, hf in _SWIGLU})
  return out


def outer_to_ours(r: Reader) -> dict:
  return {"embed": {"embedding": r.get("model.embed_tokens.weight")},
          "final_norm": {"scale": r.get("model.norm.weight")},
          "lm_head": {"kernel": _t(r.get("lm_head.weight"))}}


def outer_to_hf(params: dict) -> dict:
  return {"model.embed_tokens.weight": params["embed"]["embedding"],
          "model.norm.weight": params["final_norm"]["scale"],
          "lm_head.weight": _t(params["lm_head"]["kernel"])}
