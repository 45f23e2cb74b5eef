"""Inference: cached decode equals the full forward, chunked prefill equals one-shot, sampling
filters, stop tokens, and scripts/generate.py on a checkpoint written by the training loop."""

import functools
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from moe_jax.data import tokenizer
from moe_jax.infer import sampling
from moe_jax.infer.cache import init_cache
from moe_jax.infer.generate import (decode, inference_model, inference_variables, make_step,
                                    prefill)
from moe_jax.model import kda as kda_module
from moe_jax.model.transformer import HybridMoE
from moe_jax.train.loop import train_and_evaluate
from moe_jax.train.state import frozen_model_config
from pallas_kernels.attention import pallas_gpu_latent_decode as latent_decode, xla_cached
from pallas_kernels.matmul import pallas_gpu_few_rows as few_rows
from pallas_kernels.moe import ops as moe_ops
from tests.conftest import ROOT, count_calls, make_small_config, rel_err, subprocess_env

_LENGTHS = np.array([37, 22, 30])  # three rows of different lengths
_T = 40


@pytest.fixture(scope="module")
def hybrid():
  """fp32 hybrid KDA+MLA model, MoE from layer 1 (capacity dispatch in training)."""
  c = make_small_config()
  c.model.update({"dtype": "float32", "n_layers": 4, "layer_pattern": "KKA"})
  c.model.moe.dispatch, c.model.moe.capacity_factor = "capacity", 0.5
  model = inference_model(frozen_model_config(c))
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, (3, _T)).astype(np.int32)
  seg = (np.arange(_T)[None] < _LENGTHS[:, None]).astype(np.int32)
  batch = {"tokens": tokens, "segment_ids": seg}
  variables = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), batch))
  variables["router"] = jax.tree.map(lambda b: b + 0.01 * jnp.arange(b.size), variables["router"])
  full, _ = jax.jit(model.apply)(variables, batch)
  return model, variables, tokens, full


def test_inference_model_never_drops(hybrid):
  model, *_ = hybrid
  assert model.cfg.moe.dispatch == "dropless"


def _with_model_fields(model, **fields):
  cfg = ml_collections.ConfigDict(model.cfg.to_dict())
  cfg.update(fields)
  return model.clone(cfg=ml_collections.FrozenConfigDict(cfg))


def _decode_errors(step, variables, cache, tokens, full, prompt, lengths):
  """Feeds each row's true tokens one at a time from its prompt length to its length:
  (relative errors of the decoded logits against the full forward's, final cache)."""
  B, T = tokens.shape
  pos, errs = prompt.copy(), []
  while (pos < lengths).any():
    live = pos < lengths
    logits, cache = step(variables, tokens[np.arange(B), np.minimum(pos, T - 1)][:, None],
                         live[:, None], cache)
    errs += [rel_err(logits[b, 0], full[b, pos[b]]) for b in range(B) if live[b]]
    pos = pos + live
  return errs, cache


# make test: XLA over several key blocks, the GPU attention and the Pallas matmuls (both
# over one block); XLA over one block in the second tier.
@pytest.mark.parametrize("key_block,impl,matmul", [
    pytest.param(1024, "xla", "xla", marks=pytest.mark.slow), (8, "xla", "xla"),
    (1024, "gpu", "xla"), (1024, "xla", "pallas")])
def test_decode_reproduces_full_forward(hybrid, key_block, impl, matmul, monkeypatch):
  """Prefill prompts of 13/5/9 tokens in chunks of 4, then feed the true tokens one by one.
  key_block 8: MLA's online softmax runs over several cache blocks (the last one partial).
  "gpu": the split-cache Pallas decode kernel (interpret mode), 4 chunks of 16 positions.
  "pallas": every projection whose shapes fit runs through the few-rows matmul kernel
  (interpret mode; ≤ 12 rows per step here)."""
  monkeypatch.setattr(xla_cached, "KEY_BLOCK", key_block)
  monkeypatch.setattr(xla_cached, "SCORE_BUDGET", 0)  # decode blocks of key_block too
  monkeypatch.setattr(latent_decode, "CHUNK", 16)
  monkeypatch.setattr(latent_decode, "BLOCK_K", 16)
  kernel_calls = count_calls(monkeypatch, few_rows, "matmul")
  monkeypatch.setattr(few_rows, "dot_general",
                      functools.partial(few_rows.dot_general, interpret=True))
  model, variables, tokens, full = hybrid
  model = _with_model_fields(model, mla_implementation=impl, decode_matmul=matmul)
  step = make_step(model)
  prompt = np.array([13, 5, 9])
  cache = init_cache(model.cfg, 3, 64)
  last, cache = prefill(step, variables, cache, tokens[:, :13], prompt, chunk=4)
  for b in range(3):
    assert rel_err(last[b], full[b, prompt[b] - 1]) < 1e-4
  errs, cache = _decode_errors(jax.jit(step), variables, cache, tokens, full, prompt, _LENGTHS)
  assert len(errs) == (_LENGTHS - prompt).sum() and max(errs) < 1e-4
  np.testing.assert_array_equal(cache["length"], _LENGTHS)
  assert bool(kernel_calls) == (matmul == "pallas")


