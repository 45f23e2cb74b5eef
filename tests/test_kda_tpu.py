"""KDA on the Mosaic TPU kernels (pallas_kernels/kda/pallas_tpu*.py), checked on CPU: in
Pallas's TPU interpreter against the float64 recurrent spec (outputs, final state, every
gradient) and against tokamax's Mosaic TPU KDA, and lowered for a TPU with jax.export.
The interpreter is slow, so the shapes are the smallest that still span several chunks."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import tpu_info
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kda import kda, reference
from tests.conftest import rel_err, target_mesh
from tests.test_kda import LB, _inputs

x64 = pytest.mark.usefixtures("x64")   # the spec runs in float64 (tokamax does not take it)

NAMES = ["q", "k", "v", "g", "beta", "initial_state"]


def _packed(T, lengths):
  seg = np.zeros((1, T), np.int32)
  for i, (s, n) in enumerate(zip(np.cumsum([0] + lengths[:-1]), lengths)):
    seg[0, s:s + n] = i + 1
  return jnp.asarray(seg)


def _value_and_grads(impl, args, S0, seg, w_o, w_S, chunk=64, lower_bound=LB):
  def loss(q, k, v, g, beta, S0):
    if impl == "spec":
      o, S = reference.kda_recurrent(q, k, v, g, beta, initial_state=S0, segment_ids=seg)
    else:
      o, S = kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, segment_ids=seg,
                 chunk_size=chunk, lower_bound=lower_bound, implementation=impl)
    return (o.astype(jnp.float64) * w_o).sum() + (S.astype(jnp.float64) * w_S).sum(), (o, S)
  (_, (o, S)), grads = jax.value_and_grad(loss, argnums=range(6), has_aux=True)(*args, S0)
  return o, S, grads


CASES = {  # (B, T, H, K, V, chunk, packed lengths or None)
    # three documents and padding over 3 chunks, T no multiple of C, a quarter of the gates
    # exactly at the bound, K ≠ V
    "packed_C16": (1, 40, 2, 64, 32, 16, [10, 20, 7]),
    # two rows, K = V = 128, one chunk and a remainder
    "K128_C64": (2, 70, 1, 128, 128, 64, None),
}


@x64
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_fp32_matches_fp64_spec_with_gradients(case):
  B, T, H, K, V, chunk, lengths = case
  (q, k, v, g, beta), S0 = _inputs(B, T, H, K, V, seed=T)
  at_bound = np.random.default_rng(0).random(g.shape) < 0.25
  g = jnp.where(at_bound, LB, g)
  seg = _packed(T, lengths) if lengths else None
  rng = np.random.default_rng(1)
  w_o, w_S = rng.normal(size=(B, T, H, V)), rng.normal(size=(B, H, K, V))
  o_ref, S_ref, g_ref = _value_and_grads("spec", (q, k, v, g, beta), S0, seg, w_o, w_S)
  f32 = tuple(x.astype(jnp.float32) for x in (q, k, v, g, beta))
  o, S, grads = _value_and_grads("pallas_tpu", f32, S0.astype(jnp.float32), seg, w_o, w_S,
                                 chunk=chunk)
  assert o.shape == (B, T, H, V) and o.dtype == jnp.float32 and S.shape == (B, H, K, V)
  assert rel_err(o, o_ref) <= 1e-4 and rel_err(S, S_ref) <= 1e-4
  for name, a, b in zip(NAMES, grads, g_ref):
    assert np.isfinite(np.asarray(a)).all(), name
    assert rel_err(a, b) <= 1e-4, name
  if lengths:
    assert float(jnp.abs(o[:, sum(lengths):]).max()) == 0.0   # padding outputs zeros


@x64
def test_bf16_inputs_within_1e2():
  B, T, H, K, V = 1, 70, 2, 64, 64
  (q, k, v, g, beta), S0 = _inputs(B, T, H, K, V, seed=11)
  rng = np.random.default_rng(2)
  w_o, w_S = rng.normal(size=(B, T, H, V)), rng.normal(size=(B, H, K, V))
  o_ref, _, g_ref = _value_and_grads("spec", (q, k, v, g, beta), S0, None, w_o, w_S)
  bf = lambda x: x.astype(jnp.bfloat16)
  args = (bf(q), bf(k), bf(v), g.astype(jnp.float32), bf(beta))
  o, _, grads = _value_and_grads("pallas_tpu", args, S0.astype(jnp.float32), None, w_o, w_S)
  assert o.dtype == jnp.bfloat16 and rel_err(o, o_ref) <= 1e-2
  for name, a, b in zip(NAMES, grads, g_ref):
    assert rel_err(a, b) <= 1e-2, name


@x64
def test_unbounded_gates_take_the_safe_path():
  """Legacy gates far below -5 (lower_bound=None): the elementwise-diagonal stage 1 in XLA,
  the Pallas recurrence; finite and accurate."""
  (q, k, v, _, beta), S0 = _inputs(1, 70, 2, 32, 16, seed=5)
  g = -jnp.abs(q) * 1e3 - 10.0
  o_ref, S_ref = reference.kda_recurrent(q, k, v, g, beta, initial_state=S0)
  f32 = tuple(x.astype(jnp.float32) for x in (q, k, v, g, beta))
  o, S = kda(*f32, initial_state=S0.astype(jnp.float32), output_final_state=True,
             chunk_size=32, lower_bound=None, implementation="pallas_tpu")
  assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(S)).all()
  assert rel_err(o, o_ref) <= 1e-4 and rel_err(S, S_ref) <= 1e-4


@pytest.mark.slow   # 15 s on 2 cores; make test keeps pallas_tpu against the fp64 spec
def test_matches_tokamax_mosaic_tpu_kda(monkeypatch, absl_flags_parsed):
  """tokamax 0.0.17's Mosaic TPU KDA (head-first [H, B, T, D], per-segment states, chunk 64)
  and ours, both interpreted, on the same log-space gates bounded by -5: outputs, final
  state and gradients agree to fp32 rounding. tokamax gates its kernel to TPU v6+ and reads
  the chip from the device, so the test presents a v6e and bypasses its device check."""
  from tokamax._src.ops.kda import pallas_mosaic_tpu as tk

  monkeypatch.setenv("PALLAS_INTERPRET", "1")
  monkeypatch.setattr(pltpu, "get_tpu_info",
                      lambda: tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V6E, 1))
  B, T, H, K, V = 1, 128, 2, 64, 64
  (q, k, v, g, beta), S0 = _inputs(B, T, H, K, V, seed=7)
  q, k, v, g, beta, S0 = (x.astype(jnp.float32) for x in (q, k, v, g, beta, S0))
  w_o = jnp.asarray(np.random.default_rng(3).normal(size=(B, T, H, V)), jnp.float32)
  heads_first = lambda x: jnp.moveaxis(x, 2, 0)
  op = tk.PallasMosaicTpuKimiDeltaAttention(config=tk.Config(chunk_size=64),
                                            bypass_device_check=True)

  def theirs(q, k, v, g, beta):
    o, S = op(*map(heads_first, (q, k, v, g, beta)), initial_state=S0[:, None],
              output_final_state=True, lower_bound=LB)
    return (jnp.moveaxis(o, 0, 2) * w_o).sum(), (jnp.moveaxis(o, 0, 2), S[:, 0])

  def ours(q, k, v, g, beta):
    o, S = kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, lower_bound=LB,
               implementation="pallas_tpu")
    return (o * w_o).sum(), (o, S)

  (_, (o_t, S_t)), g_t = jax.value_and_grad(theirs, argnums=range(5), has_aux=True)(
      q, k, v, g, beta)
  (_, (o, S)), g_o = jax.value_and_grad(ours, argnums=range(5), has_aux=True)(q, k, v, g, beta)
  assert rel_err(o, o_t) <= 1e-5 and rel_err(S, S_t) <= 1e-5
  for name, a, b in zip(NAMES, g_o, g_t):
    assert rel_err(a, b) <= 1e-4, name


def test_lowers_to_mosaic_for_tpu():
  """Under a mesh of (abstract) TPU devices, implementation=None picks pallas_tpu and the
  gradient program exported for TPU holds the four Mosaic kernels, not the interpreter."""
  S = lambda dt, *s: jax.ShapeDtypeStruct(s, dt)
  bf, f32 = jnp.bfloat16, jnp.float32
  args = (S(bf, 1, 128, 2, 64), S(bf, 1, 128, 2, 64), S(bf, 1, 128, 2, 64),
          S(f32, 1, 128, 2, 64), S(f32, 1, 128, 2))
  loss = lambda *a: kda(*a, lower_bound=LB)[0].astype(f32).sum()
  with target_mesh():
    exported = jax.export.export(jax.jit(jax.grad(loss, argnums=range(5))),
                                 platforms=["tpu"])(*args)
  text = exported.mlir_module()
  assert set(re.findall(r'kernel_name = \\?"([\w-]+)', text)) == {
      "kda_tpu_intra", "kda_tpu_intra_bwd", "kda_tpu_recurrence", "kda_tpu_recurrence_bwd"}
