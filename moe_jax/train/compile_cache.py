"""The persistent compilation cache, and a store of exported programs beside it: a
restarted or resumed job neither compiles nor traces its init and train step again.

Entry points (scripts/train.py, extend_context.py, grpo.py, bench_train.py) call `enable`
with train.compile_cache_dir before their first compile; "" leaves both off.

* jax's cache (`jax_compilation_cache_dir`) is keyed by the lowered program, so it saves
  the compile but not the Python trace and the lowering that make the program: about 15 s
  of a warm start of long_context_1b (benchmarks/train.md).
* `compiled` also skips those. It stores each program as a jax.export artifact (StableHLO,
  serialised) under <dir>/exported, keyed by everything the trace reads: the full config,
  the arguments' paths, shapes, dtypes and shardings, a hash of this package's source
  (moe_jax, pallas_kernels, the tuned-tile tables), the jax/jaxlib/flax/optax/tokamax
  versions, jax's flags, XLA_FLAGS, the devices and the process. A hit deserialises the
  program and compiles it, which jax's cache answers; a miss traces, exports, stores, and
  compiles the same way, so that the next start's compile is a hit too. (Storing the
  compiled executable instead, jax.experimental.serialize_executable, fails to run after a
  restart on XLA:CPU: "Function ... not found".)
"""

import functools
import hashlib
import importlib.metadata
import json
import os
import sys
import tempfile
import time

import jax
from absl import logging

_STORE = {"dir": None}
_PACKAGES = ("jax", "jaxlib", "flax", "optax", "tokamax", "ml_collections")


