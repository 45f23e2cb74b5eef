"""The reference side of the Kimi Linear equivalence tests: Hugging Face transformers'
`kimi_linear` model (pure-PyTorch KDA path, fp32, CPU). Runs in the reference environment
(`make reference-env`: Python 3.11, torch, transformers 5.23.0), never in moe_jax's.

  python tests/kimi_reference.py make --out DIR
      a tiny random Kimi-Linear model built by transformers with a fixed seed, saved in
      the released tensor naming (DIR/released: experts.E.w1, q_conv1d, ...) and in
      transformers' in-memory one (DIR/native: experts.gate_up_proj, conv1d, forget_gate.*),
      both checked to load back to the same logits; and DIR/reference.npz: its logits,
      a greedy continuation and packed-document logits.
  python tests/kimi_reference.py logits --model DIR --tokens IN.npy --out OUT.npy
      [--mask MASK.npy]: logits of a saved checkpoint (from_pretrained) for given tokens.

tests/data/kimi_tiny holds `make`'s output; tests/test_kimi_hf.py compares moe_jax with it,
and in the second tier runs this script live.
"""

import argparse
import json
import os

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import KimiLinearConfig, KimiLinearForCausalLM

SEED = 0
# Released-form config.json fields (as Kimi-Linear-48B-A3B's), tiny sizes. Four layers: both
# kinds, a dense first layer, then MoE; MLA with shared qk_rope dims; odd KDA/MLA widths.
TINY = dict(
    architectures=["KimiLinearForCausalLM"], model_type="kimi_linear", vocab_size=300,
    hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None,
    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, mla_use_nope=True, hidden_act="silu",
    first_k_dense_replace=1, moe_layer_freq=1, num_experts=6, num_experts_per_token=2,
    num_shared_experts=1, moe_renormalize=True, moe_router_activation_func="sigmoid",
    routed_scaling_factor=2.446, use_grouped_topk=True, num_expert_group=1, topk_group=1,
    tie_word_embeddings=False, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    pad_token_id=0, model_max_length=1048576, torch_dtype="float32",
    linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": 3,
                        "head_dim": 16, "short_conv_kernel_size": 4})
TOKENS_SHAPE = (2, 40)     # batch, length: not a multiple of the 64-token KDA chunk
PROMPT_LEN, NEW_TOKENS = 8, 32
DOCS = (13, 20, 7)         # packed-document lengths (sum = TOKENS_SHAPE[1])


def build() -> KimiLinearForCausalLM:
  torch.manual_seed(SEED)
  model = KimiLinearForCausalLM(KimiLinearConfig(**TINY)).float().eval()
  # transformers initialises norms to 1 and the router bias to 0: move them, so a mapping
  # that dropped one would show in the logits.
  with torch.no_grad():
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
      if name.endswith("norm.weight") or "layernorm" in name:
        p.add_(0.2 * torch.randn_like(p))
      if name.endswith("e_score_correction_bias"):
        p.copy_(0.1 * torch.randn_like(p))
  return model


def released_state(model) -> dict:
  """The model's tensors in the released checkpoint's naming (Kimi-Linear-48B-A3B's
  safetensors): per-expert w1/w2/w3, separate q/k/v convs, the gate on self_attn."""
  out = {}
  for name, t in model.state_dict().items():
    t = t.detach().contiguous()
    if ".self_attn.conv1d.weight" in name:
      for part, piece in zip("qkv", t.chunk(3, dim=0)):
        out[name.replace(".conv1d.", f".{part}_conv1d.")] = piece.contiguous()
    elif ".self_attn.forget_gate." in name:
      out[name.replace(".forget_gate.", ".")] = t
    elif ".mlp.experts.gate_up_proj" in name:
      prefix = name.replace(".mlp.experts.gate_up_proj", ".block_sparse_moe.experts")
      gate, up = t.chunk(2, dim=1)
      for e in range(t.shape[0]):
        out[f"{prefix}.{e}.w1.weight"] = gate[e].contiguous()
        out[f"{prefix}.{e}.w3.weight"] = up[e].contiguous()
    elif ".mlp.experts.down_proj" in name:
      prefix = name.replace(".mlp.experts.down_proj", ".block_sparse_moe.experts")
      for e in range(t.shape[0]):
        out[f"{prefix}.{e}.w2.weight"] = t[e].contiguous()
    elif ".mlp.gate." in name or ".mlp.shared_experts." in name:
      out[name.replace(".mlp.", ".block_sparse_moe.")] = t
    else:
      out[name] = t
  return out


def write(state: dict, config: dict, out_dir: str):
  os.makedirs(out_dir, exist_ok=True)
  save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(config, f, indent=2, sort_keys=True)


@torch.no_grad()
def logits_of(model, tokens, mask=None) -> np.ndarray:
  t = torch.from_numpy(np.asarray(tokens, np.int64))
  m = None if mask is None else torch.from_numpy(np.asarray(mask, np.int64))
  return model(input_ids=t, attention_mask=m, use_cache=False).logits.float().numpy()


def make(out: str):
  model = build()
  native_state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
  write(released_state(model), TINY, os.path.join(out, "released"))
  write(native_state, TINY, os.path.join(out, "native"))
  rng = np.random.default_rng(SEED)
  tokens = rng.integers(3, TINY["vocab_size"], TOKENS_SHAPE)
  logits = logits_of(model, tokens)
  for naming in ("released", "native"):   # both namings load back to the same model
    again = KimiLinearForCausalLM.from_pretrained(os.path.join(out, naming)).float().eval()
    err = np.abs(logits_of(again, tokens) - logits).max()
    assert err == 0.0, f"{naming} checkpoint reloads with max logit error {err}"
  prompt = torch.from_numpy(tokens[:1, :PROMPT_LEN])
  greedy = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                          max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          eos_token_id=None, pad_token_id=0)[0, PROMPT_LEN:].numpy()
  # Packed documents: each document of row 0 run alone (no state, no attention across).
  bounds = np.cumsum((0,) + DOCS)
  packed = np.concatenate([logits_of(model, tokens[:1, a:b])[0]
                           for a, b in zip(bounds[:-1], bounds[1:])])
  # Right padding through the reference's attention mask: row 1 keeps its first 25 tokens.
  mask = np.ones(TOKENS_SHAPE, np.int64)
  mask[1, 25:] = 0
  padded = logits_of(model, np.where(mask, tokens, 0), mask)
  np.savez(os.path.join(out, "reference.npz"), tokens=tokens, logits=logits, greedy=greedy,
           prompt_len=PROMPT_LEN, doc_lengths=np.asarray(DOCS), packed_logits=packed,
           mask=mask, padded_logits_row1=padded[1, :25])
  print(f"wrote {out}: logits {logits.shape}, greedy {greedy.tolist()}")


def main():
  p = argparse.ArgumentParser()
  sub = p.add_subparsers(dest="cmd", required=True)
  m = sub.add_parser("make")
  m.add_argument("--out", required=True)
  g = sub.add_parser("logits")
  g.add_argument("--model", required=True)
  g.add_argument("--tokens", required=True)
  g.add_argument("--mask")
  g.add_argument("--out", required=True)
  a = p.parse_args()
  if a.cmd == "make":
    make(a.out)
  else:
    model = KimiLinearForCausalLM.from_pretrained(a.model).float().eval()
    mask = np.load(a.mask) if a.mask else None
    np.save(a.out, logits_of(model, np.load(a.tokens), mask))


if __name__ == "__main__":
  main()
