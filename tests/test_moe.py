"""MoE layer and router: routing vs a per-token loop, capacity drops, balancers, router clip,
expert parallelism on 8 fake devices."""

import functools
import json
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from configs import base
from moe_jax import config as config_lib
from moe_jax.model import moe as moe_lib
from moe_jax.model import router
from moe_jax.model.moe import MoE
from moe_jax.train import optim
from moe_jax.train.state import frozen_model_config
from pallas_kernels import platform
from pallas_kernels.moe import ops as moe_ops
from pallas_kernels.moe import pallas_gpu_decode_experts as decode_experts
from tests.conftest import ROOT, count_calls, cpu_devices_env, make_small_config, rel_err



def _moe_cfg(**moe):
  c = make_small_config()
  c.model.dtype = "float32"
  c.model.d_model = 32
  c.model.moe.update({"num_experts": 8, "top_k": 3, "num_shared": 1, "expert_hidden": 24,
                      "route_scale": 2.5, "router_init_scale": 0.5, **moe})
  return frozen_model_config(c)


def _init(cfg, x, seed=0):
  variables = nn.meta.unbox(jax.jit(MoE(cfg).init)(jax.random.key(seed), x))
  # A bias that really moves selection: pushes expert 0 up, expert 1 down.
  bias = jnp.zeros(cfg.moe.num_experts).at[0].set(0.3).at[1].set(-0.3)
  return {**variables, "router": {**variables["router"], "bias": bias}}


def _swiglu(x, w_in, w_out):
  h = x @ w_in.reshape(w_in.shape[0], -1)
  gate, up = np.split(h, 2, axis=-1)
  return (gate / (1 + np.exp(-gate)) * up) @ w_out


def _naive(cfg, variables, x_BxTxD, capacity_C=None):
  """Token by token in float64: selection by score+bias, weights from unbiased scores."""
  mc, p = cfg.moe, jax.tree.map(lambda a: np.asarray(a, np.float64), variables["params"])
  bias = np.asarray(variables["router"]["bias"], np.float64)
  x_NxD = np.asarray(x_BxTxD, np.float64).reshape(-1, x_BxTxD.shape[-1])
  taken = np.zeros(mc.num_experts, int)
  y = np.zeros_like(x_NxD)
  chosen, dropped = [], 0
  for n, x in enumerate(x_NxD):
    s = 1 / (1 + np.exp(-(x @ p["router_kernel"])))
    top = np.argsort(-(s + bias), kind="stable")[:mc.top_k]
    chosen.append(top)
    w = s[top] / s[top].sum() * mc.route_scale
    for j, e in enumerate(top):
      taken[e] += 1
      if capacity_C is not None and taken[e] > capacity_C:
        dropped += 1
        continue
      y[n] += w[j] * _swiglu(x, p["gate_up"][e], p["down"][e])
    sh = p["shared"]
    y[n] += _swiglu(x, np.concatenate([sh["gate"]["kernel"], sh["up"]["kernel"]], -1),
                    sh["down"]["kernel"])
  return y.reshape(x_BxTxD.shape), np.array(chosen), dropped


@pytest.mark.parametrize("dispatch,T,decode", [("dropless", 24, "gather"),
                                               ("capacity", 24, "gather"),
                                               ("dropless", 1, "gather"),  # 2·1·k ≤ E
                                               ("dropless", 1, "grouped"),
                                               ("dropless", 1, "fused")])
def test_routing_equals_per_token_loop(dispatch, T, decode, monkeypatch):
  """"fused": the decode-experts kernels in interpret mode, blocks shrunk to fit D=32, F=24."""
  monkeypatch.setattr(decode_experts, "BLOCK_D", 16)
  monkeypatch.setattr(decode_experts, "BLOCK_F", 8)
  calls = count_calls(monkeypatch, moe_ops, "decode_experts")
  cfg = _moe_cfg(dispatch=dispatch, capacity_factor=8.0 / 3.0,  # C = N: nothing dropped
                 decode_dispatch=decode)
  x = jax.random.normal(jax.random.key(1), (2, T, 32))
  variables = _init(cfg, x)
  y, stats = MoE(cfg).apply(variables, x)
  ref, chosen, _ = _naive(cfg, variables, x)
  assert rel_err(y, ref) < 1e-5
  assert float(stats["dropped_fraction"]) == 0.0
  load = np.bincount(chosen.ravel(), minlength=8) / chosen.size
  np.testing.assert_allclose(stats["load"], load, atol=1e-7)
  # The bias changed the selection (vs. no bias) but the weights use unbiased scores only.
  unbiased = {**variables, "router": {**variables["router"], "bias": jnp.zeros(8)}}
  _, chosen0, _ = _naive(cfg, unbiased, x)
  assert (np.sort(chosen, 1) != np.sort(chosen0, 1)).any() or T == 1
  assert bool(calls) == (decode == "fused" and T == 1)


