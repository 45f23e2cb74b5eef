"""mla_implementation="cudnn": training attention by cuDNN's fused attention in its packed
layout (pallas_kernels/attention/cudnn_packed.py). On CPU: the description of each row's
documents cuDNN takes, and the dispatch. On a GPU: equal to written-out attention, forward
and backward, on packed documents with padding, and on ids cuDNN's layout cannot take (the
Pallas kernels then run)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.config import validate
from pallas_kernels.attention import cudnn_packed, ops, reference
from tests.conftest import make_small_config, rel_err


def test_runs_give_each_documents_offset_and_length():
  seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0],      # three documents, then padding
                     [5, 5, 5, 5, 5, 5, 5, 5],      # one
                     [1, 1, 2, 2, 1, 1, 0, 0]])     # id 1 in two runs: not cuDNN's
  offsets, lengths, ok = cudnn_packed.runs(seg, 4)
  np.testing.assert_array_equal(offsets, [[0, 3, 5, 6, -1], [0, -1, -1, -1, -1],
                                          [0, 2, 4, 6, -1]])
  np.testing.assert_array_equal(lengths, [[3, 2, 1, 2], [8, -1, -1, -1], [2, 2, 2, 2]])
  np.testing.assert_array_equal(ok, [True, True, False])
  assert not cudnn_packed.runs(seg, 3)[2][0]          # 4 runs over max_segments = 3


def test_dispatch_and_config():
  """"cudnn" takes cuDNN where it fits (bf16, head dims of 8 up to 256) and the Pallas kernels
  otherwise; ring steps and the latent cache run as "gpu"; the config accepts it."""
  bf, f32 = jnp.zeros((1, 16, 2, 192), jnp.bfloat16), jnp.zeros((1, 16, 2, 128), jnp.float32)
  assert cudnn_packed.fits(bf, bf[..., :128]) and not cudnn_packed.fits(f32, f32)
  assert not cudnn_packed.fits(jnp.zeros((1, 16, 2, 260), jnp.bfloat16), bf)
  assert ops.implementation("cudnn") == "cudnn"
  # Off a GPU "cudnn" runs as "gpu" (the Pallas kernels, interpreted here).
  seg = jnp.ones((1, 16), jnp.int32)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 16, 2, 16)), jnp.bfloat16)
  got = ops.causal_attention(x, x, x, seg, implementation="cudnn")
  want = reference.causal_attention(*(a.astype(jnp.float32) for a in (x, x, x)), seg)
  assert rel_err(got, want) < 1e-2
  assert ops.ring_step_implementation("cudnn", 256) == "pallas"
  c = make_small_config()
  c.model.mla_implementation = "cudnn"
  validate(c)
  c.model.mla_implementation = "flash"
  with pytest.raises(ValueError, match="model.mla_implementation.*'cudnn'"):
    validate(c)


@pytest.mark.gpu
@pytest.mark.parametrize("D,Dv", [(64, 64), (128, 128), (192, 128)])
def test_equals_written_out_attention_with_gradients(D, Dv):
  """bf16 on a GPU: o and dq, dk, dv against fp32 attention written out (reference), on
  packed documents with padding (cuDNN's path) and with an id in two runs (the Pallas
  kernels' path): within bf16 rounding (the Pallas kernels measure 2e-3)."""
  if jax.default_backend() != "gpu":
    pytest.skip(f"needs a GPU (backend is {jax.default_backend()})")
  rng = np.random.default_rng(D)
  B, T, H = 2, 512, 4
  q, k = (jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.bfloat16) for _ in range(2))
  v, do = (jnp.asarray(rng.normal(size=(B, T, H, Dv)), jnp.bfloat16) for _ in range(2))
  packed = np.zeros((B, T), np.int32)
  packed[0, :100], packed[0, 100:300], packed[0, 300:480] = 1, 2, 3   # then padding
  packed[1, :] = 7
  repeated = packed.copy()
  repeated[1, 200:260] = 1          # id 1 in row 1 too: one run, fine
  repeated[0, 300:480] = 1          # id 1 in two runs of row 0: the Pallas kernels
  for seg, cudnn_takes_it in ((jnp.asarray(packed), True), (jnp.asarray(repeated), False)):
    assert bool(jnp.all(cudnn_packed.runs(seg, cudnn_packed.MAX_SEGMENTS)[2])) == cudnn_takes_it
    o, vjp = jax.vjp(lambda *a: cudnn_packed.causal_attention(*a, seg), q, k, v)
    f32 = lambda x: x.astype(jnp.float32)
    o_ref, vjp_ref = jax.vjp(lambda *a: reference.causal_attention(*a, seg), f32(q), f32(k), f32(v))
    for name, a, b in zip(("o", "dq", "dk", "dv"), (o, *vjp(do)), (o_ref, *vjp_ref(f32(do)))):
      assert np.isfinite(np.asarray(f32(a))).all(), name
      assert rel_err(a, b) < 1e-2, (name, rel_err(a, b))
