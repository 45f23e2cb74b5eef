"""train.xla_flags and train.memory_fraction (moe_jax/train/xla_flags.py): the flags reach
XLA and the fraction the allocator when applied before jax starts, the environment's own
XLA_FLAGS and fraction win, and bad input is refused."""

import os
import subprocess
import sys

import pytest

from moe_jax.train import xla_flags
from tests.conftest import ROOT, subprocess_env


def _python(code: str, xla: str) -> subprocess.CompletedProcess:
  # subprocess_env keeps the caller's PYTHONPATH after ROOT: a GPU machine's carried wheels
  # sit there.
  env = subprocess_env(XLA_FLAGS=xla, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                        cwd=ROOT, timeout=120)


def test_flags_reach_xla_and_the_environment_wins():
  """In a fresh process: the config's flags are appended where XLA_FLAGS does not name them
  (a flag XLA does not know then stops the backend at its start: XLA read it), and a flag
  the environment names keeps the environment's value."""
  code = ("from moe_jax.train import xla_flags; "
          "print(xla_flags.apply('--xla_gpu_autotune_level=1 --xla_cpu_enable_fast_math=true')); "
          "import jax; print(jax.numpy.ones(3).sum())")
  out = _python(code, "--xla_gpu_autotune_level=4")
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.splitlines() == [
      "--xla_gpu_autotune_level=4 --xla_cpu_enable_fast_math=true", "3.0"]
  bad = _python(code.replace("xla_cpu_enable_fast_math", "xla_not_a_flag_of_any_xla"), "")
  assert bad.returncode != 0 and "xla_not_a_flag_of_any_xla" in bad.stderr


def test_bad_input_and_a_started_backend_are_refused(monkeypatch):
  import jax
  jax.numpy.zeros(1).block_until_ready()   # this test process's backend has started
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=4")
  with pytest.raises(ValueError, match=r"train.xla_flags='autotune=1'.*--name=value"):
    xla_flags.apply("autotune=1")
  with pytest.raises(RuntimeError, match="ignore"):
    xla_flags.apply("--xla_gpu_autotune_level=4 --xla_cpu_enable_fast_math=true")
  # Nothing to add: no error, XLA_FLAGS unchanged.
  assert xla_flags.apply("--xla_gpu_autotune_level=1") == "--xla_gpu_autotune_level=4"
  assert os.environ["XLA_FLAGS"] == "--xla_gpu_autotune_level=4"


def test_memory_fraction_is_set_before_jax_and_the_environment_wins(monkeypatch):
  """apply_config sets XLA_PYTHON_CLIENT_MEM_FRACTION from train.memory_fraction in a fresh
  process (0 leaves JAX's default); a fraction the environment sets wins; a bad one raises
  naming the field."""
  code = ("import ml_collections as mc; from moe_jax.train import xla_flags; import os; "
          "xla_flags.apply_config(mc.ConfigDict({'xla_flags': '', 'memory_fraction': %s})); "
          "print(os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION', 'default'))")
  monkeypatch.delenv(xla_flags.MEM_FRACTION, raising=False)
  assert _python(code % 0.95, "").stdout.split() == ["0.95"]
  assert _python(code % 0.0, "").stdout.split() == ["default"]
  monkeypatch.setenv(xla_flags.MEM_FRACTION, "0.5")
  assert _python(code % 0.95, "").stdout.split() == ["0.5"]
  with pytest.raises(ValueError, match=r"run\.train\.memory_fraction=1\.2: expected a number"):
    xla_flags.apply_memory_fraction(1.2, "run.train.memory_fraction")


@pytest.mark.gpu
def test_gpu_dynamic_slice_fusion_runs_a_stacked_kernel_twice():
  """Why train.xla_flags turns XLA's dynamic-slice fusion off: a jax_triton kernel whose
  output a scan both stacks and reads (the KDA recurrence's o in a scanned layer) is
  compiled as two calls with the fusion on and as one with it off."""
  import jax
  import jax.numpy as jnp
  from pallas_kernels.kda import kda
  from tests.test_kda import LB

  L, B, T, H, D = 3, 1, 128, 2, 64
  ks = jax.random.split(jax.random.key(0), 5)
  q, k, v = (jax.random.normal(kk, (L, B, T, H, D), jnp.bfloat16) for kk in ks[:3])
  g = LB * jax.nn.sigmoid(jax.random.normal(ks[3], (L, B, T, H, D)))
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (L, B, T, H)))

  def layer(carry, xs):
    o = kda(*xs, lower_bound=LB, implementation="triton")[0]
    return carry + o.astype(jnp.float32).sum(), o      # o read and stacked

  def triton_calls(fn, args, options=None):
    hlo = jax.jit(fn).lower(*args).compile(options).as_text()
    return hlo.count('custom_call_target="triton_kernel_call_ffi"')

  xs = (q, k, v, g, beta)
  # One layer's kernels, unscanned: the prologue, stage 1's tiles and W/U kernels and stage
  # 2's recurrence (each once; counted, so the test follows the op's kernel list).
  one_layer = triton_calls(lambda *x: layer(jnp.float32(0), x)[1], [a[0] for a in xs])
  assert one_layer >= 3
  scan = lambda *x: jax.lax.scan(layer, jnp.float32(0), x)
  fusion = lambda on: {"xla_gpu_enable_dynamic_slice_fusion": on}
  assert triton_calls(scan, xs, fusion(False)) == one_layer
  assert triton_calls(scan, xs, fusion(True)) > one_layer