def test_weights_before_down_layer_equals_per_token_loop():
  """The MoE layer with model.moe.weights_before_down against the float64 per-token loop
  (weights after the experts), and the router's gradient, now from the SwiGLU's backward,
  against the default layer's."""
  x = jax.random.normal(jax.random.key(1), (2, 24, 32))
  cfg, cfg0 = _moe_cfg(weights_before_down=True), _moe_cfg()
  variables = _init(cfg, x)
  assert rel_err(MoE(cfg).apply(variables, x)[0], _naive(cfg, variables, x)[0]) < 1e-5
  grad = lambda c: jax.grad(lambda p: (MoE(c).apply({**variables, "params": p}, x)[0] ** 2
                                       ).sum())(variables["params"])["router_kernel"]
  g, g0 = grad(cfg), grad(cfg0)
  assert float(jnp.abs(g0).max()) > 0 and rel_err(g, g0) < 1e-5


def test_capacity_drops_exactly_the_overflow():
  cfg = _moe_cfg(dispatch="capacity", capacity_factor=0.5)
  x = jax.random.normal(jax.random.key(2), (2, 24, 32))
  variables = _init(cfg, x)
  y, stats = MoE(cfg).apply(variables, x)
  N, K, E = 48, 3, 8
  C = int(np.ceil(0.5 * N * K / E))
  ref, chosen, dropped = _naive(cfg, variables, x, capacity_C=C)
  counts = np.bincount(chosen.ravel(), minlength=E)
  assert dropped == np.maximum(counts - C, 0).sum() > 0
  assert abs(float(stats["dropped_fraction"]) - dropped / (N * K)) < 1e-7
  assert rel_err(y, ref) < 1e-5  # kept assignments unchanged, dropped ones contribute nothing


def _dropless_problem(N=40, K=3, E=8, D=16, F=12):
  ks = jax.random.split(jax.random.key(11), 5)
  x = jax.random.normal(ks[0], (N, D))
  idx = jnp.argsort(jax.random.uniform(ks[1], (N, E)), axis=1)[:, :K]
  w = jax.random.uniform(ks[2], (N, K))
  gu = jax.random.normal(ks[3], (E, D, 2, F)) * D ** -0.5
  dn = jax.random.normal(ks[4], (E, F, D)) * F ** -0.5
  return x, idx, w, gu, dn


@pytest.mark.parametrize("weights_before_down", [False, True])
def test_dropless_dispatch_has_the_gathered_gradient(weights_before_down):
  """The sorted dispatch (permute_rows: a gather forward, the inverse gather backward)
  against each assignment's expert weights gathered and applied directly, values and the
  gradients of x, the combine weights and both expert weights; also with the weights
  applied before the down projection (model.moe.weights_before_down), which is the same
  function."""
  x, idx, w, gu, dn = _dropless_problem()
  c = jax.random.normal(jax.random.key(12), x.shape)
  dropless = functools.partial(moe_lib.dropless, weights_before_down=weights_before_down)
  loss = lambda f: lambda *a: (f(a[0], idx, a[1], a[2], a[3]) * c).sum()
  args = (x, w, gu, dn)
  value, grads = jax.value_and_grad(loss(dropless), argnums=(0, 1, 2, 3))(*args)
  value_ref, grads_ref = jax.value_and_grad(loss(moe_lib.gathered), argnums=(0, 1, 2, 3))(*args)
  assert abs(float(value) - float(value_ref)) < 1e-5 * abs(float(value_ref))
  for name, g, g_ref in zip(("x", "w", "gate_up", "down"), grads, grads_ref):
    assert float(jnp.abs(g_ref).max()) > 0 and rel_err(g, g_ref) < 1e-5, name


def test_weights_before_down_stores_no_expert_output_rows():
  """Under the `kernels` remat policy (which saves the expert matmuls' outputs moe_h and
  moe_y), the weights-before-down backward keeps no [N·k, D] expert output: the weights'
  gradient comes from the SwiGLU's backward instead of the combine's."""
  from moe_jax.model import remat
  x, idx, w, gu, dn = _dropless_problem()
  A, D = idx.size, x.shape[1]
  for before, expected in ((False, 1), (True, 0)):
    f = jax.checkpoint(functools.partial(moe_lib.dropless, weights_before_down=before),
                       policy=remat.policy("kernels"))
    _, vjp = jax.vjp(lambda x, w, gu, dn, f=f: f(x, idx, w, gu, dn), x, w, gu, dn)
    rows = [r for r in jax.tree.leaves(vjp) if getattr(r, "shape", None) == (A, D)]
    assert len(rows) == expected, (before, [r.shape for r in jax.tree.leaves(vjp)])


@pytest.mark.parametrize("dtype,rounding,bound", [("float32", 1e-6, 1e-6),
                                                  ("bfloat16", 2.0 ** -9, 4e-3)])
