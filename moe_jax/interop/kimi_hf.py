"""Hugging Face Kimi Linear checkpoints in and out: the public API.

  from moe_jax.interop import kimi_hf
  config, variables = kimi_hf.load(hf_dir, dtype=jnp.float32)   # a run config + Flax vars
  logits = forward_logits(config, variables, tokens_BxT)         # moe_jax.infer.generate
  kimi_hf.save(config, variables, out_dir)                       # from_pretrained reads it

A checkpoint directory holds config.json (kimi_config.py reads both of its forms) and
safetensors: one file or shards with model.safetensors.index.json. Tensors are read one
at a time from memory-mapped shards and put on the device as each layer is built, so the
host never holds the whole model; `save` writes shards as it goes. Both tensor namings
are read (kimi_tensors.py); `save` writes the released one unless told otherwise.
"""

import contextlib
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from moe_jax.interop import kimi_config, kimi_tensors
from moe_jax.model import layer_stack
from moe_jax.model.transformer import HybridMoE

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SAFETENSORS_DTYPES = {"BF16": ml_dtypes.bfloat16, "F32": np.float32, "F16": np.float16,
                      "F64": np.float64}
# Tensors a checkpoint may carry that no computation reads.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_config(hf_dir: str) -> dict:
  path = os.path.join(hf_dir, "config.json")
  if not os.path.exists(path):
    raise ValueError(f"hf_dir={hf_dir!r} has no config.json (a Kimi-Linear checkpoint "
                     "directory holds config.json and safetensors)")
  with open(path) as f:
    return json.load(f)


def tensor_files(hf_dir: str) -> dict:
  """{tensor name: safetensors file} from the index, or from the one file."""
  index = os.path.join(hf_dir, INDEX)
  if os.path.exists(index):
    with open(index) as f:
      return {k: os.path.join(hf_dir, v) for k, v in json.load(f)["weight_map"].items()}
  files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
  if not files:
    raise ValueError(f"hf_dir={hf_dir!r} has no .safetensors file")
  out = {}
  for name in files:
    with safe_open(os.path.join(hf_dir, name), "numpy") as f:
      out.update({k: os.path.join(hf_dir, name) for k in f.keys()})
  return out


def tensor_dtypes(hf_dir: str) -> dict:
  """{tensor name: numpy dtype as stored}: what `save(dtypes=...)` takes to write a
  converted checkpoint back bit for bit."""
  out, files = {}, tensor_files(hf_dir)
  for path in sorted(set(files.values())):
    with safe_open(path, "numpy") as f:
      out.update({k: np.dtype(SAFETENSORS_DTYPES[f.get_slice(k).get_dtype()]) for k in f.keys()})
  return out


def abstract_variables(config) -> dict:
  """The shapes HybridMoE(config.model) initialises (nothing allocated). Traced as the
  float32 model on XLA's ops: the shapes are the same on every path, and a loader need not
  import (or trace) the GPU and TPU kernel libraries."""
  c = ml_collections.ConfigDict(config.model.to_dict())
  c.update(dtype="float32", kda_implementation="xla", mla_implementation="xla")
  c.moe.grouped_matmul = "xla"
  m = ml_collections.FrozenConfigDict(c)
  T = m.kda_chunk_size
  batch = {"tokens": jax.ShapeDtypeStruct((1, T), jnp.int32),
           "segment_ids": jax.ShapeDtypeStruct((1, T), jnp.int32)}
  return nn.meta.unbox(jax.eval_shape(HybridMoE(m).init, jax.random.key(0), batch))


