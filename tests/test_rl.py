"""GRPO (moe_jax/rl/): the loss against a NumPy reference, advantages, masks and their
gradients on a real multi-turn rollout, routing replay, rollout log-probs against the
training forward, rewards and tools, the warm-up rows, and exact resume."""

import json
import os
import subprocess
import sys
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import grpo as grpo_config
from moe_jax import config as config_lib
from moe_jax.data import task_rows, tokenizer
from moe_jax.infer import workdir as workdir_lib
from moe_jax.infer.generate import inference_variables
from moe_jax.model import moe as moe_lib, router as router_lib
from moe_jax.model.moe import MoE
from moe_jax.model.transformer import HybridMoE
from moe_jax.rl import advantages, environments, replay, rewards, tools
from moe_jax.rl import loss as loss_lib, trainer
from moe_jax.rl.rollout import Budget, Sampler, rollout, rollout_in_pieces
from moe_jax.rl.tasks import Problem, Task, mistake_class
from moe_jax.rl.trainer import policy_model_config, train_grpo
from moe_jax.train import loop as loop_lib
from moe_jax.train.loop import train_and_evaluate
from moe_jax.train.state import frozen_model_config
from tests.conftest import ROOT, make_small_config, rel_err, subprocess_env


# ---- the loss against NumPy --------------------------------------------------------------

def _np_grpo(logp, old, ref, adv, mask, lo, hi, beta, norm, max_tokens):
  ratio = np.exp(logp - old)
  s1, s2 = ratio * adv[:, None], np.clip(ratio, 1 - lo, 1 + hi) * adv[:, None]
  d = ref - logp
  per_tok = -np.minimum(s1, s2) + beta * (np.exp(d) - d - 1)
  if norm == "token":
    loss = (per_tok * mask).sum() / mask.sum()
  elif norm == "sequence":
    rows = mask.sum(1) > 0
    loss = np.mean([(per_tok[b] * mask[b]).sum() / mask[b].sum() for b in np.flatnonzero(rows)])
  else:
    loss = (per_tok * mask).sum() / (mask.shape[0] * max_tokens)
  clipped = ((ratio < 1 - lo) & (adv[:, None] < 0)) | ((ratio > 1 + hi) & (adv[:, None] > 0))
  return loss, (clipped * mask).sum() / mask.sum(), ((np.exp(d) - d - 1) * mask).sum() / mask.sum()


def _np_kl_rollout(logp, old, mask):
  d = old - logp
  return ((np.exp(d) - d - 1) * mask).sum() / mask.sum()


@pytest.mark.parametrize("norm", loss_lib.NORMS)
def test_grpo_loss_equals_numpy_reference(norm):
  rng = np.random.default_rng(0)
  B, T = 6, 9
  logp = -rng.uniform(0.1, 3.0, (B, T))
  old = logp + rng.normal(0, 0.4, (B, T))      # ratios well outside [0.8, 1.28] too
  ref = logp + rng.normal(0, 0.3, (B, T))
  adv = rng.normal(0, 1, B)
  mask = (rng.random((B, T)) < 0.6).astype(np.float64)
  mask[2] = 0.0                                 # a row with nothing trained
  want, want_clip, want_kl = _np_grpo(logp, old, ref, adv, mask, 0.2, 0.28, 0.05, norm, 12)
  got, m = loss_lib.grpo_loss(*(jnp.asarray(x, jnp.float32) for x in (logp, old, adv, mask)),
                              ref_logp_BxT=jnp.asarray(ref, jnp.float32), clip_low=0.2,
                              clip_high=0.28, kl_coef=0.05, norm=norm, max_tokens=12)
  assert abs(float(got) - want) <= 1e-5 * max(abs(want), 1.0)
  assert 0.05 < want_clip < 0.95   # the fixture exercises clipping
  assert abs(float(m["clip_fraction"]) - want_clip) < 1e-6
  assert abs(float(m["kl"]) - want_kl) < 1e-5
  assert abs(float(m["kl_rollout"]) - _np_kl_rollout(logp, old, mask)) < 1e-5
  assert float(m["kl_rollout"]) > 0.01   # the fixture's rollout policy differs
  # Micro-batches of 2 rows, each given the whole batch's denominators, sum to the same.
  denom = loss_lib.denominators(jnp.asarray(mask, jnp.float32))
  shares = [loss_lib.grpo_loss(*(jnp.asarray(x[r:r + 2], jnp.float32)
                                 for x in (logp, old, adv, mask)),
                               ref_logp_BxT=jnp.asarray(ref[r:r + 2], jnp.float32),
                               clip_low=0.2, clip_high=0.28, kl_coef=0.05, norm=norm,
                               max_tokens=12, denom=denom) for r in range(0, B, 2)]
  assert abs(sum(float(l) for l, _ in shares) - want) <= 1e-5 * max(abs(want), 1.0)
  for k in ("clip_fraction", "kl", "kl_rollout", "ratio"):
    assert abs(sum(float(sm[k]) for _, sm in shares) - float(m[k])) < 1e-5
  # Nearly equal policies (|d| ~ 1e-5): exp(d) − d − 1 in float32 would go below 0.
  near = jnp.asarray(logp, jnp.float32) + 1e-5 * jnp.asarray(rng.normal(size=(B, T)), jnp.float32)
  _, m_near = loss_lib.grpo_loss(near, jnp.asarray(logp, jnp.float32), jnp.asarray(adv),
                                 jnp.asarray(mask))
  assert 0.0 <= float(m_near["kl_rollout"]) < 1e-9