# make test keeps the decode kernels' variant (the XLA one: 18 s more on 2 cores).
@pytest.mark.parametrize("kernels", [pytest.param(False, marks=pytest.mark.slow), True])
def test_greedy_batch_decode_equals_each_row_alone_and_the_full_forward(hybrid, kernels,
                                                                       monkeypatch):
  """Greedy decoding of 3 prompts (13, 5, 9 tokens) together gives each row the tokens it
  gets decoded alone (batch 1), and every generated token is the argmax of the full
  forward over the prompt and the tokens before it. kernels: the decode step's KDA layers
  and MoE layers as their Pallas kernels (model.kda_decode, moe.decode_dispatch="layer"),
  else their XLA forms (decode_dispatch "gather": "auto" takes the layer kernels on GPU)."""
  model, variables, tokens, _ = hybrid
  moe = {**model.cfg.moe.to_dict(), "decode_dispatch": "layer" if kernels else "gather"}
  model = _with_model_fields(model, kda_decode="kernel" if kernels else "xla", moe=moe)
  calls = (count_calls(monkeypatch, kda_module, "decode_step"),
           count_calls(monkeypatch, moe_ops, "decode_layer"))
  step, prompt, n = make_step(model), np.array([13, 5, 9]), 10
  greedy = functools.partial(decode, step, max_new=n, temperature=0.0, stop_tokens=(-1,))

  def run(rows):
    cache = init_cache(model.cfg, len(rows), 32)
    last, cache = prefill(step, variables, cache, tokens[rows, :13], prompt[rows], chunk=5)
    out, n_new, _ = greedy(variables, cache, last, jax.random.key(0))
    assert (np.asarray(n_new) == n).all()
    return np.asarray(out)

  together = run(np.arange(3))
  # The full forward over each prompt and its tokens, the three rows in one batch (trailing
  # padding, segment id 0, is inert): one compile, not one per length.
  seqs = [np.concatenate([tokens[b, :prompt[b]], together[b]]) for b in range(3)]
  full, seg = (np.zeros((3, max(map(len, seqs))), np.int32) for _ in range(2))
  for b, seq in enumerate(seqs):
    full[b, :len(seq)], seg[b, :len(seq)] = seq, 1
  logits, _ = jax.jit(model.apply)(variables, {"tokens": full, "segment_ids": seg})
  for b in range(3):
    np.testing.assert_array_equal(together[b], run(np.array([b]))[0])
    np.testing.assert_array_equal(
        np.asarray(logits[b, prompt[b] - 1:len(seqs[b]) - 1].argmax(-1)), together[b])
  assert all(bool(c) == kernels for c in calls)