def test_weighted_gated_silu_vjp_is_autodiffs(dtype, rounding, bound):
  """experts.weighted_gated_silu: w · silu(gate) · up in fp32, rounded once (bf16: within
  one rounding, 2⁻⁹), and its gradients in h and w against autodiff's fp32 ones (bf16:
  within gated_silu's bound for its gradient)."""
  from moe_jax.model.experts import weighted_gated_silu
  h = (jax.random.normal(jax.random.key(0), (37, 2, 24)) * 3).astype(dtype)
  w = jax.random.uniform(jax.random.key(2), (37,))
  da = jax.random.normal(jax.random.key(1), (37, 24)).astype(dtype)
  plain = lambda h, w: jax.nn.silu(h[..., 0, :]) * h[..., 1, :] * w[:, None]
  h32 = h.astype(jnp.float32)
  assert rel_err(weighted_gated_silu(h, w).astype(jnp.float32), plain(h32, w)) < rounding
  dh, dw = jax.vjp(weighted_gated_silu, h, w)[1](da)
  dh_ref, dw_ref = jax.vjp(plain, h32, w)[1](da.astype(jnp.float32))
  assert dh.dtype == h.dtype and dh.shape == h.shape and dw.dtype == w.dtype
  assert rel_err(dh.astype(jnp.float32), dh_ref) < bound
  assert rel_err(dw, dw_ref) < bound


@pytest.mark.parametrize("dtype,bound", [("float32", 1e-6), ("bfloat16", 4e-3)])
def test_gated_silu_vjp_is_autodiffs_in_one_pass(dtype, bound):
  """experts.gated_silu: the forward is autodiff's expression bit for bit; the gradient is
  autodiff's (fp32: to 1e-6; bf16: 1.6e-3 from the fp32 gradient, where autodiff's in bf16
  is 4.3e-3: computed in fp32 before the cast), and the backward keeps only h: no zero-padded cotangents summed by an add, no
  [..., F] intermediates as residuals."""
  from moe_jax.model.experts import gated_silu
  h = (jax.random.normal(jax.random.key(0), (2, 37, 2, 24)) * 3).astype(dtype)
  da = jax.random.normal(jax.random.key(1), (2, 37, 24)).astype(dtype)
  plain = lambda h: jax.nn.silu(h[..., 0, :]) * h[..., 1, :]
  np.testing.assert_array_equal(np.asarray(gated_silu(h), np.float32),
                                np.asarray(plain(h), np.float32))
  (dh,) = jax.vjp(gated_silu, h)[1](da)
  with jax.default_matmul_precision("highest"):
    (dh_ref,) = jax.vjp(plain, h.astype(jnp.float32))[1](da.astype(jnp.float32))
  assert dh.dtype == h.dtype and dh.shape == h.shape
  assert rel_err(dh.astype(jnp.float32), dh_ref) < bound
  linearised = str(jax.make_jaxpr(lambda h, da: jax.vjp(gated_silu, h)[1](da))(h, da))
  assert "pad[" not in linearised and "add_any" not in linearised


def test_router_gets_gradient_bias_does_not():
  cfg = _moe_cfg()
  x = jax.random.normal(jax.random.key(3), (2, 16, 32))
  variables = _init(cfg, x)
  grads = jax.grad(lambda p: (MoE(cfg).apply({**variables, "params": p}, x)[0] ** 2).sum())(
      variables["params"])
  assert float(jnp.abs(grads["router_kernel"]).max()) > 0
  assert set(variables["router"]) == {"bias"} and "bias" not in variables["params"]


def test_bf16_router_product_matches_fp32_to_bf16_rounding():
  """router_dtype="bfloat16": bf16 operands, fp32 accumulation, and a hand-written backward
  of bf16 products. Against the fp32 product in float64: logits and both gradients within
  bf16 rounding, each gradient in its input's dtype, and the top-k choice unchanged for
  all but near-tied tokens."""
  kz, kw, kg = jax.random.split(jax.random.key(7), 3)
  z_NxW = jax.random.normal(kz, (512, 64), jnp.bfloat16)
  k_WxE = jax.random.normal(kw, (64, 16), jnp.float32) * 0.1
  g_NxE = jax.random.normal(kg, (512, 16), jnp.float32)
  z64, k64, g64 = (np.asarray(a, np.float64) for a in (z_NxW, k_WxE, g_NxE))
  for dtype in ("float32", "bfloat16"):
    out = router.logits(z_NxW, k_WxE, dtype)
    assert out.dtype == jnp.float32 and out.shape == (512, 16)
    assert rel_err(out, z64 @ k64) < (5e-3 if dtype == "bfloat16" else 1e-6)
    dz, dk = jax.grad(lambda z, k: (router.logits(z, k, dtype) * g_NxE).sum(), (0, 1))(
        z_NxW, k_WxE)
    assert dz.dtype == jnp.bfloat16 and dk.dtype == jnp.float32
    assert rel_err(dz, g64 @ k64.T) < 1e-2
    assert rel_err(dk, z64.T @ g64) < (1e-2 if dtype == "bfloat16" else 1e-6)
  pick = lambda d: jax.lax.top_k(router.logits(z_NxW, k_WxE, d), 4)[1]
  same = np.all(np.sort(pick("bfloat16"), -1) == np.sort(pick("float32"), -1), -1)
  assert same.mean() > 0.97