def test_token_logprobs_and_entropy_equal_numpy():
  """The policy's log-prob of each target and its entropy (nats) at temperature 0.7, from
  one log-softmax: against NumPy; uniform logits give ln V."""
  rng = np.random.default_rng(1)
  logits = rng.normal(0, 2, (2, 5, 11))
  targets = rng.integers(0, 11, (2, 5))
  z = logits / 0.7
  logp_all = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(
      -1, keepdims=True)
  logp, ent = loss_lib.token_logprobs_and_entropy(jnp.asarray(logits, jnp.float32),
                                                  jnp.asarray(targets), 0.7)
  np.testing.assert_allclose(logp, np.take_along_axis(logp_all, targets[..., None], -1)[..., 0],
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ent, -(np.exp(logp_all) * logp_all).sum(-1), rtol=1e-5, atol=1e-5)
  _, flat = loss_lib.token_logprobs_and_entropy(jnp.zeros((1, 2, 11)), jnp.zeros((1, 2), int), 1.0)
  np.testing.assert_allclose(flat, np.log(11.0), rtol=1e-6)


def test_grpo_loss_rejects_unknown_normalisation():
  with pytest.raises(ValueError, match="rl.loss_norm"):
    loss_lib.grpo_loss(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.zeros(1), jnp.ones((1, 2)),
                       norm="mean")


@pytest.mark.parametrize("scale", advantages.SCALES)
def test_group_advantages(scale):
  r = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 2.0, 0.5, 0.5, 0.5, 0.5])
  a = advantages.group_advantages(r, 4, scale)
  g = r.reshape(3, 4)
  want = g - g.mean(1, keepdims=True)
  if scale == "group":
    want = want / (g.std(1, keepdims=True) + 1e-4)
  elif scale == "batch":
    want = want / (r.std() + 1e-4)
  np.testing.assert_allclose(a, want.reshape(-1), rtol=1e-6)
  assert a.reshape(3, 4)[2].tolist() == [0.0] * 4   # a constant group carries no signal


# ---- rollouts, masks and gradients -------------------------------------------------------

class _EchoTool(Task):
  """A multi-turn task for the test: a turn ends on any ASCII byte (an untrained model writes
  one within a few tokens), the environment answers each with a fixed reply."""
  name = "echo"
  stop_sequences = tuple(chr(i) for i in range(128))
  REPLY = "<result>42</result>"

  def sample(self, rng):
    return Problem(f"Q {int(rng.integers(100))}?", {"task": self.name, "answer": "42"})

  def respond(self, problem, completion):
    return self.REPLY if completion.count("<result>") < 2 else None


@pytest.fixture(scope="module")
def moe_policy():
  c = make_small_config()
  c.model.update({"dtype": "float32", "n_layers": 3, "layer_pattern": "KA"})
  c.model.moe.update(num_experts=8, top_k=2, first_dense=1)
  cfg = policy_model_config(frozen_model_config(c))
  model = HybridMoE(cfg)
  batch = {"tokens": np.zeros((1, 16), np.int32), "segment_ids": np.ones((1, 16), np.int32)}
  variables = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), batch))
  return cfg, model, variables


@pytest.mark.slow
def test_tool_output_prompt_and_padding_get_zero_gradient(moe_policy):
  cfg, model, variables = moe_policy
  task = _EchoTool()
  problems = [task.sample(np.random.default_rng(i)) for i in range(6)]
  b = Budget(max_prompt=8, max_new=10, max_turns=3, max_tool=20)
  ep = rollout(Sampler(cfg, record_routes=True), inference_variables(cfg, variables), problems,
               {"echo": task}, jax.random.key(1), b, temperature=1.0, seq_len=80)
  reply = tokenizer.encode(_EchoTool.REPLY, bos=False, eos=False)
  rows_with_reply = 0
  for r in range(len(problems)):
    seq = ep.tokens[r][ep.segment_ids[r] == 1]
    trained = np.concatenate([[0], ep.train_mask[r][:len(seq) - 1]])  # flag per token
    prompt = tokenizer.encode(problems[r].prompt, eos=False)
    assert (seq[:len(prompt)] == prompt).all() and not trained[:len(prompt)].any()
    # Every reply sits in the sequence untrained; everything else after the prompt is trained.
    starts = [i for i in range(len(seq) - len(reply) + 1)
              if (seq[i:i + len(reply)] == reply).all()]
    rows_with_reply += bool(starts)
    tool = np.zeros(len(seq), bool)
    for i in starts:
      tool[i:i + len(reply)] = True
    assert not trained[tool].any()
    assert trained[len(prompt):][~tool[len(prompt):]].all()
    assert ep.completions[r].count("<result>") == len(starts) == ep.tool_calls[r]
  assert rows_with_reply >= 3    # the fixture does exercise the multi-turn path
  # d loss / d logits is zero wherever the target is prompt, tool output or padding.
  logits = model.apply(variables, {"tokens": ep.tokens, "segment_ids": ep.segment_ids})[0]
  adv = np.linspace(-1, 1, len(problems)).astype(np.float32)

  def loss_of(logits):
    logp = loss_lib.token_logprobs(logits, ep.targets, 1.0)
    return loss_lib.grpo_loss(logp, ep.old_logp, adv, ep.train_mask)[0]

  g_RxT = np.abs(np.asarray(jax.grad(loss_of)(logits))).sum(-1)
  assert (g_RxT[ep.train_mask == 0] == 0).all()
  assert (g_RxT[ep.train_mask == 1] > 0).mean() > 0.95


