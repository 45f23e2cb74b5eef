"""HybridMoE: shapes, logical axes on every param, and no leakage across packed documents."""

import collections
import json
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.data import tokenizer
from moe_jax.model import kda
from moe_jax.model.transformer import HybridMoE, mixer_kind
from moe_jax.train.state import frozen_model_config
from tests.conftest import ROOT, cpu_devices_env, rel_err


def _batch(tokens_BxT, segment_ids_BxT):
  return {"tokens": jnp.asarray(tokens_BxT, jnp.int32),
          "segment_ids": jnp.asarray(segment_ids_BxT, jnp.int32)}


def _model(c, **overrides):
  for k, v in overrides.items():
    c.model[k] = v
  return HybridMoE(frozen_model_config(c))


# tie=True (not the default): 15 s on 2 cores, in make test-all.
@pytest.mark.parametrize("tie", [pytest.param(True, marks=pytest.mark.slow), False])
def test_shapes_and_logical_axes(small_config, tie):
  model = _model(small_config, tie_embeddings=tie, n_layers=4, layer_pattern="KKKA")
  batch = _batch(np.ones((2, 32)), np.ones((2, 32)))
  variables = jax.jit(model.init)(jax.random.key(0), batch)
  boxed = jax.tree.leaves(variables["params"], is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
  assert boxed and all(isinstance(b, nn.LogicallyPartitioned) for b in boxed)
  assert all(len(b.names) == b.value.ndim for b in boxed)
  params, router = nn.meta.unbox(variables["params"]), variables["router"]
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
  assert [mixer_kind(model.cfg, i) for i in range(4)] == list("KKKA")
  assert "lm_head" in params if not tie else "lm_head" not in params
  logits, aux = jax.jit(model.apply)({"params": params, "router": router}, batch)
  assert logits.shape == (2, 32, small_config.model.vocab_size) and logits.dtype == jnp.float32
  assert np.isfinite(np.asarray(logits)).all()
  assert sorted(aux["routing"]) == ["layer_1", "layer_2", "layer_3"]  # layer 0 is dense
  assert sorted(router) == sorted(aux["routing"])
  for stats in aux["routing"].values():
    assert stats["load"].shape == (small_config.model.moe.num_experts,)
    assert abs(float(stats["load"].sum()) - 1.0) < 1e-6


# An opt-in layout (model.fused_projections = False by default): second tier, 16 s a case on
# 2 cores. make test checks the fused layout's forward where inference uses it
# (test_infer, test_kimi_hf's export of a fused model).
@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True])
def test_fused_projections_equal_the_six_and_train_the_same(small_config, scan):
  """model.fused_projections: one matmul for a KDA layer's six input projections, over the
  same kernels side by side, gives the six's logits and gradients (a packed row, scanned
  layers or not)."""
  seg = np.concatenate([np.ones(40), np.full(24, 2)])[None]
  tokens = np.random.default_rng(0).integers(0, 256, (1, 64))
  batch = _batch(tokens, seg)
  plain = _model(small_config, layer_pattern="KKA", dtype="float32", scan_layers=scan)
  fused = _model(small_config, layer_pattern="KKA", dtype="float32", scan_layers=scan,
                 fused_projections=True)
  variables = nn.meta.unbox(jax.jit(plain.init)(jax.random.key(1), batch))
  fused_variables = {**variables, "params": kda.fuse_projections(variables["params"])}
  want = jax.tree.map(jnp.shape, nn.meta.unbox(jax.eval_shape(fused.init, jax.random.key(1),
                                                              batch)))
  assert jax.tree.map(jnp.shape, fused_variables) == want

  def loss(model, params, v):
    logits, _ = model.apply({**v, "params": params}, batch)
    return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0]), logits

  (l_plain, logits_plain), g_plain = jax.jit(jax.value_and_grad(
      lambda p: loss(plain, p, variables), has_aux=True))(variables["params"])
  (l_fused, logits_fused), g_fused = jax.jit(jax.value_and_grad(
      lambda p: loss(fused, p, fused_variables), has_aux=True))(fused_variables["params"])
  assert rel_err(logits_fused, logits_plain) < 1e-6 and abs(float(l_fused - l_plain)) < 1e-6
  g_want = kda.fuse_projections(g_plain)   # the fused kernel's gradient is the six's side by side
  for a, b in zip(jax.tree.leaves(g_fused), jax.tree.leaves(g_want)):
    assert rel_err(a, b) < 1e-4   # 1.2e-5 measured: dx sums the fused width in one product