def test_bf16_router_layer_matches_fp32_layer():
  """The whole layer in a bf16 model with the default router_dtype ("": the model's, so a bf16
  product) against router_dtype="float32": the same top-k for almost every token, and
  outputs and router gradients within bf16 error."""
  x = jax.random.normal(jax.random.key(5), (2, 64, 32), jnp.float32)
  outs = {}
  for dtype in ("float32", ""):
    c = make_small_config()
    c.model.d_model = 32   # bf16 activations (the default dtype); as _moe_cfg otherwise
    c.model.moe.update({"num_experts": 8, "top_k": 3, "num_shared": 1, "expert_hidden": 24,
                        "route_scale": 2.5, "router_init_scale": 0.5, "router_dtype": dtype})
    cfg = frozen_model_config(c)
    variables = _init(cfg, x)
    loss = lambda p: (MoE(cfg).apply({**variables, "params": p}, x)[0].astype(jnp.float32)
                      ** 2).sum()
    (y, _), state = MoE(cfg).apply(variables, x, mutable=["intermediates"])
    topk = jax.tree.leaves(state["intermediates"])[0]
    outs[dtype] = (y, np.sort(np.asarray(topk), -1), jax.grad(loss)(variables["params"]))
  (y32, top32, g32), (y16, top16, g16) = outs["float32"], outs[""]
  assert np.isfinite(np.asarray(y16, np.float32)).all()
  assert np.all(top16 == top32, -1).mean() > 0.95
  assert rel_err(y16, y32) < 2e-2
  assert rel_err(g16["router_kernel"], g32["router_kernel"]) < 5e-2
  assert g16["router_kernel"].dtype == jnp.float32


@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_combine_weights_are_renormalised_scores_with_finite_gradients(score):
  """s_k / Σ_k s_j of the chosen experts, and finite in value and gradient at logits where
  the plain quotient's gradient was NaN (every chosen sigmoid score ~1e-24) or saturated."""
  logits = jax.random.normal(jax.random.key(0), (64, 8))
  idx = jax.lax.top_k(logits, 2)[1]
  s = router.scores_from_logits(logits, score)
  chosen = jnp.take_along_axis(s, idx, -1)
  want = chosen / chosen.sum(-1, keepdims=True) * 2.5
  assert rel_err(router.combine_weights(logits, idx, score, 2.5), want) < 1e-6
  for shift in (-55.0, -200.0, 60.0):
    g = jax.grad(lambda l: (router.combine_weights(l, idx, score, 1.0)
                            * jnp.arange(2.0)).sum())(logits + shift)
    assert np.isfinite(np.asarray(g)).all()
  # At ≈ −55 the chosen scores are ~1e-24 and still right: against the quotient in float64.
  low = np.asarray(jnp.take_along_axis(logits, idx, -1), np.float64) - 55.0
  s64 = 1.0 / (1.0 + np.exp(-low)) if score == "sigmoid" else np.exp(low)
  assert rel_err(router.combine_weights(logits - 55.0, idx, score, 1.0),
                 s64 / s64.sum(-1, keepdims=True)) < 1e-5


def test_fused_decode_has_the_gathered_gradient(monkeypatch):
  """The fused kernels are forward only; their custom VJP must give gather's gradients (a
  gradient through a decode-sized batch on GPU under "auto")."""
  monkeypatch.setattr(decode_experts, "BLOCK_D", 16)
  monkeypatch.setattr(decode_experts, "BLOCK_F", 8)
  x = jax.random.normal(jax.random.key(4), (2, 1, 32))
  grads = {}
  for decode in ("gather", "fused"):
    cfg = _moe_cfg(decode_dispatch=decode)
    variables = _init(cfg, x)
    loss = lambda p, x: (MoE(cfg).apply({**variables, "params": p}, x)[0] ** 2).sum()
    grads[decode] = jax.grad(loss, argnums=(0, 1))(variables["params"], x)
  flat_g, flat_f = jax.tree.leaves(grads["gather"]), jax.tree.leaves(grads["fused"])
  assert len(flat_g) == len(flat_f) and float(jnp.abs(grads["fused"][0]["gate_up"]).max()) > 0
  for g, f in zip(flat_g, flat_f):
    assert rel_err(f, g) < 1e-5