@pytest.mark.slow
def test_rollout_logprobs_equal_training_forward_with_replay(moe_policy):
  cfg, model, variables = moe_policy
  rl = grpo_config.get_config("cpu").rl
  tasks = environments.make_tasks(ml_collections.ConfigDict(
      {"tasks": "addition,retrieval", "retrieval_pairs": 4, "addition_reversed": False}))
  problems = [environments.draw(tasks, 0, i, "train") for i in range(8)]
  b = Budget(max_prompt=40, max_new=6)
  ep = rollout(Sampler(cfg, record_routes=True), inference_variables(cfg, variables), problems,
               {t.name: t for t in tasks}, jax.random.key(2), b, temperature=rl.temperature,
               seq_len=48)
  inputs = {"tokens": ep.tokens, "segment_ids": ep.segment_ids}
  for replay_on in (True, False):
    v = dict(variables)
    if replay_on:
      v["replay"] = replay.replay_variables(cfg, ep.routes)
    (logits, _), inter = model.apply(v, inputs, mutable=["intermediates"])
    logp = loss_lib.token_logprobs(logits, ep.targets, rl.temperature)
    m = ep.train_mask == 1
    assert rel_err(np.asarray(logp)[m], ep.old_logp[m]) < 1e-4
    picked = moe_lib.sown_routes(cfg, inter["intermediates"], ep.tokens.shape)
    assert float(replay.mismatch(picked, ep.routes, ep.segment_ids)) < 0.01
  # The metric sees a difference: other routes differ everywhere they were changed.
  shifted = {k: (v + 1) % 8 for k, v in ep.routes.items()}
  assert float(replay.mismatch(shifted, ep.routes, ep.segment_ids)) == 1.0


@pytest.mark.slow
def test_a_rollout_in_pieces_is_the_whole_rollout(moe_policy):
  """Greedy: 5 problems 2 rows at a time (the last piece padded with a copy) give the same
  episodes as all 5 at once, routes dropped (the evaluations' path, trainer.pass_at_1)."""
  cfg, model, variables = moe_policy
  tasks = environments.make_tasks(ml_collections.ConfigDict(
      {"tasks": "addition,retrieval", "retrieval_pairs": 4, "addition_reversed": False}))
  problems = [environments.draw(tasks, 0, i, "eval") for i in range(5)]
  args = (Sampler(cfg, record_routes=True), inference_variables(cfg, variables), problems,
          {t.name: t for t in tasks}, jax.random.key(4), Budget(max_prompt=40, max_new=6))
  whole = rollout(*args, temperature=0.0, seq_len=48)
  pieces = rollout_in_pieces(*args, rows=2, temperature=0.0, seq_len=48)
  assert pieces.routes is None and whole.routes is not None
  assert pieces.completions == whole.completions and len(pieces.completions) == 5
  for f in ("tokens", "segment_ids", "targets", "train_mask", "generated", "tool_calls"):
    np.testing.assert_array_equal(getattr(pieces, f), getattr(whole, f), err_msg=f)
  np.testing.assert_allclose(pieces.old_logp, whole.old_logp, atol=1e-5)
  with pytest.raises(ValueError, match="rows=0"):
    rollout_in_pieces(*args, rows=0, temperature=0.0)


@pytest.mark.slow
def test_a_micro_batched_pass_makes_the_whole_batch_update(moe_policy):
  """rl.micro_batch = 4 on 8 rows (a scan over two halves) against the whole batch at once:
  the same update, loss and metrics (replay on, KL to a reference, sequence norm)."""
  cfg, model, variables = moe_policy
  c = grpo_config.get_config("cpu")
  tasks = environments.make_tasks(ml_collections.ConfigDict(
      {"tasks": "addition,retrieval", "retrieval_pairs": 4, "addition_reversed": False}))
  problems = [environments.draw(tasks, 0, i, "train") for i in range(8)]
  ep = rollout(Sampler(cfg, record_routes=True), inference_variables(cfg, variables), problems,
               {t.name: t for t in tasks}, jax.random.key(3), Budget(max_prompt=40, max_new=6),
               temperature=1.0, seq_len=48)
  batch = trainer.episode_batch(ep, np.linspace(-1.5, 1.5, 8).astype(np.float32))
  batch["ref_logp"] = ep.old_logp - 0.05 * ep.train_mask
  out = {}
  for rows in (0, 4):
    c.rl.update(micro_batch=rows, kl_coef=0.1, loss_norm="sequence", learning_rate=1e-3)
    stacked = jax.tree.map(jnp.copy, {k: trainer.layer_stack.stack(cfg, variables[k])
                                      for k in ("params", "router")})   # the pass donates
    state = trainer.PolicyState.create(
        apply_fn=model.apply, params=stacked["params"], router=stacked["router"], tx=trainer.policy_optimizer(
                ml_collections.FrozenConfigDict(c)), ref_params={})
    state = state.replace(step=jnp.zeros((), jnp.int32))
    out[rows] = trainer.make_pass(cfg, ml_collections.FrozenConfigDict(c.rl))(state, batch)
  (whole, m0), (micro, m4) = out[0], out[4]
  for k in ("loss", "clip_fraction", "kl", "kl_rollout", "ratio", "entropy", "route_mismatch",
            "grad_norm"):
    assert abs(float(m4[k]) - float(m0[k])) <= 1e-5 * max(abs(float(m0[k])), 1.0), k
  assert float(m0["kl"]) > 1e-4 and float(m0["grad_norm"]) > 0
  for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(micro.params)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6, rtol=1e-5)
  # The reference's log-probs, 4 rows at a time, equal all at once.
  ref = [trainer.make_ref_logprobs(cfg, 1.0, rows)(variables["params"], variables["router"],
                                                   batch) for rows in (0, 4)]
  assert ref[0].shape == ep.tokens.shape
  np.testing.assert_allclose(np.asarray(ref[1]), np.asarray(ref[0]), atol=1e-5, rtol=1e-5)
  m = ep.train_mask == 1   # and the fp32 reference is the rollout policy: its log-probs
  assert rel_err(np.asarray(ref[0])[m], ep.old_logp[m]) < 1e-4


