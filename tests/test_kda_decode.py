"""model.kda_decode = "kernel": a KDA layer's decode step as one Pallas kernel
(pallas_kernels/kda/pallas_gpu_decode.py), in interpret mode on CPU. It must give the XLA
step's logits and cache (state, conv tails, their segment ids) token by token, padding rows
included, for both gates and both projection layouts; reproduce the full forward; and
compile for the H200 without spills at the benchmark and Kimi shapes. "auto", the default,
takes it on GPU only, where its shapes fit."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.kernel_registers import dump_ttir, ptxas_report
from moe_jax.config import validate
from moe_jax.infer.cache import init_cache
from moe_jax.infer.generate import inference_model, make_step, prefill
from moe_jax.model import kda as kda_module
from moe_jax.model.transformer import HybridMoE
from moe_jax.train.state import frozen_model_config
from pallas_kernels.kda import pallas_gpu_decode
from tests.conftest import count_calls, make_small_config, rel_err
from tests.test_infer import _prefill_then_decode_errors


def _decode(c, kda_decode, tokens, prompt, lengths):
  """Prefill `prompt` tokens of each row, then feed the rest one at a time (a row past its
  length is padding): (logits [steps, B, V] float32, final cache). The weights are the
  training model's, in the projection layout of c.model.fused_projections, which the
  inference model reads as they are."""
  c = c.copy_and_resolve_references()
  c.model.kda_decode = kda_decode
  model = inference_model(frozen_model_config(c))
  B, T = tokens.shape
  batch = {"tokens": tokens, "segment_ids": np.ones((B, T), np.int32)}
  train = HybridMoE(frozen_model_config(c))
  variables = nn.meta.unbox(jax.jit(train.init)(jax.random.key(0), batch))
  cache = init_cache(model.cfg, B, T + 4)
  _, cache = prefill(make_step(model), variables, cache, tokens[:, :prompt],
                     np.full(B, prompt), chunk=prompt)
  step, out = jax.jit(make_step(model)), []
  for t in range(prompt, T):
    logits, cache = step(variables, tokens[:, t:t + 1], (t < lengths)[:, None], cache)
    out.append(np.asarray(logits[:, 0], np.float32))
  return np.stack(out), cache


# make test runs each variant in one dtype (the seeds' and the fused projections' fp32,
# Kimi's bf16); the other three pairs in the second tier (8-12 s each on 2 cores).
@pytest.mark.parametrize("variant,dtype,bound", [
    ("seeds", "float32", 1e-5), pytest.param("seeds", "bfloat16", 2e-2, marks=pytest.mark.slow),
    pytest.param("kimi", "float32", 1e-5, marks=pytest.mark.slow), ("kimi", "bfloat16", 2e-2),
    pytest.param("fused_projections", "float32", 1e-5, marks=pytest.mark.slow),
    pytest.param("fused_projections", "bfloat16", 2e-2, marks=pytest.mark.slow)])
def test_kernel_step_equals_the_xla_step(variant, dtype, bound, monkeypatch):
  """seeds: the bounded gate, a bias on the output gate; kimi: the unbounded gate, no bias;
  fused_projections: the six projections as one array the kernel reads in place. Row 1
  turns to padding after 2 tokens: its state and tails must stay as they were. bf16: the
  two paths round at the same points but not every op alike (measured 4.9e-3)."""
  c = make_small_config()
  c.model.update({"dtype": dtype, "n_layers": 2, "layer_pattern": "KA"})
  if variant == "kimi":
    c.model.update({"kda_lower_bound": None, "kda_output_gate_bias": False})
  c.model.fused_projections = variant == "fused_projections"
  tokens = np.random.default_rng(1).integers(0, 256, (2, 10)).astype(np.int32)
  lengths = np.array([10, 6])
  calls = count_calls(monkeypatch, kda_module, "decode_step")
  got, got_cache = _decode(c, "kernel", tokens, 4, lengths)
  assert calls, "the kernel path did not run"
  want, want_cache = _decode(c, "xla", tokens, 4, lengths)
  assert np.isfinite(got).all() and got.shape == want.shape
  assert rel_err(got[:, 0], want[:, 0]) < bound and rel_err(got[:2, 1], want[:2, 1]) < bound
  layer = lambda cache: cache["layers"]["layer_0"]
  assert rel_err(layer(got_cache)["state"], layer(want_cache)["state"]) < bound
  for conv in ("q_conv", "k_conv", "v_conv"):
    np.testing.assert_array_equal(layer(got_cache)[conv]["seg"], layer(want_cache)[conv]["seg"])
    np.testing.assert_array_equal(np.asarray(layer(got_cache)[conv]["x"], np.float32),
                                  np.asarray(layer(want_cache)[conv]["x"], np.float32))


def test_kernel_decode_reproduces_full_forward():
  """Prefill, then the kernel step token by token: the full forward's logits (fp32). Row 1's
  one-token prompt leaves conv tails whose segment ids differ (padding, then the document)
  for the first steps: every head must mask by the ids as they were before the step."""
  c = make_small_config()
  c.model.update({"dtype": "float32", "n_layers": 2, "layer_pattern": "KA",
                  "kda_decode": "kernel"})
  lengths, prompt = np.array([12, 9]), np.array([4, 1])
  _, errs = _prefill_then_decode_errors(c, lengths, prompt, cache_len=16, seed=4)
  assert len(errs) == (lengths - prompt).sum() and max(errs) < 1e-4


def _fused_launch(B, H, K, W, bias):
  """(step, zero arguments) of one compiled (interpret=False) bf16 kernel launch with the six
  projections fused into one array: the bounded gate and an output-gate bias with `bias`,
  else Kimi's unbounded gate without one."""
  bf = lambda *s: jnp.zeros(s, jnp.bfloat16)
  N = 3 * H * K + 2 * K + H
  widths = (H * K, H * K, H * K, K, H, K)
  where = {n: (0, int(f)) for n, f in zip(pallas_gpu_decode.PROJECTIONS,
                                          np.cumsum((0,) + widths))}
  conv = {n: (bf(B, W - 1, H * K), jnp.zeros((W, H * K))) for n in "qkv"}
  conv["seg"] = jnp.zeros((B, W - 1), jnp.int32)
  params = {"f_b": jnp.zeros((K, H, K)), "A_log": jnp.zeros(H), "dt_bias": jnp.zeros(H * K),
            "g_b": jnp.zeros((K, H, K)), "g_b_bias": jnp.zeros((H, K)) if bias else None,
            "o_norm": jnp.ones(K)}

  def step(y, seg, conv, params, state):
    return pallas_gpu_decode.decode_step((y,), where, seg, conv, params, state,
                                         lower_bound=-5.0 if bias else None, eps=1e-6,
                                         dtype=jnp.bfloat16, interpret=False)
  return step, (bf(B, N), jnp.ones(B, jnp.int32), conv, params, jnp.zeros((B, H, K, K)))


