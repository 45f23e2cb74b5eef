"""triton_precompile on CPU, with a stand-in for jax_triton (its lowering needs a GPU; the
real one ran in bench_train's cold start on the H200, benchmarks/train.md)."""

import threading
import time
import types

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import triton_precompile


def _fake_jax_triton():
  """A module with jax_triton's two private methods; each compile takes 50 ms."""
  calls = []

  class TritonFunction:
    def __init__(self, fn):
      self.fn = fn

    def _make_cache_key(self, spec, gpu_target, backend_options):
      return (self.fn, spec, gpu_target, tuple(sorted(backend_options.items())))

    def _compile_kernel(self, spec, gpu_target, backend, backend_options):
      calls.append((self.fn, spec))
      time.sleep(0.05)
      return f"kernel {self.fn} {spec}"

  jt, lib = types.ModuleType("jax_triton"), types.ModuleType("jax_triton.triton_lib")
  lib.TritonFunction, jt.triton_lib = TritonFunction, lib
  jt.triton_call = lambda *xs, out_type, **_: xs[0].astype(out_type.dtype) * 2
  return jt, calls


def test_a_key_compiles_once_while_others_run_side_by_side():
  jt, calls = _fake_jax_triton()
  assert triton_precompile._pool(jt) is not None
  fn = jt.triton_lib.TritonFunction
  results = {}

  def lower(name, spec):   # as a lowering thread would: the compile of one kernel
    results[name] = fn("k")._compile_kernel(spec, "sm_90", None, {"num_warps": 4})

  threads = [threading.Thread(target=lower, args=(f"t{i}", "a" if i < 3 else "b"))
             for i in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  # three threads asked for key a: one compiled it, two waited and got the same kernel
  assert sorted(calls) == [("k", "a"), ("k", "b")]
  assert results["t0"] == results["t1"] == results["t2"] == "kernel k a"
  assert results["t3"] == "kernel k b"


def test_submit_lowers_the_same_call_on_a_worker():
  jt, _ = _fake_jax_triton()
  x = jnp.ones((4, 8), jnp.bfloat16)
  out = jax.ShapeDtypeStruct((4, 8), jnp.float32)
  lowered = triton_precompile.submit(jt, [x], out_type=out, grid=(1,)).result(timeout=60)
  assert "tensor<4x8xbf16>" in lowered.as_text() and "tensor<4x8xf32>" in lowered.as_text()
  # the same call again (a retrace) starts nothing; another shape does
  assert triton_precompile.submit(jt, [x], out_type=out, grid=(1,)) is None
  y = jnp.ones((2, 8), jnp.bfloat16)
  assert triton_precompile.submit(jt, [y], out_type=out, grid=(1,)) is not None


def test_nothing_is_submitted_without_the_private_methods_or_when_off(monkeypatch):
  jt, _ = _fake_jax_triton()
  jt.triton_lib.TritonFunction = object   # another jax_triton
  assert triton_precompile.submit(jt, [jnp.ones(2)], out_type=None) is None
  jt, _ = _fake_jax_triton()
  monkeypatch.setattr(triton_precompile, "ENABLED", False)
  assert triton_precompile.submit(jt, [jnp.ones(2)], out_type=None) is None
