"""model.moe.decode_dispatch = "layer": a whole MoE layer at decode as three Pallas kernels
(pallas_kernels/moe/pallas_gpu_decode_layer.py), in interpret mode on CPU. The routing kernel
must pick router.select's experts with its weights; the expert kernels must give the
gathered SwiGLUs plus the shared expert; the model's decode step must give the XLA path's
logits and record the routes it ran; and the kernels compile for the H200 without spills."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.kernel_registers import dump_ttir, ptxas_report
from moe_jax.infer.cache import init_cache
from moe_jax.infer.generate import inference_model, make_step, prefill
from moe_jax.model import moe, router
from moe_jax.train.state import frozen_model_config
from pallas_kernels.moe import ops as moe_ops, pallas_gpu_decode_layer as layer
from pallas_kernels.moe import reference
from tests.conftest import count_calls, make_small_config, rel_err
from tests.test_kda_decode import _decode


@pytest.mark.parametrize("score,router_dtype,k", [("sigmoid", jnp.float32, 3),
                                                  ("softmax", jnp.float32, 2),
                                                  ("sigmoid", jnp.bfloat16, 4)])
def test_route_picks_router_select_experts_and_weights(score, router_dtype, k):
  """k = 3: the ids and weights padded to 4 slots, the last weighing 0. A bias moves the
  choice, never the weights. A bf16 router's logits are rounded to bf16 after a sum whose
  order is the backend's (a cuBLAS product on a GPU, the kernel's own reduction): the ids
  must agree, the weights within a bf16 step of the logits (2^-8; measured 5.1e-4 on an
  H100, exact on CPU)."""
  rng = np.random.default_rng(0)
  N, W, E = 5, 128, 16
  x = jnp.asarray(rng.normal(size=(N, W)), jnp.bfloat16)
  kernel = jnp.asarray(rng.normal(size=(W, E)) * 0.1, jnp.float32)
  bias = jnp.asarray(rng.normal(size=E) * 0.3, jnp.float32)
  idx, w = layer.route(x, kernel, bias, k, score, 2.5, router_dtype, interpret=True)
  name = "float32" if router_dtype == jnp.float32 else "bfloat16"
  want_idx, want_w = router.select(router.logits(x, kernel, name), bias, k, score, 2.5)
  KP = 1 << (k - 1).bit_length()
  assert idx.shape == w.shape == (N, KP) and idx.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(idx[:, :k]), np.asarray(want_idx))
  assert rel_err(w[:, :k], want_w) < (1e-5 if router_dtype == jnp.float32 else 2 ** -8)
  np.testing.assert_allclose(np.asarray(w[:, :k]).sum(-1), 2.5, rtol=1e-5)
  assert (np.asarray(w[:, k:]) == 0).all()


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("dtype,bound", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_layer_equals_gathered_experts_plus_shared(dtype, bound, shared):
  rng = np.random.default_rng(1)
  N, k, E, D, F = 3, 2, 4, 128, 192
  x = jnp.asarray(rng.normal(size=(N, D)), dtype)
  idx = jnp.asarray([[3, 0], [0, 0], [2, 3]], jnp.int32)   # repeats, across and within rows
  w = jnp.asarray([[0.7, 0.3], [0.5, 0.5], [0.1, 0.9]], jnp.float32)
  gate_up = jnp.asarray(rng.normal(size=(E, D, 2, F)) / np.sqrt(D), dtype)
  down = jnp.asarray(rng.normal(size=(E, F, D)) / np.sqrt(F), dtype)
  sh = tuple(jnp.asarray(rng.normal(size=s) / np.sqrt(s[0]), jnp.float32)
             for s in ((D, F), (D, F), (F, D))) if shared else None
  got = layer.moe_layer(x, idx, w, k, gate_up, down, sh, interpret=True)
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  y_NxKxD = reference.swiglu_experts(f32(x), idx[:, :k], f32(gate_up), f32(down))
  want = jnp.einsum("nkd,nk->nd", y_NxKxD, w[:, :k])
  if shared:
    g, u, d = (f32(a.astype(dtype)) for a in sh)
    want = want + (jax.nn.silu(f32(x) @ g) * (f32(x) @ u)) @ d
  assert got.shape == (N, D) and got.dtype == dtype
  assert rel_err(got, want) < bound


def test_tiles_split_the_contracted_dims_into_one_step_programs():
  """long_context_1b's experts (D 1024, F 704): the up kernel's programs read one 64 × 64
  tile of gate and of up (16 parts of D), the down kernel's one 32 × 256 tile (22 row
  blocks of F); Kimi Linear's (2304, 1024): 4 parts of D (the down kernel reads them as one
  power-of-two tile), 9 steps each."""
  assert layer.up_tiles(1024, 704) == (64, 64, 16) and layer.down_tiles(1024, 704) == (32, 256)
  assert layer.up_tiles(2304, 1024) == (64, 64, 4) and layer.down_tiles(2304, 1024) == (32, 256)
  assert layer.up_tiles(128, 192) == (64, 64, 2) and layer.down_tiles(128, 192) == (64, 128)


def test_layer_rejects_shapes_it_cannot_tile():
  with pytest.raises(ValueError, match=r"E a power of two; got D=128, F=128, E=6"):
    layer.moe_layer(jnp.ones((1, 128)), jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2)), 2,
                    jnp.ones((6, 128, 2, 128)), jnp.ones((6, 128, 128)), interpret=True)
  with pytest.raises(ValueError, match=r"one shared expert as wide as a routed one"):
    layer.moe_layer(jnp.ones((1, 128)), jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2)), 2,
                    jnp.ones((4, 128, 2, 128)), jnp.ones((4, 128, 128)),
                    (jnp.ones((128, 256)), jnp.ones((128, 256)), jnp.ones((256, 128))),
                    interpret=True)


@pytest.mark.parametrize("dtype,bound", [("float32", 1e-5),
                                         pytest.param("bfloat16", 2e-2, marks=pytest.mark.slow)])
def test_decode_step_equals_the_xla_path(dtype, bound, monkeypatch):
  """Prefill, then token by token (row 1 padding after 2 tokens): the same logits as the
  default decode path; bf16 sums in another order (measured 3.2e-3)."""
  c = make_small_config()
  c.model.update({"dtype": dtype, "n_layers": 2, "layer_pattern": "KA"})
  tokens = np.random.default_rng(1).integers(0, 256, (2, 10)).astype(np.int32)
  lengths = np.array([10, 6])
  want, _ = _decode(c, "xla", tokens, 4, lengths)
  c.model.moe.decode_dispatch = "layer"
  calls = count_calls(monkeypatch, moe_ops, "decode_layer")
  got, _ = _decode(c, "xla", tokens, 4, lengths)
  assert calls, "the layer kernels did not run"
  assert np.isfinite(got).all()
  assert rel_err(got[:, 0], want[:, 0]) < bound and rel_err(got[:2, 1], want[:2, 1]) < bound


def test_recorded_routes_are_the_kernels(monkeypatch):
  """A recording step (GRPO rollouts) returns the experts the kernels ran: those of
  router.select on the same logits (fp32)."""
  c = make_small_config()
  c.model.update({"dtype": "float32", "n_layers": 2, "layer_pattern": "KA"})
  c.model.moe.decode_dispatch = "layer"
  model = inference_model(frozen_model_config(c))
  tokens = np.random.default_rng(2).integers(0, 256, (2, 6)).astype(np.int32)
  batch = {"tokens": tokens, "segment_ids": np.ones((2, 6), np.int32)}
  variables = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), batch))
  cache = init_cache(model.cfg, 2, 8)
  _, cache = prefill(make_step(model), variables, cache, tokens[:, :5], np.full(2, 5), chunk=5)
  calls = count_calls(monkeypatch, moe_ops, "decode_route")
  _, _, routes = jax.jit(make_step(model, record_routes=True))(
      variables, tokens[:, 5:], np.ones((2, 1), bool), cache)
  c.model.moe.decode_dispatch = "gather"
  ref = inference_model(frozen_model_config(c))
  _, _, want = jax.jit(make_step(ref, record_routes=True))(
      variables, tokens[:, 5:], np.ones((2, 1), bool), cache)
  assert calls and set(routes) == set(want) == {"layer_1"}
  np.testing.assert_array_equal(np.asarray(routes["layer_1"]), np.asarray(want["layer_1"]))


@pytest.mark.parametrize("N,D,F,E,k", [(1, 1024, 704, 32, 4), (8, 1024, 704, 32, 4),
                                       (1, 2304, 1024, 256, 8)])
def test_compiles_for_h200_without_spills(N, D, F, E, k, tmp_path):
  """long_context_1b's MoE layers at batch 1 and 8, and Kimi Linear's (256 experts, top-8),
  each with one shared expert: lowered for an H200 and compiled for sm_90a by ptxas."""
  bf = lambda *s: jnp.zeros(s, jnp.bfloat16)

  def step(x, kernel, bias, gate_up, down, shared):
    idx, w = layer.route(x, kernel, bias, k, "sigmoid", 2.5, jnp.bfloat16, interpret=False)
    return layer.moe_layer(x, idx, w, k, gate_up, down, shared, interpret=False)

  args = (bf(N, D), jnp.zeros((D, E)), jnp.zeros(E), bf(E, D, 2, F), bf(E, F, D),
          (jnp.zeros((D, F)), jnp.zeros((D, F)), jnp.zeros((F, D))))
  kernels = dump_ttir(step, args, str(tmp_path))
  assert set(kernels) == {"decode_moe_route", "decode_moe_up", "decode_moe_down"}
  for name, warps in kernels.items():
    registers, spilled = ptxas_report(str(tmp_path / f"{name}.ttir"), warps)
    assert registers <= 255 and spilled == 0, (name, registers, spilled)


def test_gradients_through_a_decode_sized_batch_are_the_xla_paths():
  """The kernels are forward only: a loss on a batch of N·k ≤ E assignments under "layer"
  differentiates through the XLA path at the kernels' experts, as "gather" does (fp32):
  every parameter's gradient, the first layer's included."""
  c = make_small_config()
  # MLA layers only: KDA's gate parameters below would take gradients that cancel to a few
  # per cent of their terms, so any fp32 reordering above them shows there (1.5-2.5%
  # between the "fused" and "gather" paths, whose backward is the same function).
  c.model.update({"dtype": "float32", "n_layers": 2, "layer_pattern": "A"})
  tokens = np.random.default_rng(3).integers(0, 256, (1, 3)).astype(np.int32)
  batch = {"tokens": tokens, "segment_ids": np.ones((1, 3), np.int32)}

  def grads(decode_dispatch):
    c.model.moe.decode_dispatch = decode_dispatch
    model = inference_model(frozen_model_config(c))
    variables = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), batch))
    loss = lambda p: jnp.sum(model.apply({**variables, "params": p}, batch)[0] ** 2)
    return jax.jit(jax.value_and_grad(loss))(variables["params"])

  (got_loss, got), (want_loss, want) = grads("layer"), grads("gather")
  assert abs(float(got_loss) - float(want_loss)) <= 1e-5 * abs(float(want_loss))
  flat = jax.tree_util.tree_leaves_with_path(want)
  assert any("gate_up" in jax.tree_util.keystr(k) for k, _ in flat)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    assert np.isfinite(np.asarray(a)).all(), jax.tree_util.keystr(path)
    assert rel_err(a, b) < 1e-5, jax.tree_util.keystr(path)


def test_auto_takes_the_layer_kernels_on_gpu_only():
  """"auto" (the default) decodes an MoE layer with these kernels on a GPU, where the router
  is narrow enough for the route kernel's few loop steps (MoE._decode_layer_kernels checks
  the rest), XLA's paths elsewhere; "layer" asks anywhere."""
  lc1b, kimi = (1024, 32), (2304, 256)
  assert layer.route_steps(*lc1b) == 4 and layer.route_steps(*kimi) == 72
  assert moe.decode_layer_wanted("auto", *lc1b, "gpu")
  assert moe.decode_layer_wanted("layer", *lc1b, "cpu") and moe.decode_layer_wanted("layer", *kimi, "gpu")
  assert not moe.decode_layer_wanted("auto", *kimi, "gpu")
  assert not moe.decode_layer_wanted("auto", *lc1b, "cpu")
  assert not moe.decode_layer_wanted("auto", *lc1b, "tpu")
  assert not any(moe.decode_layer_wanted(d, *lc1b, "gpu") for d in ("gather", "fused", "grouped"))