# make test keeps the MLA layer after the KDA one; the other order in the second tier.
@pytest.mark.parametrize("pattern", [pytest.param("KA", marks=pytest.mark.slow), "AK"])
def test_second_packed_document_matches_it_alone(small_config, pattern):
  """State (KDA, conv) and attention (MLA) reset at the document boundary; padding is inert."""
  model = _model(small_config, layer_pattern=pattern, dtype="float32")
  rng = np.random.default_rng(0)
  doc_a, doc_b = rng.integers(0, 256, 21), rng.integers(0, 256, 30)
  packed = np.concatenate([doc_a, doc_b, np.full(13, tokenizer.PAD)])
  seg = np.concatenate([np.ones(21), np.full(30, 2), np.zeros(13)])
  variables = nn.meta.unbox(jax.jit(model.init)(jax.random.key(1), _batch(packed[None], seg[None])))
  logits_packed, _ = jax.jit(model.apply)(variables, _batch(packed[None], seg[None]))
  logits_alone, _ = jax.jit(model.apply)(variables, _batch(doc_b[None], np.ones((1, 30))))
  logits_a, _ = jax.jit(model.apply)(variables, _batch(doc_a[None], np.ones((1, 21))))
  assert rel_err(logits_packed[0, 21:51], logits_alone[0]) < 1e-5
  assert rel_err(logits_packed[0, :21], logits_a[0]) < 1e-5
  # Without segment ids the second document does see the first: the check above can fail.
  logits_joined, _ = jax.jit(model.apply)(variables, _batch(packed[None], np.ones((1, 64))))
  assert rel_err(logits_joined[0, 21:51], logits_alone[0]) > 1e-3


def test_bf16_compute_fp32_params(small_config):
  model = _model(small_config, dtype="bfloat16")
  batch = _batch(np.arange(64).reshape(2, 32), np.ones((2, 32)))
  variables = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), batch))
  params = variables["params"]
  logits, _ = jax.jit(model.apply)(variables, batch)
  ref_model = _model(small_config, dtype="float32")
  ref, _ = jax.jit(ref_model.apply)(variables, batch)
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
  assert 1e-4 < rel_err(logits, ref) < 5e-2  # really computed in bf16, and still close


def test_remat_gives_identical_logits_and_gradients(small_config):
  batch = _batch(np.arange(64).reshape(2, 32) % 259, np.ones((2, 32)))
  plain = _model(small_config, dtype="float32", remat=False)
  variables = nn.meta.unbox(jax.jit(plain.init)(jax.random.key(0), batch))
  params = variables["params"]
  remat = _model(small_config, dtype="float32", remat=True)

  def loss(model):
    return lambda p: (model.apply({**variables, "params": p}, batch)[0] ** 2).mean()

  (l0, g0), (l1, g1) = (jax.jit(jax.value_and_grad(loss(m)))(params) for m in (plain, remat))
  assert abs(float(l0) - float(l1)) <= 1e-6 * abs(float(l0))
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    assert rel_err(a, b) < 1e-5