@pytest.mark.parametrize("B,H,K,W,bias", [(1, 16, 64, 4, True), (8, 16, 64, 4, True),
                                          (1, 32, 128, 4, False)])
def test_compiles_for_h200_without_spills(B, H, K, W, bias, tmp_path):
  """configs/long_context_1b.py's KDA layers at batch 1 and 8, and Kimi Linear's (128-wide
  heads, no output-gate bias), the six projections fused into one array: lowered for an
  H200, compiled to PTX by the triton package and by ptxas for sm_90a at the shipped launch
  width, without spills (the state would go through local memory)."""
  step, args = _fused_launch(B, H, K, W, bias)
  kernels = dump_ttir(step, args, str(tmp_path))
  assert kernels == {"kda_decode_step": pallas_gpu_decode.num_warps(K)}
  registers, spilled = ptxas_report(str(tmp_path / "kda_decode_step.ttir"),
                                    kernels["kda_decode_step"])
  assert registers <= 255 and spilled == 0, (registers, spilled)


def test_the_kernel_writes_nothing_in_place():
  """Every output of the decode kernel is a new array. A program's 1-D blocks are replicated
  over its threads and warps do not synchronize between a load and another warp's store, so
  in place a new tail row could land before another warp read the old one: on an H200 o and
  the state were 2-34% off in fp32 (benchmarks/gpu_tests.md). Interpret mode cannot show
  that race, so this asserts the launch itself: no input-output aliases."""
  step, args = _fused_launch(2, 4, 32, 4, bias=False)
  jaxpr = jax.make_jaxpr(step)(*args)
  calls = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
  assert len(calls) == 1 and calls[0].params["input_output_aliases"] == ()


