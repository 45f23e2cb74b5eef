"""The persistent XLA compilation cache: a restarted or resumed job loads its compiled
train and eval steps from disk instead of compiling them again.

Entry points (scripts/train.py, extend_context.py, bench_train.py) call `enable` with
train.compile_cache_dir before their first compile; "" leaves the cache off. The cache
key covers the program, the jax/XLA versions and the devices, so a changed config or
model simply compiles (and adds an entry).
"""

import os

import jax


def enable(directory: str) -> str | None:
  """Turns the cache on at `directory` (~ expanded); returns it, or None for ""."""
  if not directory:
    return None
  directory = os.path.expanduser(directory)
  os.makedirs(directory, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", directory)
  # Cache every program that took over a tenth of a second to compile, of any size.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return directory