def _kernel_launches(fn, *args) -> collections.Counter:
  """Pallas calls by name in fn's jaxpr after dead-code elimination, each call site once (a
  scan body once, a jitted function at every call). jax's jaxpr DCE keeps every pallas_call;
  XLA drops a kernel whose outputs nobody reads (no side effect), so here, as there, an
  unread kernel goes."""
  from jax._src.interpreters import partial_eval as pe
  from jax._src.pallas.pallas_call import pallas_call_p
  counts = collections.Counter()

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive is pallas_call_p:
        counts[eqn.params["name"]] += 1
      for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
          if isinstance(sub, jax.extend.core.ClosedJaxpr):
            visit(sub.jaxpr)
          elif isinstance(sub, jax.extend.core.Jaxpr):
            visit(sub)

  closed = jax.make_jaxpr(fn)(*args)
  keep_all = pe.dce_rules[pallas_call_p]
  pe.dce_rules[pallas_call_p] = pe._default_dce_rule
  jax.clear_caches()   # DCE results are cached per jaxpr
  try:
    visit(pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))[0])
  finally:
    pe.dce_rules[pallas_call_p] = keep_all
    jax.clear_caches()
  return counts


@pytest.mark.slow
def test_remat_residuals_policies_run_each_kernel_forward_once(small_config):
  """remat_policy "residuals" saves the kernels' custom-VJP residuals (pallas_kernels/
  residuals.py): the same loss and gradients as "kernels", and the backward pass no longer
  runs the KDA stage-1 and flash-attention forward kernels a second time.
  "residuals_recompute_prologue" keeps all but KDA stage 1's q̂, k̂ and G, which the
  backward rebuilds with a second prologue launch: the same loss and gradients again, twice
  the prologue launches, no other forward kernel again. Pallas kernels in interpret mode,
  gate and L2 norm in the prologue, packed documents, a KDA and an MLA layer (on the H200
  the scanned 1B step launches each forward once too: benchmarks/train.md)."""
  seg = np.concatenate([np.ones((2, 40)), np.full((2, 24), 2)], axis=1)
  batch = _batch(np.arange(128).reshape(2, 64) % 259, seg)
  kw = dict(dtype="float32", layer_pattern="KA", n_layers=2, kda_implementation="pallas_gpu",
            mla_implementation="gpu", remat=True, kda_gate_in_kernel=True)
  kernels, saved = (_model(small_config.copy_and_resolve_references(), remat_policy=p, **kw)
                    for p in ("kernels", "residuals"))
  lean = _model(small_config, remat_policy="residuals_recompute_prologue", **kw)
  variables = nn.meta.unbox(jax.jit(saved.init)(jax.random.key(0), batch))

  def loss(model):
    return lambda p: (model.apply({**variables, "params": p}, batch)[0] ** 2).mean()

  grad = lambda m: jax.value_and_grad(loss(m))
  (l0, g0), (l1, g1), (l2, g2) = (jax.jit(grad(m))(variables["params"])
                                  for m in (kernels, saved, lean))
  for l, g in ((l1, g1), (l2, g2)):
    assert np.isfinite(float(l)) and abs(float(l0) - float(l)) <= 1e-6 * abs(float(l0))
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0)):
      assert rel_err(a, b) < 1e-5
  before, after, lean_n = (_kernel_launches(grad(m), variables["params"])
                           for m in (kernels, saved, lean))
  assert before["ring_step_fwd"] == 2 * after["ring_step_fwd"] > 0, (before, after)
  for name in ("kda_prologue", "kda_intra_tiles", "kda_intra_solve", "kda_intra_wu"):
    assert before[name] == 2 * after[name] > 0, (name, before, after)
  assert before["ring_step_dq"] == after["ring_step_dq"] > 0
  assert before["kda_intra_wu_bwd"] == after["kda_intra_wu_bwd"] > 0
  assert lean_n["kda_prologue"] == 2 * after["kda_prologue"], (after, lean_n)
  assert all(lean_n[n] == after[n] for n in after if n != "kda_prologue"), (after, lean_n)