def test_replay_runs_exactly_the_recorded_experts():
  c = make_small_config()
  c.model.dtype = "float32"
  c.model.moe.update(num_experts=8, top_k=2, num_shared=0)
  cfg = frozen_model_config(c)
  x = jax.random.normal(jax.random.key(0), (2, 5, cfg.d_model))
  layer = MoE(cfg)
  v = nn.meta.unbox(jax.jit(layer.init)(jax.random.key(1), x))
  forced = jax.random.randint(jax.random.key(2), (10, 2), 0, 8)
  forced = jnp.stack([forced[:, 0], (forced[:, 0] + 1 + forced[:, 1] % 7) % 8], 1)  # distinct
  y, stats = layer.apply({**v, "replay": {"topk": forced}}, x)
  p = v["params"]
  logits = x.reshape(10, -1) @ p["router_kernel"]
  w = router_lib.combine_weights(logits, forced, cfg.moe.score, cfg.moe.route_scale)
  want = moe_lib.dropless(x.reshape(10, -1), forced, w, p["gate_up"], p["down"])
  assert rel_err(y.reshape(10, -1), want) < 1e-6
  np.testing.assert_allclose(stats["load"], np.bincount(forced.reshape(-1), minlength=8) / 20)
  # The router still learns through the combine weights of the replayed experts.
  g = jax.grad(lambda p: layer.apply({**v, "params": p, "replay": {"topk": forced}}, x)[0].sum())(p)
  assert float(jnp.abs(g["router_kernel"]).sum()) > 0


# ---- rewards, tools, warm-up rows, config --------------------------------------------------

def test_rewards_and_tools():
  assert tools.calc("12*3-4") == 32
  for bad in ("__import__('os')", "2**8", "1/2", "x+1"):
    with pytest.raises(ValueError, match="calc"):
      tools.calc(bad)
  table = {"k17": "42"}
  assert tools.run_call('<call>lookup("k17")</call>', table) == "42"
  assert tools.run_call('<call>lookup("k18")</call>', table) == "none"
  assert tools.run_call('<call>lookup("k17")</call> <call>calc(2*21)</call>', table) == "42"
  assert tools.run_call("<call>rm(1)</call>", table) == "error"
  episode = '<call>lookup("k17")</call><result>42</result>\nA 42'
  terms = rewards.parse("exact_answer:1,tool_calls:-0.25,length:-0.01")
  own = len('<call>lookup("k17")</call>\nA 42')
  assert rewards.total(terms, "", episode, {"answer": "42"}) == pytest.approx(
      1 - 0.25 - 0.01 * own)
  assert rewards.exact_answer("", "1591", {"answer": "1591"}) == 1.0
  assert rewards.exact_answer("", "15910", {"answer": "1591"}) == 0.0
  with pytest.raises(ValueError, match="unknown reward 'speed'"):
    rewards.parse("exact_answer:1,speed:2")
  with pytest.raises(ValueError, match="weight of 'length'"):
    rewards.parse("length:x")
  t = tools.ToolTask()
  p = t.sample(np.random.default_rng(3))
  call = t.demonstration(p)[0][0]
  assert t.respond(p, call) == f"<result>{p.state['answer']}</result>\n"
  assert t.respond(p, "A 12") is None


def test_task_rows_train_only_on_answers_and_hold_out_eval_prompts():
  d = ml_collections.ConfigDict({"tasks": "addition,tools", "retrieval_pairs": 4,
                                "addition_reversed": False})
  rows = task_rows.TaskRows(d, 128, seed=0)
  ex = rows[5]
  assert rows[5]["tokens"].tolist() == ex["tokens"].tolist()   # deterministic
  text = tokenizer.decode(ex["targets"][ex["loss_mask"] > 0])
  assert "<result>" not in text and "Q " not in text and "+" not in text and "<call>" in text
  n_eos = int(((ex["targets"] == tokenizer.EOS) & (ex["loss_mask"] > 0)).sum())
  assert n_eos == ex["segment_ids"].max()                  # each demonstration's EOS trained
  tasks = environments.make_tasks(d)
  train = {environments.draw(tasks, 0, i, "train").prompt for i in range(400)}
  held = {environments.draw(tasks, 0, i, "eval").prompt for i in range(40)}
  assert not train & held and all(environments.held_out(p) for p in held)
  with pytest.raises(ValueError, match="data.seq_len=16"):
    task_rows.TaskRows(d, 16, seed=0)


