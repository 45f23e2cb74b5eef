"""Device timing for the benchmark scripts: median of repeated runs after warm-up.

Two clocks, the same for every library a script compares (a ratio between two clocks says
nothing about the kernels):
  blocked    each call waited on before the next: host dispatch and the wake-up after the
             device finishes are in every sample (what one call costs a program that waits);
  pipelined  windows of `calls` calls dispatched back to back and waited on once, divided by
             `calls`: the device's time per call, gaps between its kernels included, with the
             host's dispatch hidden behind the device's work (what a train step sees).
"""

import statistics
import time

import jax


def median_ms(fn, args, iters: int, warmup: int = 3) -> float:
  """Median wall time (ms) of fn(*args) over `iters` runs, each waited on with
  block_until_ready, after `warmup` untimed runs (compiles, autotuning, caches)."""
  return host_median_ms(lambda: fn(*args), jax.block_until_ready, iters, warmup)


def pipelined_ms(fn, args, iters: int, calls: int = 10, warmup: int = 3) -> float:
  """Median over `iters` windows of `calls` back-to-back calls of fn(*args), waited on once
  at the end of the window, per call (ms)."""
  return host_pipelined_ms(lambda: fn(*args), jax.block_until_ready, iters, calls, warmup)


def host_median_ms(call, wait, iters: int, warmup: int = 3) -> float:
  """median_ms for any library: `call()` runs once, `wait(result)` blocks until the device
  is done (jax.block_until_ready; for torch, lambda _: torch.cuda.synchronize())."""
  for _ in range(warmup):
    wait(call())
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    wait(call())
    times.append(time.perf_counter() - t0)
  return statistics.median(times) * 1e3


def host_pipelined_ms(call, wait, iters: int, calls: int = 10, warmup: int = 3) -> float:
  """pipelined_ms for any library (`call`, `wait` as host_median_ms's). Only the last call's
  result is kept and waited on: one device stream runs the calls in order."""
  for _ in range(warmup):
    wait(call())
  windows = []
  for _ in range(iters):
    t0 = time.perf_counter()
    for _ in range(calls):
      out = call()
    wait(out)
    windows.append((time.perf_counter() - t0) / calls)
  return statistics.median(windows) * 1e3
