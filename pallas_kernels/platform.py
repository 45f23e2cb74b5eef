"""The platform kernels are built for: that of the devices in the mesh in context
(`jax.set_mesh`), else the default backend.

Compiling ahead of time for a TPU topology on a CPU host (scripts/aot_compile.py) sets a mesh
of abstract TPU devices while jax's default backend stays "cpu"; every `""` / None kernel
choice asks this function, so that program gets the Mosaic TPU kernels, not the XLA paths
or the interpreter.
"""

import functools
import importlib.util

import jax


def target() -> str:
  """"tpu", "gpu" or "cpu"."""
  device = jax.sharding.get_abstract_mesh().abstract_device   # None without a mesh
  return device.platform if device is not None else jax.default_backend()


def target_mesh(platform: str = "tpu", device_kind: str = "TPU v5"):
  """A one-device mesh of abstract `platform` devices in context: kernel choices resolve as
  for that target (`target`) while the host stays a CPU; jax.export with platforms=[...]
  lowers for it. The tests' and benchmarks/scan_residuals.py's way to see another
  platform's program from a CPU host."""
  from jax._src.mesh import AbstractDevice   # no public constructor for one yet
  device = AbstractDevice(device_kind=device_kind, num_cores=1, platform=platform)
  return jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((1,), ("data",), abstract_device=device))


def interpret_off_gpu(interpret: bool | None) -> bool:
  """A GPU kernel's `interpret` argument resolved: None means natively where the target
  platform is a GPU, else in an interpreter (CPU tests)."""
  return target() != "gpu" if interpret is None else interpret


@functools.cache
def triton_available() -> bool:
  """Whether the Triton kernels (KDA's, the grouped matmul's) can run on a GPU here: the
  triton and jax_triton packages (the `gpu` extra) are installed. Looked up, not imported."""
  return all(importlib.util.find_spec(m) is not None for m in ("triton", "jax_triton"))