@pytest.mark.parametrize("impl", ["xla", "gpu", "tpu"])
def test_chunked_prefill_equals_one_shot(hybrid, monkeypatch, impl):
  """Chunks of 7 (< kv_lora_rank: latent-space attention) vs one chunk of 40 (≥ rank: keys
  and values expanded, over 5 key blocks of 10 in a 48-slot cache with XLA, or by the GPU
  or TPU Pallas kernel in interpret mode with expansion blocks of 16)."""
  monkeypatch.setattr(xla_cached, "KEY_BLOCK", 10)
  monkeypatch.setattr(xla_cached, "SCORE_BUDGET", 0)
  monkeypatch.setattr(xla_cached, "EXPAND_BLOCK", 16)
  model, variables, tokens, _ = hybrid
  model = _with_model_fields(model, mla_implementation=impl)
  step = make_step(model)
  outs = [prefill(step, variables, init_cache(model.cfg, 3, 48), tokens, _LENGTHS, chunk=chunk)
          for chunk in (7, _T)]
  (l7, c7), (l40, c40) = outs
  assert rel_err(l7, l40) < 1e-5
  np.testing.assert_array_equal(c7["length"], _LENGTHS)
  for name, layer in c40["layers"].items():
    for path, ref in jax.tree_util.tree_leaves_with_path(layer):
      got = dict(jax.tree_util.tree_leaves_with_path(c7["layers"][name]))[path]
      if path[0].key == "ckv":  # compare the filled positions only
        ref = np.concatenate([ref[b, :n] for b, n in enumerate(_LENGTHS)])
        got = np.concatenate([got[b, :n] for b, n in enumerate(_LENGTHS)])
      assert rel_err(got, ref) < 1e-5 or np.array_equal(got, ref), (name, path)


def test_decode_loop_stops_at_stop_tokens(hybrid):
  model, variables, tokens, _ = hybrid
  step = make_step(model)
  prompt = np.array([6, 6, 6])
  cache = init_cache(model.cfg, 3, 32)
  logits, cache = prefill(step, variables, cache, tokens[:, :6], prompt, chunk=8)
  first = np.asarray(jnp.argmax(logits, -1))
  # Greedy, with row 0's first token as the stop token: row 0 stops after 1 token.
  out, n_new, cache = decode(step, variables, cache, logits, jax.random.key(0), max_new=10,
                             temperature=0.0, stop_tokens=(int(first[0]),))
  out, n_new = np.asarray(out), np.asarray(n_new)
  assert out[0, 0] == first[0] and n_new[0] == 1 and (out[0, 1:] == tokenizer.PAD).all()
  np.testing.assert_array_equal(out[:, 0], first)  # greedy = argmax
  assert int(cache["length"][0]) == 6 + 1


def test_sampling_respects_top_k_and_top_p():
  logits = jax.random.normal(jax.random.key(0), (1, 50)) * 2.0
  keys = jax.random.split(jax.random.key(1), 4000)
  order = np.argsort(-np.asarray(logits[0]))
  top5 = set(order[:5].tolist())
  got = np.asarray(jax.vmap(lambda k: sampling.sample(logits, k, top_k=5)[0])(keys))
  assert set(got.tolist()) <= top5 and len(set(got.tolist())) == 5
  probs = np.asarray(jax.nn.softmax(logits[0]))[order]
  n_nucleus = int(np.searchsorted(np.cumsum(probs), 0.6) + 1)
  nucleus = set(order[:n_nucleus].tolist())
  got = np.asarray(jax.vmap(lambda k: sampling.sample(logits, k, top_p=0.6)[0])(keys))
  assert set(got.tolist()) <= nucleus and len(set(got.tolist())) == n_nucleus
  # Sampling with no filter follows the softmax: the top token's frequency is within 4σ.
  got = np.asarray(jax.vmap(lambda k: sampling.sample(logits, k)[0])(keys))
  p0 = probs[0]
  assert abs((got == order[0]).mean() - p0) < 4 * np.sqrt(p0 * (1 - p0) / len(keys))
  # Seeded: the same key gives the same draws.
  again = np.asarray(jax.vmap(lambda k: sampling.sample(logits, k)[0])(keys))
  np.testing.assert_array_equal(got, again)
  for bad in ({"temperature": -1.0}, {"top_k": -2}, {"top_p": 0.0}, {"top_p": 1.5}):
    with pytest.raises(ValueError, match=next(iter(bad))):
      sampling.validate(**{"temperature": 1.0, "top_k": 0, "top_p": 1.0, **bad})