@pytest.mark.slow   # an opt-in, off by default (train.md: 6 ms slower): 22 s on 2 cores
def test_remat_expert_rows_saves_the_dispatch_gathers_and_swiglu(small_config):
  """model.remat_expert_rows: the same loss and gradients, and the compiled backward no
  longer runs the dispatch's row gathers or the experts' SwiGLU a second time (their ops
  gone from the rematerialised computation), under the 1B's remat policy."""
  batch = _batch(np.arange(128).reshape(2, 64) % 259, np.ones((2, 64)))
  results = {}
  for save in (False, True):
    model = _model(small_config.copy_and_resolve_references(), dtype="float32",
                   layer_pattern="KA", n_layers=2, remat=True,
                   remat_policy="residuals_recompute_prologue", remat_expert_rows=save)
    variables = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), batch))
    step = jax.jit(jax.value_and_grad(
        lambda p, m=model, v=variables: (m.apply({**v, "params": p}, batch)[0] ** 2).mean()))
    hlo = step.lower(variables["params"]).compile().as_text()
    rerun = [n for n in re.findall(r'op_name="([^"]*)"', hlo)
             if "rematted_computation" in n and ("moe_dispatch/gather" in n
                                                 or "moe_experts/mul" in n)]
    results[save] = step(variables["params"]), rerun
  ((l0, g0), rerun0), ((l1, g1), rerun1) = results[False], results[True]
  assert any("gather" in n for n in rerun0) and any("mul" in n for n in rerun0), rerun0
  assert rerun1 == [], rerun1
  assert np.isfinite(float(l1)) and float(l0) == float(l1)
  # 1e-5, as for the remat policies above: the saved rows change which fusions XLA forms,
  # and so the order of fp32 sums (3.2e-6 on an H100; < 1e-6 on CPU).
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    assert rel_err(a, b) < 1e-5


# pallas_gpu is the slower in interpret mode (18 s on 2 cores): make test keeps triton.
@pytest.mark.parametrize("impl", [pytest.param("pallas_gpu", marks=pytest.mark.slow), "triton"])
def test_kda_gate_in_kernel_gives_the_same_loss_and_gradients(small_config, impl):
  """model.kda_gate_in_kernel (q/k L2 norm and gate inside the KDA op: pallas_gpu's
  prologue kernel, interpret mode on CPU) against the same model with that glue in XLA,
  packed documents; also with stage 2 in native Triton (its interpreter on CPU). (The
  op's other implementations: test_kda.py.)"""
  seg = np.concatenate([np.ones((2, 20)), np.full((2, 30), 2), np.zeros((2, 14))], axis=1)
  batch = _batch(np.arange(128).reshape(2, 64) % 259, seg)
  kw = dict(dtype="float32", layer_pattern="KA", n_layers=2, kda_implementation=impl)
  outside = _model(small_config.copy_and_resolve_references(), kda_gate_in_kernel=False, **kw)
  inside = _model(small_config, kda_gate_in_kernel=True, **kw)
  variables = nn.meta.unbox(jax.jit(inside.init)(jax.random.key(0), batch))

  def loss(model):
    return lambda p: (model.apply({**variables, "params": p}, batch)[0] ** 2).mean()

  (l0, g0), (l1, g1) = (jax.jit(jax.value_and_grad(loss(m)))(variables["params"])
                        for m in (outside, inside))
  assert np.isfinite(float(l1)) and abs(float(l0) - float(l1)) <= 1e-5 * abs(float(l0))
  kda_grads = jax.tree_util.tree_flatten_with_path(g1)[0]
  assert any("A_log" in jax.tree_util.keystr(p) for p, _ in kda_grads)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    assert rel_err(a, b) < 1e-4


