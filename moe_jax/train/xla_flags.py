"""What a training job sets for itself before jax starts: XLA flags (config
`train.xla_flags`) and the share of GPU memory the allocator may take
(`train.memory_fraction`).

XLA reads XLA_FLAGS once, when the first backend starts, and the allocator reads
XLA_PYTHON_CLIENT_MEM_FRACTION then too, so the entry points (scripts/train.py,
extend_context.py, grpo.py, bench_train.py, profile_compile.py) call `apply_config` first
thing. A flag already in the environment's XLA_FLAGS, or a fraction already in the
environment, is left as the user set it.

`train.memory_fraction` 0 keeps JAX's default (75% of the GPU). A config whose step needs
more sets it: at 75% XLA also plans the step for that limit, rematerialising to fit and
failing where it cannot (configs/kimi_linear_48b.py:h200_slice, 107 GiB, asks for 0.95).

The default (configs/base.py; measured in benchmarks/train.md) shortens the
cold compile of long_context_1b's train step:
  --xla_gpu_autotune_level=1: GEMM autotuning still measures each candidate but skips
    initialising and checking its output against a reference algorithm (XLA's level 4):
    53.3 → 48.4 s, same step and loss. Level 0 skips the measuring too: a 4.7× slower step.
  --xla_gpu_enable_triton_gemm=false: cuBLAS runs every product instead of Triton GEMM
    fusions that each get their own autotuned kernel: 53.1 → 35.0 s, for a step 0.5–2.1%
    slower with the router's product in bf16 (model.moe.router_dtype).
  --xla_gpu_enable_dynamic_slice_fusion=false: XLA's dynamic-slice fusion folds a custom
    call or GEMM whose result is stored into a scan's stacked buffer into a fusion that
    writes the slot in place; where that result is also read by the next op it keeps the
    original call too, so jax_triton's KDA kernels ran twice in every scanned layer (21
    launches a step for 12 layers). Off: each runs once, and the step's kernels take
    261.7 → 250.2 ms (cuBLAS 39.0 → 32.3, KDA 72.1 → 66.3), the cold compile 37.2 → 31.2 s.
    (The MoE expert kernels also keep an optimization barrier against this cloning,
    pallas_kernels/moe/ops.py, so they run once with the flag on too.)
"""

import os
import re

_FLAG = re.compile(r"--([A-Za-z0-9_]+)(=\S*)?")
MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def apply_config(train_cfg, prefix: str = "train") -> str:
  """`apply` the config's train.xla_flags, then its train.memory_fraction
  (`apply_memory_fraction`); returns the XLA_FLAGS that result."""
  out = apply(train_cfg.xla_flags, f"{prefix}.xla_flags")
  apply_memory_fraction(train_cfg.get("memory_fraction", 0.0), f"{prefix}.memory_fraction")
  return out


def is_memory_fraction(x) -> bool:
  """A value train.memory_fraction accepts: a number in [0, 1] (0: JAX's default)."""
  return not isinstance(x, bool) and isinstance(x, (int, float)) and 0.0 <= x <= 1.0


def apply_memory_fraction(fraction: float, field: str = "train.memory_fraction") -> str:
  """Sets XLA_PYTHON_CLIENT_MEM_FRACTION to `fraction` (0: JAX's default, nothing set) unless
  the environment already sets it; returns the value in effect ("" for JAX's default).
  Raises for a fraction outside [0, 1], or once jax's backend has started."""
  if not is_memory_fraction(fraction):
    raise ValueError(f"{field}={fraction!r}: expected a number in (0, 1], the share of GPU "
                     "memory the allocator may take, or 0 for JAX's default (0.75)")
  if not fraction or MEM_FRACTION in os.environ:
    return os.environ.get(MEM_FRACTION, "")
  _refuse_if_started(field, f"{MEM_FRACTION}={fraction}")
  os.environ[MEM_FRACTION] = f"{fraction:g}"
  return os.environ[MEM_FRACTION]


def _refuse_if_started(field: str, what) -> None:
  from jax._src import xla_bridge
  if xla_bridge.backends_are_initialized():
    raise RuntimeError(f"{field}: jax's backend has started, so XLA would ignore {what}; call "
                       "moe_jax.train.xla_flags.apply_config before the first jax computation")


def apply(flags: str, field: str = "train.xla_flags") -> str:
  """Appends each of `flags` ("--name=value ...") whose name XLA_FLAGS does not already hold;
  returns the XLA_FLAGS that result. Raises if jax's backend has already started (the flags
  would be ignored)."""
  parsed = [(t, _FLAG.fullmatch(t)) for t in flags.split()]
  bad = [t for t, m in parsed if not m]
  if bad:
    raise ValueError(f"{field}={flags!r}: {bad} is not an XLA flag; expected space-separated "
                     "'--name=value' items, as in XLA_FLAGS")
  current = os.environ.get("XLA_FLAGS", "")
  present = {m[1] for m in _FLAG.finditer(current)}
  new = [t for t, m in parsed if m[1] not in present]
  if not new:
    return current
  _refuse_if_started(field, new)
  os.environ["XLA_FLAGS"] = " ".join([current, *new]).strip()
  return os.environ["XLA_FLAGS"]