@pytest.mark.parametrize("setting,assignments,backend,path", [
    ("auto", 32, "gpu", "fused"), ("auto", 8, "gpu", "fused"), ("auto", 4, "gpu", "gather"),
    ("auto", 32, "cpu", "gather"), ("gather", 32, "gpu", "gather"),
    ("grouped", 4, "gpu", "grouped"), ("fused", 4, "cpu", "fused")])
def test_decode_path_resolves_auto(setting, assignments, backend, path):
  assert moe_lib.decode_path(setting, assignments, backend) == path


@pytest.mark.parametrize("backend,dtype,dims,triton,impl", [
    ("gpu", jnp.bfloat16, (1024, 1408), True, "triton"),
    ("gpu", jnp.bfloat16, (1024, 1408), False, "mosaic"),
    ("gpu", jnp.bfloat16, (1024, 1000), True, "tokamax"),
    ("gpu", jnp.float32, (1024, 1408), True, "xla"),
    ("tpu", jnp.float32, (1024, 1408), True, "tokamax"),
    ("cpu", jnp.bfloat16, (1024, 1408), True, "xla")])
def test_grouped_matmul_default_follows_backend_dtype_and_dims(monkeypatch, backend, dtype,
                                                               dims, triton, impl):
  """The GPU kernels take no float32 (fp32 models on GPU take XLA's ragged_dot); `triton`
  and `mosaic` (whose dw `triton` takes) need both dims in multiples of 64, tokamax's takes
  the rest; without jax_triton, mosaic."""
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  monkeypatch.setattr(platform, "triton_available", lambda: triton)
  assert moe_ops.default_grouped_matmul(dtype, *dims) == impl


def test_tokamax_on_gpu_rejects_float32(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  x, w = jnp.ones((4, 8)), jnp.ones((2, 8, 16))
  with pytest.raises(ValueError, match="grouped_matmul='tokamax' on GPU takes bfloat16/float16 "
                                       "inputs, got float32"):
    moe_ops.grouped_matmul(x, w, jnp.array([2, 2]), "tokamax")


@pytest.mark.parametrize("dtype,dims", [(jnp.float32, (64, 64)), (jnp.bfloat16, (64, 96))])
def test_mosaic_rejects_float32_and_dims_off_64(dtype, dims):
  x, w = jnp.ones((4, dims[0]), dtype), jnp.ones((2, *dims), dtype)
  with pytest.raises(ValueError, match="grouped_matmul='mosaic' takes bfloat16/float16 experts "
                                       "with both dims multiples of 64"):
    moe_ops.grouped_matmul(x, w, jnp.array([2, 2]), "mosaic")


# ---- balancers -----------------------------------------------------------------------------

_E, _K, _N = 16, 2, 4096
_PREF = jnp.zeros(_E).at[:3].set(2.5)  # three experts strongly preferred by every token


def _skewed_stats(mc, bias, key, n=_N):
  logits = _PREF + jax.random.normal(key, (n, _E))
  scores = router.scores_from_logits(logits, "sigmoid")
  idx, _ = router.select(logits, bias, _K, "sigmoid", 1.0)
  return router.routing_stats(mc, logits, scores, idx, bias, 0.0)


def _balancer_cfg(kind, **kw):
  mc = base.get_config().model.moe
  mc.update({"num_experts": _E, "top_k": _K, "balancer": kind, "bias_rate": 5e-3, **kw})
  return ml_collections.FrozenConfigDict(mc)


def _run_balancer(mc, steps, state=None, start=0):
  state = router.init_state(mc, _E) if state is None else state

  def body(state, i):
    stats = _skewed_stats(mc, state["bias"], jax.random.fold_in(jax.random.key(0), i))
    return router.update(mc, state, stats, i), stats["max_vio"]

  return jax.jit(lambda s: jax.lax.scan(body, s, jnp.arange(start, start + steps)))(state)


# make test keeps the default balancer (loss_free); the quantile ones in the second tier.
@pytest.mark.parametrize("kind,kw", [
    ("loss_free", {}),
    pytest.param("quantile_ema", {"ema_window": 20, "quantile_step": 0.05}, marks=pytest.mark.slow),
    pytest.param("quantile_exact", {}, marks=pytest.mark.slow)])
def test_balancer_removes_a_strong_skew(kind, kw, tmp_path):
  mc = _balancer_cfg(kind, **kw)
  state, vios = _run_balancer(mc, 300)
  final = _skewed_stats(mc, state["bias"], jax.random.key(99), n=32768)  # fresh, large batch
  assert float(vios[0]) > 2.0 and float(final["max_vio"]) < 0.15
  assert float(jnp.abs(state["bias"]).max()) <= mc.bias_clamp
  # The state round-trips through an orbax checkpoint and the run continues identically.
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "router", state)
  ckpt.wait_until_finished()
  restored = ckpt.restore(tmp_path / "router", jax.tree.map(ocp.utils.to_shape_dtype_struct,
                                                            state))
  a, _ = _run_balancer(mc, 5, state, start=300)
  b, _ = _run_balancer(mc, 5, restored, start=300)
  for k in state:
    np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))


