"""What a config's fields mean, for every module that reads them: the accepted values of
its enumerated fields, the parsers of its string fields, and is_moe. A leaf: it imports
nothing of the project, so the model, data, parallel and train modules all can, while
config.py (validate, called by the entry points) imports them."""

import os

import ml_collections

MIXERS = {"K": "KDA linear attention", "A": "gated MLA full attention"}
DTYPES = ("float32", "bfloat16")
SOURCES = ("stdlib", "stdlib_packages", "files", "jsonl", "parquet", "array_record", "prepared",
           "mqar", "tasks")
DOCUMENT_SOURCES = ("stdlib", "stdlib_packages", "files", "jsonl", "parquet", "array_record")
GLOB_SOURCES = ("files", "jsonl", "parquet", "array_record")   # data.paths is a glob
TOKENIZER_KINDS = ("bytes", "sentencepiece:<model file>", "hf:<tokenizer.json>",
                   "kimi:<tiktoken.model, or the directory holding it>")
SYNTHETIC_TASKS = ("passkey", "mqar")
SCHEDULES = ("cosine", "wsd")
MESH_AXES = ("data", "fsdp", "expert", "sequence", "tensor")
BALANCERS = ("none", "aux_loss", "loss_free", "quantile_ema", "quantile_exact")
ROUTER_SCORES = ("sigmoid", "softmax")
ROUTER_DTYPES = ("", "float32", "bfloat16")   # model.moe.router_dtype; "" = model.dtype
DISPATCH = ("dropless", "capacity")
DECODE_DISPATCH = ("auto", "gather", "grouped", "fused", "layer")
GROUPED_MATMULS = ("", "xla", "tokamax", "mosaic", "triton")
REMAT_POLICIES = ("full", "dots", "kernels", "residuals",   # model/remat.py
                  "residuals_recompute_prologue")
MIN_VOCAB = 259  # byte tokenizer: 256 bytes + BOS/EOS/PAD


# The MoE routing params a config may name (optim.router_clip_params, model.moe.init_reg_params).
ROUTING_PARAMS = ("router_kernel", "latent_down", "latent_norm", "latent_up")
INIT_REG_PARAMS = ("router_kernel", "latent_down")


def param_names(spec: str) -> tuple[str, ...]:
  """"router_kernel,latent_down" → ("router_kernel", "latent_down")."""
  return tuple(n.strip() for n in spec.split(",") if n.strip())


def is_moe(model: ml_collections.ConfigDict, layer: int | None = None) -> bool:
  """Whether `layer`'s FFN is a mixture of experts: from model.moe.first_dense on, and only
  with routed experts. Without a layer: whether the model has routed experts at all."""
  if model.moe.num_experts <= 0:
    return False
  return layer is None or layer >= model.moe.first_dense


def synthetic_tasks(data: ml_collections.ConfigDict) -> list[str]:
  """data.synthetic_tasks as a list ("passkey,mqar" → ["passkey", "mqar"])."""
  return [t for t in data.synthetic_tasks.split(",") if t]


def parse_tokenizer(spec) -> tuple[str, str]:
  """data.tokenizer → (kind, file): ("bytes", "") or ("sentencepiece" | "hf" | "kimi", path)."""
  if spec == "bytes":
    return "bytes", ""
  kind, _, path = spec.partition(":") if isinstance(spec, str) else ("", "", "")
  if kind not in ("sentencepiece", "hf", "kimi") or not path:
    raise ValueError(f"data.tokenizer must be one of {TOKENIZER_KINDS}, got {spec!r}")
  return kind, path


def tokenizer_spec(spec: str) -> str:
  """data.tokenizer with its file made absolute ("hf:tok.json" → "hf:/abs/tok.json"), so a
  run's config.json and a prepared corpus name the file wherever they are read."""
  kind, path = parse_tokenizer(spec)
  return spec if kind == "bytes" else f"{kind}:{os.path.abspath(os.path.expanduser(path))}"


def image_tasks(data: ml_collections.ConfigDict) -> list[str]:
  """data.image_tasks as a list ("digits,charts" → ["digits", "charts"])."""
  return [t.strip() for t in data.image_tasks.split(",") if t.strip()]