def enable(directory: str) -> str | None:
  """Turns both caches on at `directory` (~ expanded); returns it, or None for ""."""
  if not directory:
    _STORE["dir"] = None
    return None
  directory = os.path.expanduser(directory)
  os.makedirs(directory, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", directory)
  # Cache every program that took over a tenth of a second to compile, of any size.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  _STORE["dir"] = os.path.join(directory, "exported")
  return directory


@functools.cache
def source_hash() -> str:
  """sha256 over the source files (and tuned-tile JSON) of moe_jax and pallas_kernels."""
  import moe_jax
  import pallas_kernels
  h = hashlib.sha256()
  for pkg in (moe_jax, pallas_kernels):
    root = os.path.dirname(pkg.__file__)
    for dirpath, dirnames, filenames in os.walk(root):
      dirnames.sort()
      for name in sorted(filenames):
        if name.endswith((".py", ".json")):
          path = os.path.join(dirpath, name)
          h.update(os.path.relpath(path, root).encode())
          with open(path, "rb") as f:
            h.update(f.read())
  return h.hexdigest()


def _versions() -> dict:
  out = {"python": sys.version}
  for name in _PACKAGES:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


def _jax_flags() -> dict:
  """jax's flag values, less those that only steer caching and logging."""
  skip = ("cache", "log", "debug_nans", "traceback", "explain")
  return {k: repr(v) for k, v in sorted(jax.config.values.items())
          if not any(s in k for s in skip)}


def _args_key(args) -> list:
  return [(jax.tree_util.keystr(path), tuple(x.shape), str(x.dtype),
           str(getattr(x, "sharding", None)))
          for path, x in jax.tree_util.tree_flatten_with_path(args)[0]]


def key(name: str, config, args, devices) -> str:
  """The store's key of program `name` traced from `config` on `args` for `devices`."""
  parts = {
      "name": name,
      "config": config.to_json_best_effort(sort_keys=True),
      "args": _args_key(args),
      "source": source_hash(),
      "versions": _versions(),
      "jax_flags": _jax_flags(),
      "env": {k: v for k, v in sorted(os.environ.items())
              if k.startswith(("XLA_", "JAX_", "CUDA_VISIBLE", "TPU_", "LIBTPU"))
              and "CACHE" not in k and "LOG" not in k},
      "devices": [(d.id, d.device_kind, d.process_index) for d in devices],
      "platform_version": devices[0].client.platform_version,
      "process": (jax.process_index(), jax.process_count()),
  }
  return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


# The custom calls of this project's kernels (Mosaic GPU, Pallas Triton, Mosaic TPU, GPU
# threefry). jax.export refuses targets it does not promise to keep stable across jax
# versions; an entry is only read back by the jax version that wrote it (the key).
_KERNEL_TARGETS = ("mosaic_gpu_v2", "mosaic_gpu", "__gpu$xla.gpu.triton", "triton_kernel_call",
                   "triton_kernel_call_ffi",   # jax_triton 0.4's (KDA implementation="triton")
                   "tpu_custom_call", "cu_threefry2x32", "cu_threefry2x32_ffi")


def _template(tree, known: dict):
  """`tree`'s structure as JSON: each subtree whose structure is one of `known`'s (e.g. the
  train state, whose treedef holds the model's apply function and the optimizer's
  closures) becomes {"known": name}."""
  structure = jax.tree.structure(tree)
  for name, treedef in known.items():
    if structure == treedef:
      return {"known": name}
  if isinstance(tree, dict):
    return {"dict": [[k, _template(v, known)] for k, v in tree.items()]}
  if type(tree) in (tuple, list):
    return {type(tree).__name__: [_template(v, known) for v in tree]}
  if structure.num_nodes == 1 and structure.num_leaves == 1:
    return None    # a leaf
  raise TypeError(f"compile_cache: cannot store an output of type {type(tree).__name__}")


def _from_template(t, known: dict):
  if t is None:
    return 0
  (kind, v), = t.items()
  if kind == "known":
    return jax.tree.unflatten(known[v], [0] * known[v].num_leaves)
  if kind == "dict":
    return {k: _from_template(x, known) for k, x in v}
  return {"tuple": tuple, "list": list}[kind](_from_template(x, known) for x in v)


class Program:
  """A compiled flat program called like the jitted function it was made from."""

  def __init__(self, executable, in_tree, out_tree):
    self.executable, self.in_tree, self.out_tree = executable, in_tree, out_tree

  def __call__(self, *args):
    leaves, tree = jax.tree.flatten(args)
    if tree != self.in_tree:
      raise TypeError(f"compile_cache.Program: arguments {tree} do not match {self.in_tree}")
    return jax.tree.unflatten(self.out_tree, self.executable(*leaves))

  def as_text(self) -> str:
    return self.executable.as_text()


def _abstract(x):
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


class Lowered:
  """A program traced (or loaded) and lowered, not yet compiled. `out_info`: its outputs
  as ShapeDtypeStructs, in the jitted function's output structure."""

  def __init__(self, lowered, out_info, timings: dict, wrap=None):
    self._lowered, self.out_info, self._timings, self._wrap = lowered, out_info, timings, wrap

  def compile(self):
    """The executable (a Program where the store is on); timings gets "compile"."""
    t = time.perf_counter()
    executable = self._lowered.compile()
    self._timings["compile"] = time.perf_counter() - t
    return self._wrap(executable) if self._wrap else executable


def compiled(jitted, args: tuple, **kwargs):
  """`lower(jitted, args, **kwargs).compile()`: `jitted` traced on `args` and compiled,
  called as jitted(*args) is."""
  return lower(jitted, args, **kwargs).compile()


def lower(jitted, args: tuple, *, name: str, config, devices, known: dict | None = None,
          donate: tuple = (), timings: dict | None = None) -> Lowered:
  """`jitted` traced on `args` (arrays or ShapeDtypeStructs with shardings) and lowered.
  With the store off (enable("")), just lower. With it on, the trace is loaded from the
  store when it holds one under the same key (module doc), else exported and stored;
  either way the exported call is lowered (and later compiled, which jax's cache answers
  on a restart). `known` names output subtrees by an example of their structure; `donate`
  lists donated argument positions; `devices` are the program's devices in mesh order.
  `timings` gets "lower" (trace + export, or the load), "executable": "loaded" or
  "traced", and "compile" once compiled."""
  timings = {} if timings is None else timings
  known = {k: jax.tree.structure(v) for k, v in (known or {}).items()}
  leaves, in_tree = jax.tree.flatten(args)
  abstract = [_abstract(x) for x in leaves]
  counts = [len(jax.tree.leaves(a)) for a in args]
  donated = tuple(i for a in donate for i in range(sum(counts[:a]), sum(counts[:a + 1])))
  t = time.perf_counter()
  timings["executable"] = "traced"
  if not _STORE["dir"]:
    return _lowered(jitted, args, timings, t)
  base = os.path.join(_STORE["dir"], f"{name}-{key(name, config, args, list(devices))}")
  exported = out_tree = None
  if os.path.exists(base + ".json"):
    try:
      with open(base + ".bin", "rb") as f:
        exported = jax.export.deserialize(bytearray(f.read()))
      with open(base + ".json") as f:
        out_tree = jax.tree.structure(_from_template(json.load(f), known))
      timings["executable"] = "loaded"
    except Exception as e:  # an unreadable entry: trace again, and overwrite it
      logging.warning("compile_cache: could not load %s (%s: %s); tracing", base,
                      type(e).__name__, e)
      exported = None
  if exported is None:
    box = {}

    def flat(*xs):
      out_leaves, box["out_tree"] = jax.tree.flatten(jitted(*jax.tree.unflatten(in_tree, xs)))
      return out_leaves

    checks = [jax.export.DisabledSafetyCheck.custom_call(c) for c in _KERNEL_TARGETS]
    try:
      exported = jax.export.export(jax.jit(flat), disabled_checks=checks)(*abstract)
    except Exception as e:  # e.g. a kernel's custom call not in _KERNEL_TARGETS: no store
      logging.warning("compile_cache: %s cannot be exported (%s: %s); compiling it directly",
                      name, type(e).__name__, e)
      return _lowered(jitted, args, timings, t)
    out_tree = box["out_tree"]
    _store(base, exported, jax.tree.unflatten(out_tree, [0] * out_tree.num_leaves), known)
  call = jax.jit(exported.call, donate_argnums=donated)
  lowered = call.lower(*abstract)
  timings["lower"] = time.perf_counter() - t
  return Lowered(lowered, jax.tree.unflatten(out_tree, jax.tree.leaves(lowered.out_info)),
                 timings, lambda executable: Program(executable, in_tree, out_tree))


def _lowered(jitted, args, timings: dict, t: float) -> Lowered:
  lowered = jitted.lower(*args)
  timings["lower"] = time.perf_counter() - t
  return Lowered(lowered, lowered.out_info, timings)


def _store(base: str, exported, out_example, known: dict):
  """Writes the entry (the .json last: an entry without it is not read)."""
  try:
    template = _template(out_example, known)
    os.makedirs(os.path.dirname(base), exist_ok=True)
    for suffix, data in ((".bin", bytes(exported.serialize())),
                         (".json", json.dumps(template).encode())):
      with tempfile.NamedTemporaryFile(dir=os.path.dirname(base), delete=False) as f:
        f.write(data)
      os.replace(f.name, base + suffix)
  except Exception as e:  # storing is an optimisation: the run goes on without it
    logging.warning("compile_cache: not storing %s (%s: %s)", base, type(e).__name__, e)