def test_the_imperfect_teacher_is_wrong_only_on_odd_digit_prompts_at_its_rate():
  """data.demo_mistake_rate: on prompts ending in an odd digit, that share of demonstrations
  is the task's systematic mistake (a + b + 1, the value + 1, an answer without the call);
  other prompts and rate 0 always get the solution."""
  d = ml_collections.ConfigDict({"tasks": "addition,retrieval,tools", "retrieval_pairs": 8,
                                "addition_reversed": True, "demo_mistake_rate": 0.75})
  for task, plain in zip(environments.make_tasks(d), environments.make_tasks(
      ml_collections.ConfigDict({**d.to_dict(), "demo_mistake_rate": 0.0}))):
    probs = [task.sample(np.random.default_rng(i)) for i in range(800)]
    odd = [p for p in probs if mistake_class(p.prompt)]
    assert 0.4 < len(odd) / len(probs) < 0.6, task.name
    wrong = [p for p in odd if task.demonstration(p) != task.solution(p)]
    assert 0.68 < len(wrong) / len(odd) < 0.82, task.name
    assert all(task.demonstration(p) == task.solution(p) for p in probs
               if not mistake_class(p.prompt))
    assert all(plain.demonstration(p) == plain.solution(p) for p in probs)
    p = wrong[0]
    text = "".join(t for t, _ in task.demonstration(p))
    if task.name == "tools":   # answers without the call: right only by chance
      assert text == f"A {p.state['answer']}" and not task.right_call(p, text)
      right = "".join(t for t, _ in task.solution(p))
      assert right.startswith("<call>") and task.right_call(p, right)
    else:
      assert rewards.exact_answer("", text, p.state) == 0.0
      value = int(p.state["answer"][::-1] if task.name == "addition" else p.state["answer"])
      assert int(text[::-1] if task.name == "addition" else text) == value + 1
  with pytest.raises(ValueError, match="data.demo_mistake_rate"):
    environments.make_tasks(ml_collections.ConfigDict({**d.to_dict(), "demo_mistake_rate": 1.0}))


def test_pass_at_1_measures_what_the_imperfect_teacher_taught(monkeypatch):
  """With data.demo_mistake_rate > 0, greedy pass@1 also reports the mistake class's pass@1
  and the share of its episodes that are the teacher's mistake (a policy that writes the
  mistake there and the answer elsewhere: 0 and 1, and pass@1 the other prompts' share)."""
  d = ml_collections.ConfigDict({"tasks": "addition,tools", "retrieval_pairs": 4,
                                "addition_reversed": True, "demo_mistake_rate": 0.75})
  tasks = environments.make_tasks(d)
  problems = [environments.draw(tasks, 0, i, "eval") for i in range(60)]

  def as_taught(sampler, variables, probs, *args, **kw):
    texts = []
    for p in probs:
      s, odd = p.state, mistake_class(p.prompt)
      if s["task"] == "addition":
        texts.append(s["wrong"] if odd else s["answer"])
      else:
        texts.append("A 7" if odd else
                     f"<call>{s['call']}</call><result>{s['answer']}</result>\nA {s['answer']}")
    return types.SimpleNamespace(completions=texts, tool_calls=np.array(
        [int(t.startswith("<call>")) for t in texts]))

  monkeypatch.setattr(trainer.rollout_lib, "rollout_in_pieces", as_taught)
  out = trainer.pass_at_1(None, None, tasks, grpo_config.get_config("cpu").rl, None, 0,
                          problems)
  for t in ("addition", "tools"):
    mine = [p for p in problems if p.state["task"] == t]
    odd = np.mean([mistake_class(p.prompt) for p in mine])
    assert 0 < odd < 1
    assert out[f"pass@1/{t}"] == pytest.approx(1 - odd)
    assert (out[f"pass@1_mistake_class/{t}"], out[f"wrote_mistake/{t}"]) == (0.0, 1.0)
  tasks[0].mistake_rate = 0.0   # a correct teacher: no such metrics
  assert "wrote_mistake/addition" not in trainer.pass_at_1(
      None, None, tasks, grpo_config.get_config("cpu").rl, None, 0, problems)


@pytest.mark.parametrize("field,value,match", [
    ("group_size", 1, "rl.group_size"), ("loss_norm", "mean", "rl.loss_norm"),
    ("advantage_scale", "std", "rl.advantage_scale"), ("kl_coef", -0.1, "rl.kl_coef"),
    ("rewards", "exact:1", "unknown reward"), ("clip_low", 1.5, "rl.clip_low"),
    ("eval_samples", -1, "rl.eval_samples"), ("warmup_check_every", -1, "rl.warmup_check_every"),
    ("warmup_check_every", True, "rl.warmup_check_every"),
    ("warmup_max_pass1", 0.1, "rl.warmup_max_pass1"), ("micro_batch", 3, "rl.micro_batch"),
    ("micro_batch", -8, "rl.micro_batch")])