@pytest.mark.slow
def test_generate_script_on_a_trained_checkpoint(tmp_path):
  c = make_small_config()
  c.schedule.total_steps, c.schedule.warmup_steps = 2, 1
  train_and_evaluate(c, str(tmp_path), progress=False)
  proc = subprocess.run(
      [sys.executable, "scripts/generate.py", f"--workdir={tmp_path}", "--prompt=def f(x):",
       "--prompt=import", "--max_new_tokens=12", "--temperature=0"],
      capture_output=True, text=True, cwd=ROOT, env=subprocess_env(),
      timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "# checkpoint step 2 of" in proc.stdout
  assert "=== 'def f(x):'" in proc.stdout and "=== 'import'" in proc.stdout


def _prefill_then_decode_errors(c, lengths, prompt, cache_len, seed, init_model=None):
  """An inference model of config c with random weights (init_model's, default its own):
  prefill each row's prompt (one chunk), then decode its true tokens one at a time up to
  its length. (the model's variables, relative errors of the decoded logits against the
  full forward's)."""
  model = inference_model(frozen_model_config(c))
  T = int(lengths.max())
  tokens = np.random.default_rng(seed).integers(0, 256, (len(lengths), T)).astype(np.int32)
  batch = {"tokens": tokens, "segment_ids": (np.arange(T)[None] < lengths[:, None]).astype(np.int32)}
  variables = nn.meta.unbox(jax.jit((init_model or model).init)(jax.random.key(0), batch))
  full, _ = jax.jit(model.apply)(variables, batch)
  P = int(prompt.max())
  cache = init_cache(model.cfg, len(lengths), cache_len)
  _, cache = prefill(make_step(model), variables, cache, tokens[:, :P], prompt, chunk=P)
  errs, _ = _decode_errors(jax.jit(make_step(model)), variables, cache, tokens, full, prompt,
                           lengths)
  return variables, errs


# fused is what test_decode_reproduces_full_forward decodes: make test keeps the six.
@pytest.mark.parametrize("layout", [pytest.param("fused", marks=pytest.mark.slow), "six"])
def test_either_projection_layout_decodes_to_the_full_forward(layout):
  """The inference model reads KDA's input projections in the layout its params hold:
  fused (one `in_proj`, what it initialises and inference_variables gives) or six (training
  variables of model.fused_projections = False, passed as they are). Either way prefill and
  the recurrent decode step give the full forward's logits."""
  c = make_small_config()
  c.model.update({"dtype": "float32", "n_layers": 2, "layer_pattern": "KA"})
  lengths, prompt = np.array([12, 9]), np.array([4, 3])
  train = HybridMoE(frozen_model_config(c)) if layout == "six" else None
  variables, errs = _prefill_then_decode_errors(c, lengths, prompt, cache_len=16, seed=4,
                                                init_model=train)
  mixer = variables["params"]["layer_0"]["mixer"]
  assert ("in_proj" in mixer) == (layout == "fused") and ("q_proj" in mixer) == (layout == "six")
  assert len(errs) == (lengths - prompt).sum() and max(errs) < 1e-4


@pytest.mark.slow   # an opt-in MoE (moe.latent_dim > 0): second tier, 10 s on 2 cores
def test_latent_moe_decode_reproduces_full_forward():
  """Latent MoE (model.moe.latent_dim) at inference: prefill + token-by-token decode give the
  full forward's logits (decode takes the gathered-experts path, the full forward the
  sorted grouped matmul, both on the R-wide latent)."""
  c = make_small_config()
  c.model.update({"dtype": "float32", "n_layers": 2, "layer_pattern": "KA"})
  c.model.moe.latent_dim = 24
  lengths, prompt = np.array([12, 9]), np.array([4, 3])
  variables, errs = _prefill_then_decode_errors(c, lengths, prompt, cache_len=16, seed=1)
  assert "latent_down" in variables["params"]["layer_1"]["ffn"]
  assert len(errs) == (lengths - prompt).sum() and max(errs) < 1e-4


@pytest.mark.slow   # the RoPE control (mla_rope_theta > 0; NoPE is the default): 11 s
def test_rope_mla_decode_reproduces_full_forward():
  """RoPE on MLA's shared key dims (model.mla_rope_theta): the cache stores the turned key
  dims at each row's positions and decode turns each new query by its own, so prefill +
  token-by-token decode give the full forward's logits."""
  c = make_small_config()
  c.model.update({"dtype": "float32", "n_layers": 2, "layer_pattern": "KA",
                  "mla_qk_rope_dim": 4, "mla_rope_theta": 10_000.0})
  lengths, prompt = np.array([14, 9]), np.array([5, 3])
  _, errs = _prefill_then_decode_errors(c, lengths, prompt, cache_len=16, seed=3)
  assert len(errs) == (lengths - prompt).sum() and max(errs) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("rope_dim", [0, 64])
def test_gpu_kimi_mla_decode_reproduces_full_forward(monkeypatch, rope_dim):
  """Kimi-Linear-48B's MLA shapes (32 heads, kv_lora_rank 512, qk 128, v 128, no q LoRA):
  token-by-token decode through the split-cache latent kernel at rank 512 (32 query rows a
  step) gives the full forward's logits; a cache of 4 chunks of 1024 positions. With the
  published 64 shared key dims the cache rows are 576 wide: the kernel's two tiles."""
  monkeypatch.setattr(latent_decode, "CHUNK", 1024)
  calls = count_calls(monkeypatch, latent_decode, "latent_decode_attention")
  c = make_small_config()
  c.model.update({"dtype": "float32", "n_layers": 1, "layer_pattern": "A", "d_model": 256,
                  "n_heads": 32, "mla_q_lora_rank": 0, "mla_kv_lora_rank": 512,
                  "mla_qk_head_dim": 128, "mla_qk_rope_dim": rope_dim, "mla_v_head_dim": 128,
                  "mla_implementation": "gpu"})
  lengths, prompt = np.array([24, 17]), np.array([8, 5])
  _, errs = _prefill_then_decode_errors(c, lengths, prompt, cache_len=4096, seed=2)
  assert calls, "decode did not take the latent kernel"
  assert len(errs) == (lengths - prompt).sum() and np.isfinite(errs).all() and max(errs) < 1e-4


def test_inference_variables_fuse_kda_and_hold_the_matrices_in_the_model_dtype():
  """From training variables (six KDA projections, fp32 params): each KDA mixer's six
  input projections come out as one `in_proj`; the MoE experts, routed and shared, and
  every layer's `kernel` in the model's dtype (so no decode step converts them or reads
  them in fp32); norm scales, gate parameters, embeddings and the router as stored. The
  model computes bit-equal logits from the cast and the uncast fused params, and the six's
  within bf16 rounding (bf16, a KDA and an MLA layer, a dense FFN and an MoE one)."""
  c = make_small_config()
  c.model.update({"dtype": "bfloat16", "n_layers": 2, "layer_pattern": "KA"})
  model = inference_model(frozen_model_config(c))
  tokens = np.random.default_rng(0).integers(0, 256, (2, 8)).astype(np.int32)
  batch = {"tokens": tokens, "segment_ids": np.ones((2, 8), np.int32)}
  train = HybridMoE(frozen_model_config(c))
  variables = nn.meta.unbox(jax.jit(train.init)(jax.random.key(0), batch))
  cast = inference_variables(model.cfg, variables)
  mixer = cast["params"]["layer_0"]["mixer"]
  assert "in_proj" in mixer and not set(kda_module.FUSED_PROJECTIONS) & set(mixer)
  moe = cast["params"]["layer_1"]["ffn"]
  assert moe["gate_up"].dtype == moe["down"].dtype == jnp.bfloat16
  assert moe["router_kernel"].dtype == jnp.float32
  leaves = jax.tree_util.tree_leaves_with_path(cast["params"])
  kernels = {jax.tree_util.keystr(k) for k, _ in leaves if jax.tree_util.keystr(k).endswith("['kernel']")}
  assert any("shared" in k for k in kernels) and any("in_proj" in k for k in kernels)
  assert any("dense_ffn" in k or "layer_0']['ffn" in k for k in kernels)
  for k, w in leaves:
    name = jax.tree_util.keystr(k)
    want = jnp.bfloat16 if name in kernels or name.endswith(("['gate_up']", "['down']")) else jnp.float32
    assert w.dtype == want, name
  apply = jax.jit(model.apply)
  fused = {**variables, "params": kda_module.fuse_projections(variables["params"])}
  got = np.asarray(apply(cast, batch)[0], np.float32)
  np.testing.assert_array_equal(got, np.asarray(apply(fused, batch)[0], np.float32))
  assert rel_err(got, apply(variables, batch)[0]) < 1e-2
  # And a decode step after a prefill (T = 1: the cached paths, MLA's absorbed k_b / v_b).
  step = jax.jit(make_step(model))

  def next_logits(v):
    cache = init_cache(model.cfg, 2, 16)
    _, cache = step(v, tokens[:, :7], np.ones((2, 7), bool), cache)
    return np.asarray(step(v, tokens[:, 7:], np.ones((2, 1), bool), cache)[0])
  np.testing.assert_array_equal(next_logits(cast), next_logits(fused))