@pytest.mark.parametrize("field,value,match", [
    ("kda_decode", "pallas",
     r"model\.kda_decode must be one of \('auto', 'xla', 'kernel'\), got 'pallas'"),
    ("kda_head_dim", 24, r"model\.kda_head_dim must be a power of two >= 16 with "
                         r"model\.kda_decode='kernel', got 24"),
    ("kda_conv_size", 1, r"model\.kda_conv_size must be >= 2 with model\.kda_decode='kernel', "
                         r"got 1")])
def test_config_errors_name_the_field(field, value, match):
  c = make_small_config()
  if field != "kda_decode":
    c.model.kda_decode = "kernel"
  c.model[field] = value
  with pytest.raises(ValueError, match=match):
    validate(c)


def test_kernel_rejects_heads_it_cannot_tile():
  with pytest.raises(ValueError, match=r"K == V, a power of two >= 16; got K=24, V=24"):
    pallas_gpu_decode.decode_step((), {}, jnp.ones(1, jnp.int32),
                                  {"q": (None, jnp.zeros((4, 48)))}, {},
                                  jnp.zeros((1, 2, 24, 24)), lower_bound=None, eps=1e-6,
                                  dtype=jnp.float32)


@pytest.mark.slow   # about 30 s a shape in interpret mode; its point is the native run
@pytest.mark.parametrize("shape", ["long_context_1b", "kimi"])
def test_decode_kernels_at_realistic_widths_are_as_accurate_as_the_xla_step(shape):
  """The decode kernels at realistic widths (natively on a GPU), all on (kda_decode=kernel,
  the fused projections, moe.decode_dispatch=layer), in bf16: two layers of
  configs/long_context_1b.py's shapes (16 KDA heads of 64, 32 experts of 704, top-4, a
  shared expert) or of Kimi Linear's KDA and MoE (32 heads of 128, 256 experts top-8, the
  unbounded gate), batch 2 with one row turning to padding.

  Two bf16 paths round at different points (and a GPU's XLA path also sums in other
  orders), so each is measured against the same model in fp32 (full-precision products)
  and the kernels must be about as close as the default XLA step: the first layer's KDA
  state (the kernel alone; no routing before it) within 1.5x the XLA step's error, the
  logits within 2x plus 1e-2 (routing is discontinuous: a near tie can pick another
  expert in either bf16 path). In fp32 the kernels must equal the XLA step (CPU: state
  1.0e-7, logits 1.8e-7 / 1.9e-7; bounds 1e-5 and 1e-4 leave room for a GPU's summation
  orders). Interpret mode on CPU, kernels (XLA step) from fp32: states
  8.1e-3 / 8.2e-3 (8.6e-3 / 8.7e-3), logits 3.1e-3 / 3.7e-3 (3.1e-3 / 3.8e-3). Natively,
  with the kernel writing its tails and state in place, the kernels' state was 4.9e-2 /
  7.4e-2 from fp32 against the XLA step's 8.5e-3 / 8.6e-3: the in-place race that
  test_the_kernel_writes_nothing_in_place now rules out."""
  c = make_small_config()
  c.model.update({"n_layers": 2, "layer_pattern": "KA"})
  if shape == "long_context_1b":
    c.model.update({"d_model": 1024, "n_heads": 16, "kda_head_dim": 64})
    c.model.moe.update({"num_experts": 32, "top_k": 4, "expert_hidden": 704})
  else:
    c.model.update({"d_model": 512, "n_heads": 4, "kda_n_heads": 32, "kda_head_dim": 128,
                    "kda_lower_bound": None, "kda_output_gate_bias": False})
    c.model.moe.update({"num_experts": 256, "top_k": 8, "expert_hidden": 128})
  c.model.fused_projections = True   # a parameter layout: both paths read the same in_proj
  tokens = np.random.default_rng(5).integers(0, 256, (2, 10)).astype(np.int32)
  lengths = np.array([10, 7])

  def run(dtype, kda_decode, dispatch):
    c.model.dtype, c.model.moe.decode_dispatch = dtype, dispatch
    return _decode(c, kda_decode, tokens, 4, lengths)
  with jax.default_matmul_precision("highest"):
    ref, ref_cache = run("float32", "xla", "auto")
    exact, exact_cache = run("float32", "kernel", "layer")
  xla, xla_cache = run("bfloat16", "xla", "auto")
  got, got_cache = run("bfloat16", "kernel", "layer")
  assert np.isfinite(got).all()
  state = lambda cache: cache["layers"]["layer_0"]["state"]
  assert rel_err(state(exact_cache), state(ref_cache)) < 1e-5   # a race or miscompile: 2e-2+
  assert rel_err(exact, ref) < 1e-4
  assert rel_err(state(got_cache), state(ref_cache)) < 1.5 * rel_err(state(xla_cache),
                                                                      state(ref_cache))
  live = lambda x: np.concatenate([x[:, 0], x[:3, 1]])   # row 1 is padding after 3 steps
  assert rel_err(live(got), live(ref)) < 2 * rel_err(live(xla), live(ref)) + 1e-2


