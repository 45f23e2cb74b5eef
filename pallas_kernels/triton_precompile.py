"""jax_triton's host compiles, started when a kernel is traced instead of when it is lowered.

jax_triton compiles each Triton kernel (Python AST → TTIR → TTGIR → LLVM IR → PTX) inside its
lowering rule, so a program's kernels compile one after another on the thread that lowers
it, after the whole trace. `submit` starts that compile on a worker thread as soon as the
kernel is traced, by lowering a one-kernel program with the same call: the compiles then
overlap with each other and with the rest of the trace (most of their time is in MLIR and
LLVM passes, which run without the GIL), and the real lowering finds them in jax_triton's
own cache. `_compile_once` makes a lowering that reaches a kernel still compiling wait for
it rather than compile it a second time.

It leans on two private methods of jax_triton 0.4.1 (`TritonFunction._compile_kernel` and
`_make_cache_key`); where they are missing, `submit` does nothing and the lowering compiles
as before.
"""

import collections
import concurrent.futures
import functools
import os
import threading

import jax

ENABLED = True   # off: every kernel compiles in the lowering, as jax_triton does alone
_SUBMITTED = set()   # the calls already started (an eager kda() traces on every call)


@functools.cache
def _pool(jax_triton):
  """The worker threads, once jax_triton's compile is wrapped; None where it cannot be."""
  lib = jax_triton.triton_lib
  function = getattr(lib, "TritonFunction", None)
  if not (hasattr(function, "_compile_kernel") and hasattr(function, "_make_cache_key")):
    return None
  compile_kernel = function._compile_kernel
  locks, compiled = collections.defaultdict(threading.Lock), {}
  guard = threading.Lock()

  def _compile_once(self, spec, gpu_target, backend, backend_options):
    key = self._make_cache_key(spec, gpu_target, backend_options)
    with guard:
      lock = locks[key]
    with lock:
      if key not in compiled:
        compiled[key] = compile_kernel(self, spec, gpu_target, backend, backend_options)
      return compiled[key]

  function._compile_kernel = _compile_once
  return concurrent.futures.ThreadPoolExecutor(max(1, min(8, (os.cpu_count() or 2) // 2)),
                                               thread_name_prefix="triton_precompile")


def submit(jax_triton, args, **call):
  """Starts compiling `jax_triton.triton_call(*args, **call)` (args: arrays or tracers; only
  their shapes and dtypes are read) on a worker thread. Returns the future, or None (off,
  not possible, or this call was started before)."""
  pool = _pool(jax_triton) if ENABLED else None
  if pool is None:
    return None
  avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
  key = repr((avals, sorted(call.items())))
  if key in _SUBMITTED:   # once per call: a retrace finds it compiled
    return None
  _SUBMITTED.add(key)
  one_kernel = jax.jit(lambda *xs: jax_triton.triton_call(*xs, **call))
  return pool.submit(one_kernel.lower, *avals)