def test_bad_rl_config_is_rejected(field, value, match):
  c = grpo_config.get_config("cpu")
  c.rl.warmup_check_every = 0 if field == "warmup_check_every" else 5
  c.rl[field] = value
  with pytest.raises(ValueError, match=match):
    config_lib.validate(c)
  c = grpo_config.get_config("cpu")
  c.data.tasks = "addition,sudoku"
  with pytest.raises(ValueError, match="data.tasks"):
    config_lib.validate(c)


# ---- the loop: a run, its metrics, exact resume ------------------------------------------

def _tiny_grpo_config(tmp_path):
  c = grpo_config.get_config("cpu")
  small = make_small_config()
  c.model = small.model
  c.model.moe.update(num_experts=4, top_k=2)
  c.model.n_layers, c.model.layer_pattern = 3, "KA"
  c.data.update(seq_len=128, batch_size=4, tasks="addition,retrieval", retrieval_pairs=4)
  c.schedule.update(total_steps=4, warmup_steps=1)
  c.eval.update(every_steps=4, num_batches=1)
  c.checkpoint.every_steps = 1
  c.train.compile_cache_dir = ""
  c.rl.update(steps=3, prompts_per_step=2, group_size=4, max_prompt_tokens=40, max_new_tokens=5,
              eval_every=3, eval_prompts=4, eval_samples=2, kl_coef=0.1, passes=2,
              learning_rate=3e-3, micro_batch=4)
  return c