@pytest.mark.slow   # 12 s on 2 cores
def test_a_tpu_takes_the_xla_step(monkeypatch):
  """The decode kernels are Triton's: with a TPU as the target platform, model.kda_decode
  and moe.decode_dispatch="layer" leave the step to XLA (the kernels never run) and the
  logits are the XLA step's."""
  from pallas_kernels import platform
  from pallas_kernels.moe import ops as moe_ops
  c = make_small_config()
  c.model.update({"dtype": "float32", "n_layers": 2, "layer_pattern": "KA",
                  "mla_implementation": "xla", "kda_implementation": "xla"})
  tokens = np.random.default_rng(1).integers(0, 256, (2, 8)).astype(np.int32)
  lengths = np.array([8, 8])
  want, _ = _decode(c, "xla", tokens, 4, lengths)
  monkeypatch.setattr(platform, "target", lambda: "tpu")
  calls = (count_calls(monkeypatch, kda_module, "decode_step"),
           count_calls(monkeypatch, moe_ops, "decode_layer"))
  c.model.moe.decode_dispatch = "layer"
  got, _ = _decode(c, "kernel", tokens, 4, lengths)
  assert not any(calls)
  assert rel_err(got, want) < 1e-6


@pytest.mark.parametrize("choice,backend,K,conv,want", [
    ("auto", "gpu", 64, 4, True), ("auto", "cpu", 64, 4, False), ("auto", "tpu", 64, 4, False),
    ("auto", "gpu", 24, 4, False), ("auto", "gpu", 64, 1, False),
    ("kernel", "cpu", 64, 4, True), ("kernel", "tpu", 64, 4, False), ("xla", "gpu", 64, 4, False)])
def test_auto_takes_the_kernel_on_gpu_where_it_fits(monkeypatch, choice, backend, K, conv, want):
  """model.kda_decode: "auto" (the default) is the kernel on GPU for K a power of two ≥ 16
  and a conv of width ≥ 2, the XLA step elsewhere; "kernel" is it anywhere but a TPU."""
  monkeypatch.setattr(kda_module.platform, "target", lambda: backend)
  c = make_small_config().model
  c.update({"kda_decode": choice, "kda_head_dim": K, "kda_conv_size": conv})
  assert kda_module.decode_by_kernel(c) is want