@pytest.mark.parametrize("kind", ["loss_free", "quantile_ema", "quantile_exact"])
def test_balancer_bias_is_clamped(kind):
  mc = _balancer_cfg(kind, bias_clamp=0.05, bias_rate=0.05, quantile_step=0.05)
  state, _ = _run_balancer(mc, 40)
  bias = np.asarray(state["bias"])
  assert np.abs(bias).max() <= 0.05 + 1e-7 and np.isclose(np.abs(bias).max(), 0.05)


def test_aux_loss_balancer_adds_the_switch_loss():
  cfg = _moe_cfg(balancer="aux_loss", aux_loss_coef=0.1, z_loss=0.01)
  x = jax.random.normal(jax.random.key(4), (2, 16, 32))
  _, stats = MoE(cfg).apply(_init(cfg, x), x)
  # E·Σ f_i·P_i ≥ 1 with equality only when balanced; penalty = coefficients × losses.
  assert float(stats["aux_loss"]) > 1.0
  expected = 0.1 * stats["aux_loss"] + 0.01 * stats["z_loss"]
  assert abs(float(stats["penalty"]) - float(expected)) < 1e-6


def test_router_gradient_clipped_on_its_own():
  c = make_small_config()
  c.optim.router_grad_clip_norm, c.optim.grad_clip_norm = 1.0, 100.0
  grads = {"layer_1": {"ffn": {"router_kernel": jnp.full((4, 8), 3.0),
                               "gate_up": jnp.full((8, 4, 2, 2), 2.0)}},
           "embed": jnp.full((5, 4), 1.0)}
  tx = optim.make_clipping(c)
  out, _ = tx.update(grads, tx.init(grads))
  assert abs(float(optax.tree.norm(out["layer_1"]["ffn"]["router_kernel"])) - 1.0) < 1e-5
  np.testing.assert_array_equal(out["layer_1"]["ffn"]["gate_up"], grads["layer_1"]["ffn"]["gate_up"])
  # With a tight global clip the router is clipped first, then everything is scaled together.
  c.optim.grad_clip_norm = 2.0
  tx = optim.make_clipping(c)
  out, _ = tx.update(grads, tx.init(grads))
  rest = float(optax.tree.norm({"g": grads["layer_1"]["ffn"]["gate_up"], "e": grads["embed"]}))
  scale = 2.0 / np.sqrt(1.0 + rest ** 2)
  assert abs(float(optax.tree.norm(out)) - 2.0) < 1e-4
  assert abs(float(optax.tree.norm(out["layer_1"]["ffn"]["router_kernel"])) - scale) < 1e-5


# ---- latent MoE and the routing-stability kit -----------------------------------------------

@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_latent_moe_with_identity_projections_equals_the_standard_layer(dispatch):
  """R = d_model, latent_down = latent_up = I, and inputs of unit RMS (so latent_norm is the
  identity): the latent layer computes exactly what the standard one does."""
  std_cfg = _moe_cfg(dispatch=dispatch, capacity_factor=1.0)
  lat_cfg = _moe_cfg(dispatch=dispatch, capacity_factor=1.0, latent_dim=32)
  x = jax.random.normal(jax.random.key(7), (2, 16, 32))
  x = x / jnp.sqrt(jnp.mean(x ** 2, -1, keepdims=True))
  std = _init(std_cfg, x)
  lat = nn.meta.unbox(jax.jit(MoE(lat_cfg).init)(jax.random.key(1), x))
  p = dict(lat["params"])
  p.update({k: std["params"][k] for k in ("router_kernel", "gate_up", "down", "shared")})
  p["latent_down"] = {"kernel": jnp.eye(32)}
  p["latent_up"] = {"kernel": jnp.eye(32)}
  y_std, s_std = MoE(std_cfg).apply(std, x)
  y_lat, s_lat = MoE(lat_cfg).apply({"params": p, "router": std["router"]}, x)
  assert rel_err(y_lat, y_std) < 1e-5
  np.testing.assert_array_equal(s_lat["load"], s_std["load"])
  assert float(s_lat["dropped_fraction"]) == float(s_std["dropped_fraction"])


