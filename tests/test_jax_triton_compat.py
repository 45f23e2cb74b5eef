"""jax_triton's NVIDIA backend, whichever package imported jax_triton first
(pallas_kernels/jax_triton_compat.py): a stubbed module is repaired on CPU, and on the GPU a
process that imports tokamax before anything else still runs KDA's Triton kernels."""

import subprocess
import sys
import types

import pytest

from pallas_kernels import jax_triton_compat
from tests.conftest import ROOT, subprocess_env


class _Stub:
  pass


def test_a_stubbed_jax_triton_gets_the_real_backend_back(monkeypatch):
  """jax_triton's import fallback, as its 0.4.1 leaves it when `TMA_TF32` is missing: `cb`
  a namespace of stubs, no TMA dtypes. `repair` puts Triton's NVIDIA backend in."""
  import triton.backends.nvidia.compiler as cb
  import triton.backends.nvidia.driver as driver
  lib = types.SimpleNamespace(
      cb=types.SimpleNamespace(CUDAOptions=_Stub, CUDABackend=_Stub, GPUTarget=_Stub),
      _TMA_DTYPE_DEVICE_TO_HOST={}, _TMA_TF32=0)
  fake = types.SimpleNamespace(triton_lib=lib)
  assert jax_triton_compat.is_stubbed(fake)
  jax_triton_compat.repair(fake)
  assert not jax_triton_compat.is_stubbed(fake)
  assert lib.cb is cb and lib.cb.CUDABackend.__name__ == "CUDABackend"
  assert lib._TMA_DTYPE_DEVICE_TO_HOST is driver.TMA_DTYPE_DEVICE_TO_HOST
  assert len(lib._TMA_DTYPE_DEVICE_TO_HOST) > 0 and lib._TMA_TF32 == driver.TMA_TF32 == 0


_TOKAMAX_FIRST = r"""
import tokamax   # imports jax_triton: before the fix, with its NVIDIA backend stubbed out
import jax, jax.numpy as jnp, numpy as np
from pallas_kernels.kda import kda
from pallas_kernels import jax_triton_compat
B, T, H, D, LB = 1, 256, 2, 64, -5.0
ks = jax.random.split(jax.random.key(0), 5)
q, k, v = (jax.random.normal(kk, (B, T, H, D), jnp.float32) * 0.3 for kk in ks[:3])
k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
g = LB * jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H, D)))
beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
with jax.default_matmul_precision("highest"):
  o = kda(q, k, v, g, beta, lower_bound=LB, implementation="triton")[0]
  ref = kda(q, k, v, g, beta, lower_bound=LB, implementation="xla")[0]
o, ref = np.asarray(o, np.float64), np.asarray(ref, np.float64)
assert np.isfinite(o).all()
print("rel_err", np.linalg.norm(o - ref) / np.linalg.norm(ref))
print("stubbed", jax_triton_compat.is_stubbed(jax_triton_compat.load()))
"""


@pytest.mark.gpu
def test_gpu_kda_triton_runs_after_tokamax_is_imported_first():
  """A fresh process whose first import is tokamax (its Triton ops import jax_triton at
  module level): KDA's Triton kernels still run and match the XLA path in fp32."""
  run = subprocess.run([sys.executable, "-c", _TOKAMAX_FIRST], cwd=ROOT, env=subprocess_env(),
                       capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  lines = dict(line.split() for line in run.stdout.splitlines() if line.count(" ") == 1)
  assert lines["stubbed"] == "False"
  assert float(lines["rel_err"]) < 1e-4, run.stdout
