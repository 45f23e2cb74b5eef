"""jax_triton with its NVIDIA backend, whichever package imported it first.

jax-triton 0.4.1 imports `TMA_TF32` from Triton's NVIDIA driver, which Triton 3.6 (the GPU
image's, torch's) lacks. The failed import makes jax_triton swap its whole NVIDIA backend
for stubs, for the life of the process: every later Triton kernel fails with
`'_Stub' object has no attribute 'backend'`. tokamax imports jax_triton at module level, so
`import tokamax` before any KDA kernel was enough to break them all. `load` supplies the
constant before jax_triton's first import and, where jax_triton was already imported with
the stubs, puts the real backend back: import order no longer matters. The constant is read
only for TMA descriptors of fp32 rounded to TF32, which no kernel here uses.
"""

import functools
import importlib.util
import types


def patch_driver() -> None:
  """Gives Triton's NVIDIA driver the `TMA_TF32` that jax-triton 0.4.1 imports (0: no
  rounding), where Triton is installed. Call it before importing jax_triton, or a package
  that imports it (tokamax), so that the import finds the backend."""
  if importlib.util.find_spec("triton") is None:
    return
  import triton.backends.nvidia.driver as driver
  if not hasattr(driver, "TMA_TF32"):
    driver.TMA_TF32 = 0


def is_stubbed(jax_triton) -> bool:
  """Whether jax_triton's NVIDIA backend is its stand-in (a namespace of stubs), not the
  module `triton.backends.nvidia.compiler`."""
  return not isinstance(jax_triton.triton_lib.cb, types.ModuleType)


def repair(jax_triton) -> None:
  """Puts the names jax_triton's failed import stubbed out back from Triton's NVIDIA
  backend (its compiler module and the driver's two TMA constants)."""
  patch_driver()
  import triton.backends.nvidia.compiler as cb
  import triton.backends.nvidia.driver as driver
  lib = jax_triton.triton_lib
  lib.cb = cb
  lib._TMA_DTYPE_DEVICE_TO_HOST = driver.TMA_DTYPE_DEVICE_TO_HOST
  lib._TMA_TF32 = driver.TMA_TF32


@functools.cache
def load():
  """jax_triton, with the real NVIDIA backend (GPU hosts; jax_triton is the `gpu` extra)."""
  patch_driver()
  import jax_triton
  if is_stubbed(jax_triton):
    repair(jax_triton)
  return jax_triton
