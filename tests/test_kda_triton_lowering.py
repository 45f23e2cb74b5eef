"""The Pallas GPU kernels lower to Triton IR for CUDA (checked on CPU: CI has no GPU).

Interpret-mode tests prove the kernels' math; this proves every primitive they use has
a Triton lowering (e.g. value slicing does not), forward and backward, so a GPU run does
not fail on lowering. PTX compilation itself still happens only on the GPU machine.
"""

import collections
import re

import jax
import jax.numpy as jnp
import pytest
from jax._src.pallas.triton import gpu_info, pallas_call_registration

from pallas_kernels.kda import pallas_gpu


@pytest.fixture
def h200(monkeypatch):
  """Pretend the default GPU is an H200 so Triton lowering can run without one."""
  info = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
  monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: info)


@pytest.mark.parametrize("K,V,T,with_segments,gate", [
    (128, 128, 256, False, "none"), (64, 32, 200, True, "bounded"),
    (64, 32, 128, False, "unbounded_xla"), (128, 128, 200, True, "unbounded")])
def test_forward_and_backward_lower_to_triton(h200, K, V, T, with_segments, gate):
  """gate "none": g given; else the gate and the q/k L2 norm in the prologue kernel;
  "unbounded": unbounded gates on the Pallas stage 1 (elementwise diagonal tiles, the
  default); "unbounded_xla": on the XLA stage 1."""
  B, H = 1, 2
  bf = lambda *s: jnp.zeros(s, jnp.bfloat16)
  seg = jnp.ones((B, T), jnp.int32) if with_segments else None
  kw = {} if gate == "none" else dict(qk_l2norm=True,
                                      lower_bound=-5.0 if gate == "bounded" else None)
  if gate == "unbounded_xla":
    kw["unbounded_stage1"] = "xla"

  def fwd(q, k, v, g, beta, A_log, dt_bias):
    gate_params = {} if gate == "none" else dict(A_log=A_log, dt_bias=dt_bias)
    return pallas_gpu.kda_pallas_gpu(q, k, v, g, beta, segment_ids=seg, interpret=False,
                                     **gate_params, **kw)[0]

  def fwd_bwd(*args):
    o, vjp = jax.vjp(fwd, *args)
    return vjp(o)

  args = (bf(B, T, H, K), bf(B, T, H, K), bf(B, T, H, V), jnp.zeros((B, T, H, K)), bf(B, T, H),
          jnp.zeros(H), jnp.zeros(H * K))
  text = jax.jit(fwd_bwd).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  for kernel in ("kda_prologue", "kda_prologue_bwd", "kda_recurrence", "kda_recurrence_bwd",
                 "kda_recurrence_grads"):
    assert kernel in text
  for kernel in ("kda_intra_tiles", "kda_intra_solve", "kda_intra_wu", "kda_intra_wu_bwd",
                 "kda_intra_tiles_bwd"):
    assert (kernel in text) == (gate != "unbounded_xla")    # stage 1 in XLA


def test_layers_with_equal_shapes_share_one_lowering(h200):
  """Rematerialised KDA layers of one shape (as the model runs them) share their kernels'
  lowering: the op is jitted, so 2 layers and 4 layers lower each Triton kernel equally
  often (at most twice: the forward and its recomputation), and the step's lower time does
  not grow with depth."""
  B, T, H, K = 1, 128, 2, 64
  bf = lambda *s: jnp.zeros(s, jnp.bfloat16)
  args = (bf(B, T, H, K), bf(B, T, H, K), bf(B, T, H, K), jnp.zeros((B, T, H, K)), bf(B, T, H))

  def layer(x, k, v, g, beta):
    return pallas_gpu.kda_pallas_gpu(x, k, v, g, beta, interpret=False)[0]

  def stack(n):
    def loss(x, k, v, g, beta):
      for _ in range(n):
        x = jax.checkpoint(layer)(x, k, v, g, beta)
      return x.astype(jnp.float32).sum()
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))

  count = lambda n: collections.Counter(re.findall(
      r'name = "(kda_\w+)"', jax.jit(stack(n)).trace(*args).lower(
          lowering_platforms=("cuda",)).as_text()))
  two, four = count(2), count(4)
  assert len(two) == 10 and max(two.values()) <= 2, two   # the prologue, stage 1 and stage 2, fwd and bwd
  assert four == two