@pytest.mark.slow
def test_grpo_runs_and_resumes_exactly(tmp_path, monkeypatch):
  c = _tiny_grpo_config(tmp_path)
  warm = tmp_path / "warm"
  c.rl.init_workdir = str(warm)
  train_and_evaluate(c, str(warm), progress=False)   # the warm-up, as train_grpo would run it
  straight = train_grpo(c, str(tmp_path / "a"), progress=False)
  train_grpo(c, str(tmp_path / "b"), progress=False, stop_after=1)
  resumed = train_grpo(c, str(tmp_path / "b"), progress=False)
  # SIGTERM after the second GRPO step (both passes): checkpointed there, resumed exactly.
  signalled = lambda self, step, manager: step >= 2 * c.rl.passes
  monkeypatch.setattr(trainer.Preemption, "requested", signalled)
  stopped = train_grpo(c, str(tmp_path / "c"), progress=False)
  assert stopped["preempted"] == "grpo" and stopped["step"] == 2
  assert trainer.checkpoint.make_manager(str(tmp_path / "c" / "checkpoints"),
                                             c).all_steps() == [1 * c.rl.passes, 2 * c.rl.passes]
  monkeypatch.undo()
  after_sigterm = train_grpo(c, str(tmp_path / "c"), progress=False)
  for a, b, d in zip(jax.tree.leaves(straight["state"].params),
                     jax.tree.leaves(resumed["state"].params),
                     jax.tree.leaves(after_sigterm["state"].params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(d))
  assert int(straight["state"].step) == 3 * c.rl.passes
  m = straight["last_metrics"]
  for k in ("reward/mean", "accuracy", "kl", "clip_fraction", "response_tokens", "entropy",
            "route_mismatch/first_pass", "kl_rollout/first_pass", "tokens_per_sec",
            "accuracy/addition"):
    assert k in m and np.isfinite(m[k])
  assert m["route_mismatch/first_pass"] < 0.01 and m["kl"] >= 0
  # the first pass runs the rollout's params: fp32 inference and training paths agree
  assert 0 <= m["kl_rollout/first_pass"] < 1e-4
  assert 0 < m["entropy"] < np.log(c.model.vocab_size)
  assert set(straight["start"]) == {f"{p}/{t}" for p in ("pass@1", "pass@1_sampled")
                                    for t in ("addition", "retrieval", "mean")} | {"eval_s"}
  assert straight["start"]["eval_s"] > 0 and m["step_s"] >= m["rollout_s"] > 0
  assert all(0.0 <= v <= 1.0 for k, v in straight["final"].items() if k != "eval_s")
  assert straight["grpo_s"] > 0 and resumed["grpo_s"] > 0


@pytest.mark.slow   # 37 s on 2 cores: a warm-up trained to its stopping check
def test_warm_up_stops_at_the_first_check_where_every_task_passes(tmp_path, monkeypatch):
  """rl.warmup_check_every: the warm-up trains in spans and measures greedy pass@1 after
  each (on held-out problems other than pass@1's own), stops at the first check where every
  task reaches rl.warmup_min_pass1 (step 4 of 6 here: addition's pass@1 is forced to rise
  0.25 a check), keeps that checkpoint, and a second call resumes from its record: it
  neither trains nor measures again. Retrieval, above rl.warmup_max_pass1 at the first
  check, sits out the second span; at the second it is back in range (0.5)."""
  c = _tiny_grpo_config(tmp_path)
  c.data.source = "tasks"
  c.schedule.update(total_steps=6, warmup_steps=1)
  c.checkpoint.every_steps = 3   # the stopping check saves its step anyway
  c.rl.update(warmup_check_every=2, warmup_check_prompts=4, warmup_min_pass1=0.5,
              warmup_max_pass1=0.6)
  config_lib.validate(c)
  real, seen, spans = trainer.pass_at_1, [], []

  def rising(sampler, variables, tasks, rl, b, T, problems, samples=0):
    out = real(sampler, variables, tasks, rl, b, T, problems, samples)
    seen.append([p.prompt for p in problems])
    return {**out, "pass@1/addition": 0.25 * len(seen),
            "pass@1/retrieval": 0.75 if len(seen) == 1 else 0.5}

  def recorded(w, *args, **kw):
    spans.append(w.data.tasks)
    return real_train(w, *args, **kw)

  real_train, real_rebuild = trainer.train_and_evaluate, loop_lib.pipeline.train_dataset
  monkeypatch.setattr(trainer, "pass_at_1", rising)
  monkeypatch.setattr(trainer, "train_and_evaluate", recorded)
  rebuilt = []   # the train pipeline of each span after the first, from its config
  monkeypatch.setattr(loop_lib.pipeline, "train_dataset",
                      lambda src, c, *a: rebuilt.append(c.data.tasks) or real_rebuild(src, c, *a))
  w = str(tmp_path / "warmup")
  log = trainer.warm_up(c, w, progress=False)
  assert [ch["step"] for ch in log["checks"]] == [2, 4] and log["stopped_at"] == 4
  # One training run; its pipeline rebuilt once, for the second span's tasks.
  assert spans == ["addition,retrieval"] and rebuilt == ["addition,retrieval", "addition"]
  assert [ch["trained"] for ch in log["checks"]] == rebuilt
  assert all(0 <= ch["pass@1/mean"] <= 1 and ch["check_s"] > 0 for ch in log["checks"])
  assert workdir_lib.load(w)[2] == 4   # saved at the stopping check (not an interval step)
  tasks = environments.make_tasks(c.data)
  pass1_set = [p.prompt for p in trainer.held_out(tasks, c.rl, 64)]
  assert len(seen[0]) == 4 and not set(seen[0]) & set(pass1_set) and seen[0] == seen[1]
  assert trainer.warm_up(c, w, progress=False) == log and len(seen) == 2
  # Every task above the ceiling: the lowest trains (the others fall back) to the schedule's
  # end, where the warm-up stops in any case.
  monkeypatch.setattr(trainer, "pass_at_1", lambda *a, **k: {
      **real(*a, **k), "pass@1/addition": 0.9, "pass@1/retrieval": 0.8})
  over = trainer.warm_up(c, str(tmp_path / "over"), progress=False)
  assert [ch["step"] for ch in over["checks"]] == [2, 4, 6] and over["stopped_at"] == 6
  assert [ch["trained"] for ch in over["checks"]] == ["addition,retrieval"] + ["retrieval"] * 2


@pytest.mark.slow   # 30 s on 2 cores: a warm-up killed inside a check, then resumed
def test_a_resumed_warm_up_measures_the_checks_after_its_checkpoint_again(tmp_path,
                                                                          monkeypatch):
  """A check does not checkpoint its step, so a warm-up that dies after logging the check at
  step 4 resumes from the checkpoint at 3: it forgets that check, trains step 4 on the tasks
  chosen at step 2 and measures step 4 again. Killed inside the check at 6 (checks at 2
  and 4 logged, the save at 6 not reached), the second call's checks are [2, 4, 6] with 4
  and 6 measured again, and its stop at 6 is saved."""
  c = _tiny_grpo_config(tmp_path)
  c.data.source = "tasks"
  c.schedule.update(total_steps=6, warmup_steps=1)
  c.checkpoint.every_steps = 3
  c.rl.update(warmup_check_every=2, warmup_check_prompts=4, warmup_min_pass1=0.5,
              warmup_max_pass1=0.6)
  real, measured = trainer.pass_at_1, []

  def dies_at_six(sampler, variables, tasks, rl, b, T, problems, samples=0):
    measured.append(at_step[0])
    if len(measured) == 3:
      raise RuntimeError("killed inside the check at step 6")
    return {**real(sampler, variables, tasks, rl, b, T, problems, samples),
            "pass@1/addition": 0.1, "pass@1/retrieval": 0.9}

  at_step, real_next = [0], loop_lib._next_data

  def noting(c_, between, step, state, it):   # the step the check is at
    at_step[0] = step
    return real_next(c_, between, step, state, it)

  monkeypatch.setattr(loop_lib, "_next_data", noting)
  monkeypatch.setattr(trainer, "pass_at_1", dies_at_six)
  w = str(tmp_path / "warmup")
  with pytest.raises(RuntimeError, match="killed inside"):
    trainer.warm_up(c, w, progress=False)
  with open(os.path.join(w, "warmup_checks.json")) as f:
    logged = json.load(f)
  assert [ch["step"] for ch in logged["checks"]] == [2, 4] and logged["stopped_at"] is None
  assert workdir_lib.load(w)[2] == 3
  log = trainer.warm_up(c, w, progress=False)
  assert measured == [2, 4, 6, 4, 6]
  assert [ch["step"] for ch in log["checks"]] == [2, 4, 6] and log["stopped_at"] == 6
  assert [ch["trained"] for ch in log["checks"]] == ["addition,retrieval"] + ["addition"] * 2
  assert workdir_lib.load(w)[2] == 6


@pytest.mark.slow   # 25 s on 2 cores: three short training runs
def test_between_switches_the_data_in_place_as_a_restart_would(tmp_path):
  """train_and_evaluate's `between` curriculum (the warm-up's checks): a switch of data.tasks
  at step 2 and a stop at step 4, in one run, make the same model as stopping at 2 and
  resuming on the new tasks (the pipeline rebuilt at the same position), and checkpoint the
  stopping step only."""
  c = _tiny_grpo_config(tmp_path)
  c.data.source = "tasks"
  c.schedule.update(total_steps=6, warmup_steps=1)
  c.checkpoint.every_steps = 10
  calls = []

  def between(step, state):
    calls.append((step, int(state.step)))
    if step >= 4:
      return None
    d = ml_collections.ConfigDict(c.data.to_dict())
    d.tasks = "addition,retrieval" if step < 2 else "addition"
    return d

  one = train_and_evaluate(c, str(tmp_path / "one"), progress=False, between=(2, between))
  assert calls == [(0, 0), (2, 2), (4, 4)] and int(one["state"].step) == 4
  # The stop is saved; a check that goes on is not (a resume measures it again).
  assert sorted(p.name for p in (tmp_path / "one" / "checkpoints").iterdir()) == ["4"]
  train_and_evaluate(c, str(tmp_path / "two"), progress=False, stop_after=2)
  c.data.tasks = "addition"
  two = train_and_evaluate(c, str(tmp_path / "two"), progress=False, stop_after=4)
  assert two["resumed_from"] == 2
  for a, b in zip(jax.tree.leaves(one["state"].params), jax.tree.leaves(two["state"].params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
  c.data.tasks = "addition,retrieval"   # then retrieval from step 2: the check can fail
  train_and_evaluate(c, str(tmp_path / "three"), progress=False, stop_after=2)
  c.data.tasks = "retrieval"
  three = train_and_evaluate(c, str(tmp_path / "three"), progress=False, stop_after=4)
  assert max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(
      jax.tree.leaves(one["state"].params), jax.tree.leaves(three["state"].params))) > 1e-4


def test_grpo_record_rows_from_a_workdir(tmp_path):
  """benchmarks/grpo_gpu.py: a finished run gives one row per task with its held-out count
  (the tasks taken in turn), pass@1 before and after, and the mean first-pass gaps; the
  h200 config validates, holds out ≥ 256 problems per task and trains the tool task."""
  from benchmarks import grpo_gpu
  from configs import grpo as grpo_config
  from moe_jax import config as config_lib
  c = grpo_config.get_config("h200")
  config_lib.validate(c)
  w = tmp_path / "run"
  w.mkdir()
  (w / "config.json").write_text(c.to_json())
  tasks = ("addition", "retrieval", "tools")
  start = {f"pass@1/{t}": 0.3 for t in tasks} | {f"pass@1_sampled/{t}": 0.2 for t in tasks}
  final = {f"pass@1/{t}": 0.5 + 0.1 * i for i, t in enumerate(tasks)} | {
      f"pass@1_sampled/{t}": 0.4 for t in tasks}
  start["right_call/tools"], final["right_call/tools"] = 0.25, 0.75
  (w / "summary.json").write_text(json.dumps({"start": start, "final": final, "step": 150}))
  (w / "metrics_grpo.jsonl").write_text("\n".join(json.dumps(
      {"step": s, "route_mismatch/first_pass": 0.01 * s, "kl_rollout/first_pass": 1e-3,
       "clip_fraction": 0.1}) for s in (1, 2, 3)) + "\n")
  rows = grpo_gpu.rows_of(str(w), {"date": "d", "commit": "c", "machine": "m"})
  assert [r["task"] for r in rows] == list(tasks)
  assert [r["n_heldout"] for r in rows] == [256, 256, 256]
  r = rows[2]
  assert (r["seed"], r["replay"], r["greedy_pass1_before"]) == (0, True, 0.3)
  assert r["greedy_pass1_after"] == pytest.approx(0.7) and r["sampled_pass1_after"] == 0.4
  assert r["route_mismatch"] == pytest.approx(0.02) and r["kl_rollout"] == pytest.approx(1e-3)
  assert (r["greedy_right_call_before"], r["greedy_right_call_after"]) == (0.25, 0.75)
  assert rows[0]["greedy_right_call_before"] is None
  assert ("| tools | 0 | on | 256 | 0.300 → 0.700 (+0.400) | 0.200 → 0.400 | 0.250 → 0.750 | — "
          "| — |" in grpo_gpu.markdown(rows))
  assert c.data.demo_mistake_rate > 0   # GRPO has something to learn
  out = tmp_path / "out"   # the command line, as a device call runs it
  run = subprocess.run([sys.executable, "-m", "benchmarks.grpo_gpu", f"--workdirs={w}",
                        f"--out={out}", "--machine=NVIDIA H200"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env=subprocess_env())
  assert run.returncode == 0, run.stderr[-2000:]
  saved = json.load(open(out / "grpo_gpu.json"))
  assert len(saved) == 3 and saved[0]["machine"] == "NVIDIA H200"
  (w / "summary.json").write_text(json.dumps({"start": start, "step": 3}))
  with pytest.raises(ValueError, match="has not finished"):
    grpo_gpu.rows_of(str(w), {})
