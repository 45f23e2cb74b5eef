"""Shared test helpers: small configs, a relative-error measure, a call counter, and the
settings that let one suite run on CPU and on a GPU.

* Precision: every float32 comparison in this suite promises float32 arithmetic, so the
  suite runs under `jax_default_matmul_precision="highest"`. On CPU that changes nothing;
  on a GPU it turns XLA's and the Pallas kernels' float32 dots from TF32 into IEEE fp32
  (Pallas's Triton lowering reads the precision JAX records on each dot). Tests of the
  default (TF32 / bf16) path say so and set their own tolerance.
* `@pytest.mark.gpu` tests run the real kernels at realistic sizes; they skip off GPU, and
  on a GPU they and the `slow` tier are collected first.
* Several test processes can share one GPU: JAX's 75% preallocation is off.
* Fake multi-device runs are subprocesses on the CPU platform (`cpu_devices_env`).
* One persistent compilation cache per test run, in a fresh temporary folder: pytest
  imports this file before it starts xdist workers, so workers and the subprocesses tests
  start share it, and a test that compiles a program another already compiled (the same
  small model trained again, a resumed run) loads it. The folder is removed at the end
  (a JAX_COMPILATION_CACHE_DIR already set is used instead, and kept).
"""

import importlib.util
import os
import shutil
import sys
import tempfile

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# On a machine without a GPU, XLA:CPU compiles at LLVM -O0 without its expensive passes: the
# suite is mostly compiles of small programs (a 5-step small-config run: compile 15.7 → 6.0 s,
# the same losses). Inherited by every subprocess and notebook kernel the tests start; a test
# whose time is in running, not compiling, can drop it there (xla_flags_without).
FAST_CPU_COMPILE = ("--xla_backend_optimization_level=0",
                    "--xla_llvm_disable_expensive_passes=true")
# On a GPU, XLA autotunes GEMMs and Triton fusions while it compiles (it times every candidate
# kernel); the suite checks values, not speed, so level 0 takes each op's default kernel.
# Inherited by every subprocess the tests start, as the CPU flags are.
FAST_GPU_COMPILE = ("--xla_gpu_autotune_level=0",)
_GPU_MACHINE = shutil.which("nvidia-smi") is not None   # before jax starts
_FAST, _NAMED = ((FAST_GPU_COMPILE, "xla_gpu_autotune_level") if _GPU_MACHINE
                 else (FAST_CPU_COMPILE, "xla_backend_optimization_level"))
if _NAMED not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *_FAST]).strip()
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ   # else the user's, kept
if _OWN_CACHE:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="moe_jax_tests_xla_")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from configs import tiny  # noqa: E402
from pallas_kernels.platform import target_mesh  # noqa: E402,F401 (the tests import it here)

jax.config.update("jax_default_matmul_precision", "highest")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ON_GPU = jax.default_backend() == "gpu"


def pytest_unconfigure(config):
  if _OWN_CACHE and not hasattr(config, "workerinput"):   # the process that made it
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


def pytest_runtest_logreport(report):
  """With PYTEST_FAILURE_LOG set (gpu_suite.sh), each failure's traceback is appended there
  when it happens (by the controlling process only), not just in the summary at the end."""
  path = os.environ.get("PYTEST_FAILURE_LOG")
  if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
    with open(path, "a") as f:
      f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


def pytest_collection_modifyitems(config, items):
  if ON_GPU:
    # Longest first: the slow tier and the realistic-size kernel tests. gpu_suite.sh hands
    # tests out round-robin (xdist --dist load), so these start at once on separate workers
    # and none is left to run alone at the end of a half's time limit.
    items.sort(key=lambda item: not (item.get_closest_marker("slow")
                                     or item.get_closest_marker("gpu")))
    return
  skip = pytest.mark.skip(reason=f"needs a GPU (backend is {jax.default_backend()})")
  for item in items:
    if item.get_closest_marker("gpu"):   # the marker, not a parameter id that says "gpu"
      item.add_marker(skip)


def subprocess_env(**extra) -> dict:
  """This environment for a subprocess, with the repository first on PYTHONPATH (and what
  was there kept: packages installed with --target live there)."""
  path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
  return {**os.environ, "PYTHONPATH": path, **extra}


def load_script(name: str):
  """scripts/<name>.py as a module (scripts/ is a folder of entry points, not a package);
  loaded once a process, as its absl flags can be defined only once."""
  key = f"scripts_{name}"
  if key not in sys.modules:
    spec = importlib.util.spec_from_file_location(key, os.path.join(ROOT, "scripts", f"{name}.py"))
    sys.modules[key] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[key])
  return sys.modules[key]


def xla_flags_without(*prefixes: str) -> str:
  """This process's XLA_FLAGS less the flags that start with any of `prefixes`."""
  return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                  if not f.startswith(prefixes))


def cpu_devices_env(n: int) -> dict:
  """Environment for a subprocess with n fake CPU devices, whatever accelerator is here."""
  flags = xla_flags_without("--xla_force_host_platform_device_count")
  return subprocess_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={n} {flags}".strip(),
                        JAX_PLATFORMS="cpu")


@pytest.fixture
def absl_flags_parsed(request):
  """tokamax reads its absl flags on first use and, if nobody has parsed flags, parses
  sys.argv with every flag this process defines: a script module an earlier test imported
  in the same worker (scripts/train_tokenizer.py's required --output) then fails it. The
  flags are marked parsed for the test, as an absl program's main would have them."""
  from absl import flags
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
    request.addfinalizer(flags.FLAGS.unparse_flags)


@pytest.fixture
def x64():
  """float64 for the tests that compare with the float64 spec; scoped to the test, since
  x64 breaks kernels outside this project (jax's flash attention, tokamax) that mix int32
  and Python ints."""
  jax.config.update("jax_enable_x64", True)
  yield
  jax.config.update("jax_enable_x64", False)




def rel_err(a, b) -> float:
  """‖a − b‖ / ‖b‖ in float64."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def count_calls(monkeypatch, module, name) -> list:
  """Replaces module.name by a wrapper that appends to the returned list on every call (at
  trace time under jit): a test can assert that a kernel path was taken."""
  calls, real = [], getattr(module, name)
  monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
  return calls


@pytest.fixture
def small_config():
  return make_small_config()


def make_small_config():
  """The tiny config shrunk further so a step compiles and runs in about a second."""
  c = tiny.get_config("small")
  c.data.seq_len = 64
  c.data.batch_size = 4
  c.schedule.warmup_steps = 2
  c.eval.num_batches = 2
  c.checkpoint.every_steps = 3
  c.log.every_steps = 1
  return c
