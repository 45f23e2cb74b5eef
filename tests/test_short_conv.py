"""KDA's short convolution as Triton kernels (pallas_kernels/kda/triton_gpu_short_conv.py),
in Triton's interpreter here (natively in the GPU suite): the output and the gradients of x
and w against XLA's form (model/layers.py ShortConv: W shifted, segment-masked copies),
with a one-token segment, padding (id 0), and T and C off the tile; the model's ShortConv
with model.kda_conv_implementation = "triton" against "xla"; bad input; and the kernels'
sm_90a builds."""

import tempfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from benchmarks.kernel_registers import triton_report
from moe_jax.model.layers import ShortConv, segment_shift
from pallas_kernels import triton_launch
from pallas_kernels.kda import triton_gpu_short_conv as sc
from tests.conftest import rel_err

INTERPRET = jax.default_backend() != "gpu"


def _xla(x_BxTxC, w_WxC, seg_BxT):
  """ShortConv's XLA form, in x's dtype."""
  w_WxC = w_WxC.astype(x_BxTxC.dtype)
  return jax.nn.silu(sum(segment_shift(x_BxTxC, seg_BxT, j) * w_WxC[j]
                         for j in range(w_WxC.shape[0])))


def _inputs(dtype, B=2, T=150, C=200, W=4, seed=0):
  """T = 150 and C = 200: partial tiles in both (64 × 128). Row 0: documents of 40 tokens,
  1 token and the rest; row 1: one document, then padding (id 0) from 130."""
  rng = np.random.default_rng(seed)
  seg = np.ones((B, T), np.int32)
  seg[0, 40:], seg[0, 41:] = 2, 3
  seg[1, 130:] = 0
  x = jnp.asarray(rng.normal(size=(B, T, C)), dtype)
  w = jnp.asarray(rng.normal(size=(W, C)) * 0.5, jnp.float32)
  ct = jnp.asarray(rng.normal(size=(B, T, C)), jnp.float32)
  return x, w, jnp.asarray(seg), ct


# The Triton conv is an opt-in (XLA's is the default): make test keeps fp32 at Kimi's width 4.
@pytest.mark.parametrize("dtype,bound,W", [
    ("float32", 1e-6, 4), pytest.param("bfloat16", 5e-3, 4, marks=pytest.mark.slow),
    pytest.param("float32", 1e-6, 3, marks=pytest.mark.slow)])
def test_matches_xla_with_gradients(dtype, bound, W):
  """Against XLA's form in fp32 on the same (rounded) inputs: fp32 to 1e-6 (measured
  ≤ 1.6e-7); bf16 to its output rounding (measured 2.4e-3 / 3.0e-3 / 2.5e-3 for y, dx,
  dw, where XLA's form in bf16 is 5.0e-3 / 5.1e-3 / 1.0e-2). W = 3: dz's taps padded to 4."""
  x, w, seg, ct = _inputs(jnp.dtype(dtype), W=W)
  loss = lambda f: lambda x, w: (f(x, w.astype(x.dtype), seg).astype(jnp.float32) * ct).sum()
  got = sc.short_conv(x, w.astype(x.dtype), seg, interpret=INTERPRET)
  gx, gw = jax.grad(loss(lambda *a: sc.short_conv(*a, interpret=INTERPRET)), (0, 1))(x, w)
  with jax.default_matmul_precision("highest"):
    ref = _xla(x.astype(jnp.float32), w, seg)
    rx, rw = jax.grad(loss(_xla), (0, 1))(x.astype(jnp.float32), w)
  assert got.dtype == x.dtype and gx.dtype == x.dtype and gw.dtype == jnp.float32
  for name, a, b in (("y", got, ref), ("dx", gx, rx), ("dw", gw, rw)):
    a = a.astype(jnp.float32)
    assert bool(jnp.isfinite(a).all()) and float(jnp.abs(b).max()) > 0, name
    assert rel_err(a, b) < bound, name
  # Nothing crosses a document edge: the one-token document's output is silu(x·w[0]).
  np.testing.assert_allclose(np.asarray(got[0, 40], np.float32),
                             np.asarray(jax.nn.silu(x[0, 40].astype(jnp.float32) * w[0]
                                                    .astype(x.dtype).astype(jnp.float32))),
                             rtol=1e-2 if dtype == "bfloat16" else 1e-6, atol=1e-6)


def test_model_short_conv_takes_the_kernels_when_configured():
  """ShortConv with model.kda_conv_implementation = "triton" gives XLA's output and
  parameter gradient (fp32: to 1e-6)."""
  x, _, seg, ct = _inputs(jnp.float32, T=70, C=48)
  outs = {}
  for impl in ("xla", "triton"):
    cfg = ml_collections.ConfigDict({"kda_conv_implementation": impl})
    conv = ShortConv(cfg, 4)
    params = nn.unbox(conv.init(jax.random.key(0), x, seg))
    loss = lambda p: (conv.apply(p, x, seg) * ct).sum()
    outs[impl] = (conv.apply(params, x, seg), jax.grad(loss)(params)["params"]["kernel"])
  for a, b in zip(outs["triton"], outs["xla"]):
    assert rel_err(a, b) < 1e-6


def test_bad_input_is_named():
  x = jnp.ones((2, 8, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"w \(4, 8\) and segment ids \(2, 8\) do not agree"):
    sc.short_conv(x, jnp.ones((4, 8), jnp.bfloat16), jnp.ones((2, 8), jnp.int32))
  with pytest.raises(ValueError, match="bfloat16/float16/float32 x, got int32"):
    sc.short_conv(jnp.ones((2, 8, 16), jnp.int32), jnp.ones((4, 16)), jnp.ones((2, 8)))


def test_config_names_a_bad_conv_implementation():
  from moe_jax import config as config_lib
  from tests.conftest import make_small_config
  c = make_small_config()
  c.model.kda_conv_implementation = "cuda"
  with pytest.raises(ValueError, match=r"model.kda_conv_implementation must be one of "
                                       r"\('', 'xla', 'triton'\), got 'cuda'"):
    config_lib.validate(c)


def test_compiles_for_h200_without_spills():
  """The three kernels in bf16 at single_h200's widths (C = 16 × 128), built as jax_triton
  builds them for sm_90a: no spills, within shared memory, and at most 128 registers a
  thread (a memory-bound kernel wants several programs an SM)."""
  B, T, C, W = 2, 8192, 2048, 4
  bf = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  seg = jax.ShapeDtypeStruct((B, T), jnp.int32)
  meta = dict(T=T, C=C, W=W, BT=sc.BLOCK_T, BC=sc.BLOCK_C)
  dz_meta = dict(meta, **sc.dz_meta(W))
  parts = f32(B, T // (sc.DZ_BLOCK_T * sc.DZ_TILES), W, C)
  for kernel, arrays, m in (
      (sc._short_conv_triton, [bf(B, T, C), bf(W, C), seg, bf(B, T, C)], meta),
      (sc._short_conv_dz_triton, [bf(B, T, C), bf(W, C), seg, bf(B, T, C), f32(B, T, C),
                                  parts], dz_meta),
      (sc._short_conv_dx_triton, [f32(B, T, C), bf(W, C), seg, bf(B, T, C)], meta)):
    compiled = triton_launch.build(kernel, arrays, m, 1, sc.WARPS)
    regs, spilled = triton_report(compiled, tempfile.mkdtemp())
    assert compiled.metadata.shared <= triton_launch.MAX_SHARED[90], kernel.__name__
    assert 0 < regs <= 128 and spilled == 0, (kernel.__name__, regs, spilled)