_TENSOR_PARALLEL = """
import json, numpy as np, jax, jax.numpy as jnp, flax.linen as nn
from jax.sharding import Mesh
from moe_jax.fields import MESH_AXES
from moe_jax.model.transformer import HybridMoE
from moe_jax.train.state import frozen_model_config
from tests.conftest import make_small_config, rel_err
c = make_small_config()
c.model.update({"layer_pattern": "KA", "n_layers": 2, "dtype": "float32"})
model = HybridMoE(frozen_model_config(c))
seg = np.concatenate([np.ones((2, 40)), np.full((2, 24), 2)], axis=1)
batch = {"tokens": jnp.asarray(np.arange(128).reshape(2, 64) % 259, jnp.int32),
         "segment_ids": jnp.asarray(seg, jnp.int32)}
variables = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), batch))
loss = lambda p: (model.apply({**variables, "params": p}, batch)[0] ** 2).mean()
l1, g1 = jax.jit(jax.value_and_grad(loss))(variables["params"])
with jax.set_mesh(Mesh(np.array(jax.devices()).reshape(1, 1, 1, 1, 2), MESH_AXES)):
  l2, g2 = jax.jit(jax.value_and_grad(loss))(variables["params"])
print("RESULT", json.dumps({"loss": [float(l1), float(l2)], "grads": max(
    float(rel_err(a, b)) for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)))}))
"""


@pytest.mark.slow
def test_heads_split_over_tensor_equal_one_device():
  """Two fake CPU devices, mesh tensor=2 (KDA and MLA heads split): the same loss and
  gradients as one device. The KDA op's per-head gate parameters go through per_device
  with the heads (a closure gave each device all heads' A_log: ValueError)."""
  proc = subprocess.run([sys.executable, "-c", _TENSOR_PARALLEL], env=cpu_devices_env(2),
                        capture_output=True, text=True, cwd=ROOT, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads([l for l in proc.stdout.splitlines() if l.startswith("RESULT")][0][7:])
  one, split = r["loss"]
  assert np.isfinite(one) and abs(one - split) <= 1e-6 * abs(one)
  assert r["grads"] < 1e-5


@pytest.mark.parametrize("dtype,vocab", [("bfloat16", 259), ("float32", 259),
                                         ("bfloat16", 5000)])
def test_embedding_lookup_equals_gather_with_its_gradient(dtype, vocab):
  """embed_lookup (a one-hot matmul up to ONE_HOT_VOCAB, else the gather of fp32 rows) gives
  exactly nn.Embed's rows and its table gradient (to bf16 rounding: nn.Embed's sums a
  token's repeats in bf16), repeated tokens included; above ONE_HOT_VOCAB the gradient
  never holds the table in the compute dtype (nn.Embed's casts all of it)."""
  from moe_jax.model.layers import ONE_HOT_VOCAB, embed_lookup

  class Lookup(nn.Module):
    @nn.compact
    def __call__(self, tokens, one_hot):
      embed = nn.Embed(vocab, 24, dtype=jnp.dtype(dtype), param_dtype=jnp.float32)
      return embed_lookup(embed, tokens) if one_hot else embed(tokens)

  assert (vocab <= ONE_HOT_VOCAB) == (vocab == 259)
  tokens = jax.random.randint(jax.random.key(0), (3, 40), 0, vocab).at[:, :5].set(7)
  m = Lookup()
  params = m.init(jax.random.key(1), tokens, True)
  w = jax.random.normal(jax.random.key(2), (3, 40, 24))
  loss = lambda p, one_hot: (m.apply(p, tokens, one_hot).astype(jnp.float32) * w).sum()
  np.testing.assert_array_equal(np.asarray(m.apply(params, tokens, True), np.float32),
                                np.asarray(m.apply(params, tokens, False), np.float32))
  g_one_hot, g_gather = (jax.grad(loss)(params, flag)["params"]["Embed_0"]["embedding"]
                         for flag in (True, False))
  assert float(jnp.abs(g_gather).max()) > 0
  assert rel_err(g_one_hot, g_gather) < (1e-6 if dtype == "float32" else 1e-2)
  if vocab > ONE_HOT_VOCAB:
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda p: loss(p, True)))(params))
    assert f"f32[{vocab},24]" in jaxpr and f"bf16[{vocab},24]" not in jaxpr
