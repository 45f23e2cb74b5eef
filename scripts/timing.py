"""Device timing for the benchmark scripts: median of repeated runs after warm-up."""

import statistics
import time

import jax


def median_ms(fn, args, iters: int, warmup: int = 3) -> float:
  """Median wall time (ms) of fn(*args) over `iters` runs, each waited on with
  block_until_ready, after `warmup` untimed runs (compiles, autotuning, caches)."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times) * 1e3