def test_routing_clip_acts_only_on_the_params_it_names():
  c = make_small_config()
  c.model.moe.latent_dim = 16
  c.optim.router_grad_clip_norm, c.optim.grad_clip_norm = 1.0, 1e6
  c.optim.router_clip_params = "router_kernel,latent_down"
  ffn = {"router_kernel": jnp.full((4, 8), 3.0), "latent_down": {"kernel": jnp.full((8, 4), 3.0)},
         "latent_up": {"kernel": jnp.full((4, 8), 3.0)}, "gate_up": jnp.full((8, 4, 2, 2), 2.0)}
  grads = {"layer_1": {"ffn": ffn}, "embed": jnp.full((5, 4), 1.0)}
  tx = optim.make_clipping(c)
  out, _ = tx.update(grads, tx.init(grads))
  o = out["layer_1"]["ffn"]
  named = {"r": o["router_kernel"], "d": o["latent_down"]}
  assert abs(float(optax.tree.norm(named)) - 1.0) < 1e-5   # clipped together to norm 1
  for k in ("latent_up", "gate_up"):
    np.testing.assert_array_equal(jax.tree.leaves(o[k])[0], jax.tree.leaves(ffn[k])[0])
  np.testing.assert_array_equal(out["embed"], grads["embed"])


@pytest.mark.parametrize("names", ["router_kernel", "router_kernel,latent_down"])
def test_init_regulariser_acts_only_on_the_params_it_names(names):
  cfg = _moe_cfg(latent_dim=8, router_init_reg=1.0, init_reg_params=names)
  x = jax.random.normal(jax.random.key(8), (2, 8, 32))
  variables = _init(cfg, x)
  moved = jax.tree.map(lambda a: a + 0.1, variables["params"])   # every param off its init
  penalty = lambda p: MoE(cfg).apply({**variables, "params": p}, x)[1]["penalty"]
  g = jax.grad(penalty)(moved)
  named = set(names.split(","))
  expect = sum(jax.tree.leaves(variables["params"][n])[0].size * 0.01 for n in named)
  assert abs(float(penalty(moved)) - expect) < 1e-3 * expect
  for name, sub in g.items():
    norm = float(optax.tree.norm(sub))
    assert (norm > 0) == (name in named), (name, norm)


def test_latent_params_are_counted_as_always_active():
  from moe_jax import params
  c = make_small_config()
  c.model.moe.latent_dim = 16
  m = c.model
  counts = params.count(c)
  moe_layers = m.n_layers - m.moe.first_dense
  D, R, E, F = m.d_model, 16, m.moe.num_experts, m.moe.expert_hidden
  assert counts["total"]["moe_latent"] == moe_layers * (2 * D * R + R)
  assert counts["active"]["moe_latent"] == counts["total"]["moe_latent"]
  assert counts["total"]["router"] == moe_layers * R * E
  assert counts["total"]["routed_experts"] == moe_layers * E * 3 * R * F


# ---- expert parallelism (8 fake CPU devices, in a subprocess) ------------------------------

# Router biases that set the routing (8 experts, top 3): uniform (none: the random router
# spreads tokens), random, and adversarial: every token to experts 0, 1, 2 (one expert's
# worth of every token lands on one shard at expert 8; all of them on shard 0 at expert 2).
ROUTINGS = {"uniform": [0.0] * 8, "random": [0.3, -0.2, 0.1, 0.4, -0.4, 0.0, 0.2, -0.1],
            "adversarial": [9.0, 8.0, 7.0, 0.0, 0.0, 0.0, 0.0, 0.0]}

_EP = """
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh
from tests.test_moe import _moe_cfg, _init, ROUTINGS
from moe_jax.model.moe import MoE
from moe_jax.fields import MESH_AXES
rel = lambda a, b: float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))
results = {}
def a2a_widths(jaxpr):  # last dims of every all_to_all's float operands, sub-jaxprs included
  out = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "all_to_all":
      out |= {v.aval.shape[-1] for v in eqn.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)}
    for p in eqn.params.values():
      for sub in p if isinstance(p, (tuple, list)) else [p]:
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          out |= a2a_widths(sub)
  return out
x = jax.random.normal(jax.random.key(5), (8, 16, 32))
for data, expert, dispatch, factor, latent in (
    (1, 8, "dropless", 1.25, 0), (2, 4, "dropless", 1.25, 0), (4, 2, "dropless", 1.25, 0),
    (1, 8, "capacity", 8.0, 0), (1, 8, "capacity", 0.5, 0), (2, 4, "dropless", 1.25, 8)):
  cfg = _moe_cfg(dispatch=dispatch, capacity_factor=factor, latent_dim=latent,
                 ep_buffer_factor=factor)
  variables = _init(cfg, x)
  def loss(p, router, x):
    y, stats = MoE(cfg).apply({**variables, "params": p, "router": router}, x)
    return (y ** 2).sum() + (y * x).sum(), (y, stats)
  grad1 = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))   # under the mesh
  mesh = Mesh(np.array(jax.devices()).reshape(data, 1, expert, 1, 1), MESH_AXES)
  key = f"{data}x{expert} {dispatch} {factor}" + (f" latent {latent}" if latent else "")
  for routing, bias in ROUTINGS.items():
    if (dispatch == "capacity" or latent) and routing != "random":
      continue
    router = {**variables["router"], "bias": jnp.asarray(bias, jnp.float32)}
    (_, (y1, s1)), g1 = grad1(variables["params"], router, x)
    with jax.set_mesh(mesh):
      (_, (y8, s8)), g8 = grad(variables["params"], router, x)
      text = grad.lower(variables["params"], router, x).as_text()
      widths = sorted(a2a_widths(jax.make_jaxpr(grad)(variables["params"], router, x).jaxpr))
    g1, g8 = (g1[0], g1[2]), (g8[0], g8[2])   # params and x (the router bias gets none)
    results[f"{key} {routing}"] = {
        "y": rel(y8, y1), "dropped_ep": float(s8["dropped_fraction"]),
        "stats": max(rel(s8[k], s1[k]) for k in ("load", "max_vio", "entropy", "aux_loss")),
        "rounds": float(s8["ep_rounds"]), "fill": float(s8["ep_buffer_fill"]),
        "all_to_all": text.count("all_to_all"), "a2a_widths": widths,
        "grads": max(rel(a, b) for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(g1)))}
  if dispatch == "dropless" and not latent:   # the three routings ran through one executable
    with jax.set_mesh(mesh):
      results[f"{key} compiles"] = grad._cache_size()
print("RESULT", json.dumps(results))
"""