def _shapes(tree) -> dict:
  return {jax.tree_util.keystr(p): tuple(x.shape)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def load(hf_dir: str, dtype=jnp.float32):
  """(run config, {"params", "router"}) of a transformers Kimi-Linear checkpoint.

  dtype: every parameter's dtype (None: as stored); the router biases
  (e_score_correction_bias) stay float32. The config computes in float32 for float32
  parameters, else in bfloat16 (config.model.dtype)."""
  hf = read_config(hf_dir)
  config = kimi_config.from_hf(hf)
  m = config.model
  m.dtype = "float32" if dtype is not None and jnp.dtype(dtype) == jnp.float32 else "bfloat16"
  files = tensor_files(hf_dir)
  put = lambda x: jnp.asarray(x, dtype=dtype if dtype is not None else x.dtype)
  params, router = {}, {}
  with contextlib.ExitStack() as stack:
    handles = {p: stack.enter_context(safe_open(p, "numpy")) for p in sorted(set(files.values()))}
    reader = kimi_tensors.Reader(lambda n: handles[files[n]].get_tensor(n), files)
    params.update(jax.tree.map(put, kimi_tensors.outer_to_ours(reader)))
    for i in range(m.n_layers):
      p, r = kimi_tensors.layer_to_ours(m, i, reader)
      params[f"layer_{i}"] = jax.tree.map(put, p)
      if r is not None:
        router[f"layer_{i}"] = jax.tree.map(jnp.asarray, r)
  unread = sorted(n for n in set(files) - reader.used if not n.endswith(IGNORED_SUFFIXES))
  if unread:
    raise ValueError(f"hf_dir={hf_dir!r}: {len(unread)} tensors map to nothing in the "
                     f"config, e.g. {unread[:5]}")
  variables = {"params": params, "router": router}
  want = abstract_variables(config)
  want = {k: layer_stack.unstack(m, v) for k, v in want.items()}
  for coll in ("params", "router"):
    got_s, want_s = _shapes(variables[coll]), _shapes(want.get(coll, {}))
    if got_s != want_s:
      diff = sorted(set(got_s.items()) ^ set(want_s.items()))[:6]
      raise ValueError(f"hf_dir={hf_dir!r}: {coll} do not match the model its config "
                       f"describes; first differences (path, shape): {diff}")
  return config, {k: layer_stack.stack(m, v) for k, v in variables.items()}


def _to_numpy(tree):
  return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def hf_tensors(config, variables, naming: str = "released"):
  """Yields {HF name: numpy array}, the outer tensors and then one layer at a time."""
  m = config.model
  params = layer_stack.unstack(m, nn.meta.unbox(variables["params"]))
  router = layer_stack.unstack(m, variables.get("router", {}))
  yield kimi_tensors.outer_to_hf(_to_numpy({k: params[k] for k in
                                            ("embed", "final_norm", "lm_head")}))
  for i in range(m.n_layers):
    name = f"layer_{i}"
    yield kimi_tensors.layer_to_hf(m, i, _to_numpy(params[name]),
                                   _to_numpy(router.get(name)), naming)


def save(config, variables, hf_dir: str, *, naming: str = "released", dtype=None,
         dtypes: dict | None = None, template: dict | None = None,
         max_shard_bytes: int = 5 << 30):
  """Writes config.json and safetensors shards that transformers' from_pretrained loads.

  naming: "released" (Kimi-Linear-48B-A3B's and save_pretrained's tensor names) or
  "native". dtype: every tensor's dtype (None: as held); dtypes: per-name dtypes that
  win over it (tensor_dtypes of the source, for a bit-identical round trip). template: a
  config.json whose fields moe_jax does not model (token ids, max length...) are kept.
  Raises ValueError, before writing anything, for a model Kimi Linear cannot express."""
  if naming not in kimi_tensors.NAMINGS:
    raise ValueError(f"naming must be one of {kimi_tensors.NAMINGS}, got {naming!r}")
  hf = kimi_config.to_hf(config, template)
  os.makedirs(hf_dir, exist_ok=True)
  shard, shard_bytes, written, weight_map, total = {}, 0, [], {}, 0
  seen_dtypes = set()

  def flush():
    nonlocal shard, shard_bytes
    if shard:
      path = os.path.join(hf_dir, f"shard-{len(written):05d}.tmp")
      save_file(shard, path, metadata={"format": "pt"})
      written.append((path, list(shard)))
      shard, shard_bytes = {}, 0

  for tensors in hf_tensors(config, variables, naming):
    for name, x in tensors.items():
      want = (dtypes or {}).get(name, dtype)
      x = np.ascontiguousarray(x if want is None else x.astype(want))
      seen_dtypes.add(x.dtype)
      if shard and shard_bytes + x.nbytes > max_shard_bytes:
        flush()
      shard[name], shard_bytes, total = x, shard_bytes + x.nbytes, total + x.nbytes
  flush()
  n = len(written)
  for k, (path, names) in enumerate(written):
    final = SINGLE if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
    os.replace(path, os.path.join(hf_dir, final))
    weight_map.update({name: final for name in names})
  if n > 1:
    with open(os.path.join(hf_dir, INDEX), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2,
                sort_keys=True)
  if not any(k in hf for k in ("dtype", "torch_dtype")):
    hf["dtype"] = "bfloat16" if np.dtype(ml_dtypes.bfloat16) in seen_dtypes else "float32"
  with open(os.path.join(hf_dir, "config.json"), "w") as f:
    json.dump(hf, f, indent=2, sort_keys=True)