@pytest.fixture(scope="module")
def expert_parallel_runs():
  """One subprocess with 8 fake CPU devices runs every EP variant against one device."""
  env = cpu_devices_env(8)
  proc = subprocess.run([sys.executable, "-c", _EP], env=env, capture_output=True, text=True,
                        cwd=ROOT, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")][0]
  return json.loads(line.split(" ", 1)[1])


@pytest.mark.parametrize("routing", ["uniform", "random"])
@pytest.mark.parametrize("mesh", ["1x8", "2x4", "4x2"])
def test_expert_parallel_equals_single_device(expert_parallel_runs, mesh, routing):
  """Dropless over expert axes 8, 4, 2: outputs, every gradient (params and input) and the
  router statistics equal one device's; nothing dropped."""
  r = expert_parallel_runs[f"{mesh} dropless 1.25 {routing}"]
  assert r["all_to_all"] > 0  # really exchanged tokens
  assert r["y"] <= 1e-5 and r["grads"] <= 1e-5 and r["stats"] <= 1e-6
  assert r["dropped_ep"] == 0.0 and r["rounds"] >= 1


@pytest.mark.parametrize("mesh", ["1x8", "2x4", "4x2"])
def test_expert_parallel_adversarial_routing_takes_more_rounds_and_drops_nothing(
    expert_parallel_runs, mesh):
  """Every token to experts 0-2 (on one shard at expert 2): buffers of 1.25× the balanced
  load overflow, the rest goes in further rounds, and the result is still one device's; the
  three routings ran through one compiled step."""
  r = expert_parallel_runs[f"{mesh} dropless 1.25 adversarial"]
  assert r["y"] <= 1e-5 and r["grads"] <= 1e-5 and r["stats"] <= 1e-6
  assert r["dropped_ep"] == 0.0
  assert r["fill"] > 1.25 and r["rounds"] == np.ceil(r["fill"]) > 1
  assert expert_parallel_runs[f"{mesh} dropless 1.25 compiles"] == 1


def test_latent_expert_parallel_equals_single_device_and_moves_latent_rows(
    expert_parallel_runs):
  """Latent MoE (R = 8 of d_model 32) under data 2 × expert 4: equal to one device, and every
  all-to-all (forward and backward) carries R-wide rows, 4× smaller than d_model rows."""
  r = expert_parallel_runs["2x4 dropless 1.25 latent 8 random"]
  assert r["y"] <= 1e-5 and r["grads"] <= 1e-5 and r["dropped_ep"] == 0.0
  assert r["a2a_widths"] == [8]
  assert expert_parallel_runs["2x4 dropless 1.25 random"]["a2a_widths"] == [32]


def test_expert_parallel_capacity(expert_parallel_runs):
  """Per-destination buffers: roomy ones change nothing, tight ones drop and count."""
  roomy = expert_parallel_runs["1x8 capacity 8.0 random"]
  assert roomy["y"] <= 1e-5 and roomy["grads"] <= 1e-5 and roomy["dropped_ep"] == 0.0
  tight = expert_parallel_runs["1x8 capacity 0.5 random"]
  assert tight["dropped_ep"] > 0.0 and tight["y"] > 1e-3


def test_bad_buffer_factor_and_mesh_are_clear_errors():
  c = make_small_config()
  c.model.moe.ep_buffer_factor = 0.0
  with pytest.raises(ValueError, match="model.moe.ep_buffer_factor"):
    config_lib.validate(c)
  c = make_small_config()
  c.mesh.expert = 3
  with pytest.raises(ValueError, match="mesh.expert"):
    config_lib.validate(c)