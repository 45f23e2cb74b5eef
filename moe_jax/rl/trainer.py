"""The GRPO loop: warm-up (or a given checkpoint) → per step: G rollouts per prompt,
rewards, group-relative advantages, `rl.passes` clipped-surrogate updates → metrics,
held-out pass@1, checkpoints.

  summary = train_grpo(config, workdir)       # resumes from <workdir>/checkpoints

The policy trains in the training layout (scanned layers where the config scans) with
dropless MoE dispatch, as the rollouts run: a capacity path would drop tokens the rollout
kept, and the importance ratio would compare two different networks. The balancer biases
stay as the starting checkpoint left them: a bias update between rollout and training pass
would move routing too. Runs on one device.
"""

import functools
import json
import os
import time
from typing import Any

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import struct
from tqdm import tqdm

from moe_jax import config as config_lib
from moe_jax.fields import is_moe
from moe_jax.infer import workdir as workdir_lib
from moe_jax.infer.generate import inference_variables
from moe_jax.model import layer_stack, moe as moe_lib
from moe_jax.model.transformer import HybridMoE
from moe_jax.rl import advantages, environments, replay, rewards
from moe_jax.rl import loss as loss_lib
from moe_jax.rl import rollout as rollout_lib
from moe_jax.rl.rollout import Budget, Episodes, rollout
from moe_jax.rl.tasks import mistake_class
from moe_jax.train import checkpoint, metrics, optim
from moe_jax.train.loop import train_and_evaluate
from moe_jax.train.preemption import Preemption
from moe_jax.train.state import TrainState


class PolicyState(TrainState):
  """The policy's train state plus the frozen reference params ({} when rl.kl_coef = 0)."""
  ref_params: Any = struct.field(default_factory=dict)


def policy_model_config(model_cfg) -> ml_collections.FrozenConfigDict:
  """The model config as GRPO trains it: dropless MoE, as the rollouts run."""
  m = ml_collections.ConfigDict(model_cfg.to_dict())
  if is_moe(m):
    m.moe.dispatch = "dropless"
  return ml_collections.FrozenConfigDict(m)


@functools.lru_cache(maxsize=8)
def policy_optimizer(c: ml_collections.FrozenConfigDict) -> optax.GradientTransformation:
  """optim.make_optimizer with rl.learning_rate, warmed up over rl.lr_warmup_steps updates,
  then constant (clipping, AdamW and the non-finite skip as in pretraining). Cached: the
  train state holds it as a static field, so the same object lets a jitted pass be reused."""
  g = ml_collections.ConfigDict(c.to_dict())
  g.optim.learning_rate = c.rl.learning_rate
  g.schedule.update(kind="cosine", warmup_steps=c.rl.lr_warmup_steps,
                    total_steps=c.rl.lr_warmup_steps + c.rl.steps * c.rl.passes + 1,
                    final_lr_fraction=1.0)
  return optim.make_optimizer(g)


def budget(rl) -> Budget:
  return Budget(rl.max_prompt_tokens, rl.max_new_tokens, rl.max_turns, rl.max_tool_tokens)


def training_length(model_cfg, b: Budget) -> int:
  """The training pass's length: the rollout budget rounded up to whole KDA chunks."""
  chunk = model_cfg.kda_chunk_size
  return -(-b.length // chunk) * chunk


@functools.lru_cache(maxsize=8)
def policy_model(model_cfg) -> HybridMoE:
  """One model object per config: the train state holds its apply as a static field."""
  return HybridMoE(model_cfg)


@functools.lru_cache(maxsize=8)
def make_pass(model_cfg, rl):
  """One optimisation pass over a rollout batch, jitted: (state, batch) → (state, metrics).
  With rl.micro_batch = m > 0 the batch's rows go through the forward and backward m at a
  time (a scan that sums gradients), then one update: the same update as the whole batch at
  once (the losses divide by the whole batch's denominators), with activation memory of m
  rows. Cached per (frozen) model and rl config, so a process compiles it once."""
  model = policy_model(model_cfg)

  def loss_fn(params, router, batch, denom, n_micro):
    inputs = {"tokens": batch["tokens"], "segment_ids": batch["segment_ids"]}
    variables = {"params": params, "router": router}
    if rl.routing_replay and "routes" in batch:
      variables["replay"] = replay.replay_variables(model_cfg, batch["routes"])
    (logits, aux), inter = model.apply(variables, inputs, mutable=["intermediates"])
    logp, ent = loss_lib.token_logprobs_and_entropy(logits, batch["targets"], rl.temperature)
    loss, m = loss_lib.grpo_loss(
        logp, batch["old_logp"], batch["advantages"], batch["train_mask"],
        ref_logp_BxT=batch.get("ref_logp"), clip_low=rl.clip_low, clip_high=rl.clip_high,
        kl_coef=rl.kl_coef, norm=rl.loss_norm,
        max_tokens=rl.max_turns * rl.max_new_tokens, denom=denom)
    m["entropy"] = (ent * batch["train_mask"].astype(jnp.float32)).sum() / denom["tokens"]
    # The routers' auxiliary penalty is a per-batch mean: each micro-batch adds its share.
    penalty = sum((s["penalty"] for s in aux["routing"].values()), jnp.float32(0.0)) / n_micro
    return loss + penalty, (m, inter.get("intermediates", {}))

  def one_pass(state, batch):
    R = batch["tokens"].shape[0]
    rows = rl.get("micro_batch", 0) or R
    if R % rows:
      raise ValueError(f"rl.micro_batch={rows} must divide the rollout batch of {R} rows")
    n_micro = R // rows
    denom = loss_lib.denominators(batch["train_mask"])
    live = (batch["segment_ids"] != 0).sum().astype(jnp.float32)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def micro(grads_acc, mb):
      (total, (m, inter)), grads = grad_fn(state.params, state.router, mb, denom, n_micro)
      m["loss"] = total
      if "routes" in mb:   # each micro-batch's fraction, weighted by its share of tokens
        picked = moe_lib.sown_routes(model_cfg, inter, mb["tokens"].shape)
        share = (mb["segment_ids"] != 0).sum() / jnp.maximum(live, 1.0)
        m["route_mismatch"] = replay.mismatch(picked, mb["routes"], mb["segment_ids"]) * share
      return jax.tree.map(jnp.add, grads_acc, grads), m

    split = jax.tree.map(lambda x: x.reshape(n_micro, rows, *x.shape[1:]), batch)
    zeros = jax.tree.map(jnp.zeros_like, state.params)
    grads, m = jax.lax.scan(micro, zeros, split)
    m = jax.tree.map(lambda x: x.sum(0), m)   # shares of the whole batch's means
    new_state = state.apply_gradients(grads=grads)
    m.update(grad_norm=optax.tree.norm(grads),
             skipped_updates=optim.skipped_updates(new_state.opt_state))
    return new_state, m

  return jax.jit(one_pass, donate_argnums=0)


@functools.lru_cache(maxsize=8)
def make_ref_logprobs(model_cfg, temperature, rows: int = 0):
  """The frozen reference's log-probs of the batch's targets (its own routing), `rows`
  rows at a time (0 = all at once), as the pass's micro-batches go."""
  model = policy_model(model_cfg)

  def one(ref_params, router, mb):
    logits, _ = model.apply({"params": ref_params, "router": router},
                            {"tokens": mb["tokens"], "segment_ids": mb["segment_ids"]})
    return loss_lib.token_logprobs(logits, mb["targets"], temperature)

  def ref_logp(ref_params, router, batch):
    keys = ("tokens", "segment_ids", "targets")
    R = batch["tokens"].shape[0]
    n = R // (rows or R)
    split = {k: batch[k].reshape(n, R // n, *batch[k].shape[1:]) for k in keys}
    logp = jax.lax.map(lambda mb: one(ref_params, router, mb), split)
    return jax.lax.stop_gradient(logp.reshape(R, -1))
  return jax.jit(ref_logp)


def episode_batch(ep: Episodes, adv_R) -> dict:
  batch = {"tokens": ep.tokens, "segment_ids": ep.segment_ids, "targets": ep.targets,
           "train_mask": ep.train_mask, "old_logp": ep.old_logp, "advantages": adv_R}
  if ep.routes is not None:
    batch["routes"] = ep.routes
  return batch


def rollout_rows(rl) -> int:
  """Episodes per GRPO rollout: prompts × group size."""
  return rl.prompts_per_step * rl.group_size


def rollout_sampler(model_cfg, rl) -> rollout_lib.Sampler:
  """The one sampler of a run (policy model config): rollouts record routes where the model
  has MoE layers and rl.record_routes; evaluations and the warm-up's checks share it."""
  return rollout_lib.sampler(model_cfg, bool(is_moe(model_cfg) and rl.record_routes))


def held_out(tasks, rl, n: int, offset: int = 1) -> list:
  """n problems of the eval split, the same every time for a given offset: offset 1 is
  pass@1's held-out set, offset 3 the warm-up checks' (other draws from the same split)."""
  return [environments.draw(tasks, rl.seed + offset, i, "eval") for i in range(n)]


def pass_at_1(sampler, variables, tasks, rl, b: Budget, seq_len: int, problems,
              samples: int = 0) -> dict:
  """pass@1 per task on `problems` (held out): greedy ("pass@1/<task>") and, with
  samples = n > 0, sampled at rl.temperature ("pass@1_sampled/<task>": the mean correctness
  of n samples per problem, the unbiased pass@1 estimator of Chen et al. 2021; the quantity
  GRPO's reward optimises). For a tool task, greedy also gives "tool_use/<task>" (episodes
  with a call) and "right_call/<task>" (episodes that made the call the problem needs).
  Warmed up by an imperfect teacher (data.demo_mistake_rate), greedy also gives, on the
  problems the teacher gets wrong at that rate (rl/tasks.py:mistake_class),
  "pass@1_mistake_class/<task>" and "wrote_mistake/<task>" (episodes that are the teacher's
  mistake): what GRPO has to unlearn.
  `variables` in the inference layout. The episodes go rollout_rows(rl) at a time, the GRPO
  step's rollout shape: with the training rollouts' sampler, nothing compiles again."""
  by_name = {t.name: t for t in tasks}
  out = {}
  runs = [("pass@1", problems, 0.0)]
  if samples:
    runs.append(("pass@1_sampled", [p for p in problems for _ in range(samples)],
                 rl.temperature))
  for prefix, probs, temperature in runs:
    ep = rollout_lib.rollout_in_pieces(sampler, variables, probs, by_name,
                                       jax.random.key(rl.seed + 2), b, rows=rollout_rows(rl),
                                       temperature=temperature, seq_len=seq_len)
    for t in tasks:
      rows = [r for r, p in enumerate(probs) if p.state["task"] == t.name]
      hits = [rewards.exact_answer(probs[r].prompt, ep.completions[r], probs[r].state)
              for r in rows]
      out[f"{prefix}/{t.name}"] = float(np.mean(hits)) if hits else float("nan")
      if prefix == "pass@1" and hasattr(t, "right_call") and rows:
        out[f"tool_use/{t.name}"] = float(np.mean(ep.tool_calls[rows] > 0))
        out[f"right_call/{t.name}"] = float(np.mean(
            [t.right_call(probs[r], ep.completions[r]) for r in rows]))
      odd = ([i for i, r in enumerate(rows) if mistake_class(probs[r].prompt)]
             if prefix == "pass@1" and t.mistake_rate > 0 else [])
      if odd:
        out[f"pass@1_mistake_class/{t.name}"] = float(np.mean([hits[i] for i in odd]))
        out[f"wrote_mistake/{t.name}"] = float(np.mean(
            [t.wrote_mistake(probs[rows[i]], ep.completions[rows[i]]) for i in odd]))
    out[f"{prefix}/mean"] = float(np.nanmean([out[f"{prefix}/{t.name}"] for t in tasks]))
  return out


def warm_up(w: ml_collections.ConfigDict, init_dir: str, progress: bool) -> dict:
  """The supervised warm-up on data.tasks in init_dir (resumed where it stopped). With
  rl.warmup_check_every = n > 0, every n steps (and at the last) it measures greedy pass@1
  on rl.warmup_check_prompts held-out problems (other draws than pass@1's) from the
  training state; it stops at the first check where every task is within
  [rl.warmup_min_pass1, rl.warmup_max_pass1], or at schedule.total_steps. So GRPO starts
  part-way up the learning curves, whatever the machine's speed of learning, without a run
  to tune the warm-up's length first.

  Tasks learn at different speeds (a lookup is found abruptly; carries come slowly), so a
  task above rl.warmup_max_pass1 at a check sits out the next span: the others catch up
  without it climbing out of GRPO's reach. It rejoins once it is back at or below (a task
  left out forgets, fast at a high learning rate: retrieval fell 0.75 -> 0.03 in a 25-step
  span, benchmarks/grpo.md, so spans are a few steps). Where every task is above, the
  lowest trains and the others fall back.

  One training run: the checks are its `between` curriculum (train/loop.py), so the step
  compiles once and a span costs its steps and its check. A check does not checkpoint; a
  resume forgets the checks after the restored step and measures them again.
  Returns {"checks": [...], "stopped_at": step}, each check with the `trained` tasks of
  its span (also in init_dir/warmup_checks.json; {} without checks), and "preempted": step
  where SIGTERM stopped it (checkpointed; run again to resume)."""
  rl, total = w.rl, w.schedule.total_steps
  every = rl.get("warmup_check_every", 0)
  if not every:
    out = train_and_evaluate(w, init_dir, progress=progress)
    return {} if out.get("preempted") is None else {"preempted": out["preempted"]}
  path = os.path.join(init_dir, "warmup_checks.json")
  log = {"checks": [], "stopped_at": None}
  if os.path.exists(path):
    with open(path) as f:
      log = json.load(f)
  if log["stopped_at"] is not None:
    return log
  tasks = environments.make_tasks(w.data)
  problems = held_out(tasks, rl, rl.warmup_check_prompts, offset=3)
  ceiling = rl.get("warmup_max_pass1", 1.0)
  model_cfg, b = policy_model_config(w.model), budget(rl)
  sampler = rollout_sampler(model_cfg, rl)

  def next_data():   # the tasks at or below the ceiling at the last check (all at first)
    last = log["checks"][-1] if log["checks"] else {}
    passes = {t.name: last.get(f"pass@1/{t.name}", 0.0) for t in tasks}
    chosen = [n for n, p in passes.items() if p <= ceiling] or [min(passes, key=passes.get)]
    d = ml_collections.ConfigDict(w.data.to_dict())
    d.tasks = ",".join(chosen)
    return d

  def write_log():
    if jax.process_index() == 0:
      with open(path, "w") as f:
        json.dump(log, f, indent=2)

  def final(ch):   # every task in range, or the schedule's end
    return ch["step"] >= total or all(
        rl.warmup_min_pass1 <= ch[f"pass@1/{t.name}"] <= ceiling for t in tasks)

  first_call = True

  def check(step, state):
    nonlocal first_call
    if first_call:   # the step trained from: checks after it are measured again
      first_call = False
      log["checks"] = [ch for ch in log["checks"] if ch["step"] <= step]
    checked = log["checks"][-1]["step"] if log["checks"] else 0
    if step > checked and (step % every == 0 or step == total):
      t0 = time.perf_counter()
      # One device, no mesh: the programs GRPO's rollouts run, compiled once in a process.
      with jax.set_mesh(None):
        variables = jax.device_put({"params": state.params, "router": state.router},
                                   jax.devices()[0])
        result = pass_at_1(sampler, inference_variables(model_cfg, variables), tasks, rl, b,
                           training_length(model_cfg, b), problems)
      log["checks"].append({"step": step, "trained": next_data().tasks, **result,
                            "check_s": time.perf_counter() - t0})   # compiles included
      print("moe_jax grpo warm-up: step " + str(step) + ", greedy " + ", ".join(
          f"{t.name} {result[f'pass@1/{t.name}']:.3f}" for t in tasks), flush=True)
      write_log()
    if log["checks"] and log["checks"][-1]["step"] == step and final(log["checks"][-1]):
      log["stopped_at"] = step   # written once the loop has saved this step
      return None
    return next_data()

  w = ml_collections.ConfigDict(w.to_dict())
  w.data = next_data()
  out = train_and_evaluate(w, init_dir, progress=progress, between=(every, check))
  if out.get("preempted") is not None:   # checkpointed; the next call resumes the span
    return {**log, "preempted": out["preempted"]}
  write_log()
  return log


def start_from(c, workdir: str, progress: bool):
  """(model config, per-layer variables, warm-up checks) of the policy's starting point:
  rl.init_workdir's latest checkpoint, or the supervised warm-up on data.tasks, run (or
  resumed) in <workdir>/warmup (`warm_up`); None where SIGTERM stopped the warm-up."""
  init_dir, checks = c.rl.init_workdir, {}
  if not init_dir:
    init_dir = os.path.join(workdir, "warmup")
    w = ml_collections.ConfigDict(c.to_dict())
    w.data.source = "tasks"
    checks = warm_up(w, init_dir, progress)
    if checks.get("preempted") is not None:
      return None
  init_cfg, variables, _ = workdir_lib.load(init_dir)
  return init_cfg.model, variables, checks


def train_grpo(c: ml_collections.ConfigDict, workdir: str, *, progress: bool = True,
               stop_after: int | None = None) -> dict:
  """GRPO to rl.steps (resuming from <workdir>/checkpoints); `stop_after` ends this call early
  at that step, checkpointed. Returns the summary (pass@1 before and after, last metrics).
  After SIGTERM (a job's time limit, a preempted machine) it checkpoints at the next step
  boundary, warm-up or GRPO, and returns {"preempted": "warm-up" | "grpo", ...}; the next
  call resumes there."""
  config_lib.validate(c)
  rl = c.rl
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(c.to_json_best_effort(indent=2))
  t_warm = time.perf_counter()
  start = start_from(c, workdir, progress)
  if start is None:
    return {"preempted": "warm-up"}
  model_cfg_init, variables, checks = start
  t_warm = time.perf_counter() - t_warm
  model_cfg = policy_model_config(model_cfg_init)
  model = policy_model(model_cfg)
  tasks = environments.make_tasks(c.data)
  by_name = {t.name: t for t in tasks}
  terms = rewards.parse(rl.rewards)
  b = budget(rl)
  T = training_length(model_cfg, b)

  params = layer_stack.stack(model_cfg, variables["params"])
  router = layer_stack.stack(model_cfg, variables["router"])
  state = PolicyState.create(apply_fn=model.apply, params=params, router=router,
                             tx=policy_optimizer(ml_collections.FrozenConfigDict(c)),
                             ref_params=jax.tree.map(jnp.copy, params) if rl.kl_coef else {})
  # Laid out as the pass returns it (int32 step, every leaf committed to the device), so the
  # second pass reuses the first one's compile.
  state = jax.device_put(state.replace(step=jnp.zeros((), jnp.int32)), jax.devices()[0])
  prompts = iter(grain.MapDataset.range(2**31 - 1).batch(rl.prompts_per_step))
  manager = checkpoint.make_manager(os.path.abspath(os.path.join(workdir, "checkpoints")), c)
  state, resumed = checkpoint.restore_latest(manager, state, prompts, model_cfg)
  one_pass = make_pass(model_cfg, ml_collections.FrozenConfigDict(rl))
  ref_logp = (make_ref_logprobs(model_cfg, rl.temperature, rl.get("micro_batch", 0))
              if rl.kl_coef else None)
  sampler = rollout_sampler(model_cfg, rl)
  train_log = metrics.MetricWriter(workdir, "grpo")
  eval_log = metrics.MetricWriter(workdir, "grpo_eval")
  step = int(state.step) // rl.passes
  end = rl.steps if stop_after is None else min(stop_after, rl.steps)
  eval_problems = held_out(tasks, rl, rl.eval_prompts)
  def evaluate():   # held-out pass@1, and its wall time (compiles included)
    t0 = time.perf_counter()
    out = pass_at_1(sampler, inference_variables(model_cfg, {"params": state.params,
                                                                  "router": state.router}),
                    tasks, rl, b, T, eval_problems, rl.eval_samples)
    return {**out, "eval_s": time.perf_counter() - t0}
  summary_path = os.path.join(workdir, "summary.json")
  summary = {}
  if os.path.exists(summary_path):
    with open(summary_path) as f:
      summary = json.load(f)
  if resumed is None or "start" not in summary:
    # warmup_s: the warm-up's wall time in this call (compiles included; ~0 where it ran
    # before, or with rl.init_workdir).
    summary = {"start": evaluate(), "warmup_s": t_warm, "grpo_s": 0.0}
    if checks:
      summary["warmup_checks"] = checks
    eval_log.write(0, summary["start"])
    with open(summary_path, "w") as f:
      json.dump(summary, f, indent=2)
  print(f"moe_jax grpo: " + (f"resumed at step {step}" if resumed is not None else
                             "from step 0") + f"; start pass@1 {summary['start']}", flush=True)
  bar = tqdm(total=rl.steps, initial=step, disable=not progress, unit="step", dynamic_ncols=True)
  last, preempted = {}, None
  t_loop = time.perf_counter()
  try:
    with Preemption() as preemption:
      while step < end:
        if preemption.requested(int(state.step), manager):
          checkpoint.save(manager, int(state.step), state, prompts)
          bar.write(f"moe_jax grpo: preempted (SIGTERM); saved step {step}, run again to resume")
          preempted = "grpo"
          break
        t0 = time.perf_counter()
        idx = next(prompts)
        problems = [environments.draw(tasks, rl.seed, int(i), "train") for i in idx]
        group = [p for p in problems for _ in range(rl.group_size)]
        variables = inference_variables(model_cfg, {"params": state.params,
                                                    "router": state.router})
        ep = rollout(sampler, variables, group, by_name,
                     jax.random.fold_in(jax.random.key(rl.seed), step), b,
                     temperature=rl.temperature, seq_len=T)
        t_roll = time.perf_counter() - t0
        reward_R = np.array([rewards.total(terms, p.prompt, s, p.state)
                             for p, s in zip(group, ep.completions)], np.float32)
        correct_R = np.array([rewards.exact_answer(p.prompt, s, p.state)
                              for p, s in zip(group, ep.completions)], np.float32)
        batch = episode_batch(ep, advantages.group_advantages(reward_R, rl.group_size,
                                                              rl.advantage_scale))
        if ref_logp is not None:
          batch["ref_logp"] = ref_logp(state.ref_params, state.router, batch)
        passes = []
        for _ in range(rl.passes):
          state, m = one_pass(state, batch)
          passes.append(m)
        passes = jax.device_get(passes)
        step += 1
        dt = time.perf_counter() - t0
        # The rollout/training gaps, on the first pass (the rollout's params) and the last.
        gaps = ("route_mismatch", "kl_rollout")
        m = {k: v for k, v in passes[-1].items() if k not in gaps}
        for k in gaps:
          if k in passes[0]:
            m[f"{k}/first_pass"], m[f"{k}/last_pass"] = passes[0][k], passes[-1][k]
        m.update({"reward/mean": reward_R.mean(), "reward/std": reward_R.std(),
                  "accuracy": correct_R.mean(), "response_tokens": ep.generated.mean(),
                  "tool_calls": ep.tool_calls.mean(), "rollout_s": t_roll, "step_s": dt,
                  "tokens_per_sec": float(ep.segment_ids.sum()) / dt})
        for t in tasks:   # a task with no prompt in this step has no entry (JSON has no NaN)
          rows = [i for i, p in enumerate(group) if p.state["task"] == t.name]
          if rows:
            m[f"accuracy/{t.name}"] = correct_R[rows].mean()
        train_log.write(step, m)
        last = {k: float(v) for k, v in m.items()}
        bar.update(1)
        bar.set_postfix({"reward": f"{m['reward/mean']:.3f}", "acc": f"{m['accuracy']:.3f}",
                         "clip": f"{m['clip_fraction']:.3f}"})
        if step % rl.eval_every == 0 or step == rl.steps:
          ev = evaluate()
          eval_log.write(step, ev)
          summary["final" if step == rl.steps else "latest"] = ev
          bar.write(f"grpo step {step}: " + ", ".join(f"{k}={v:.3f}" for k, v in ev.items()))
        if step % c.checkpoint.every_steps == 0 or step == end:
          checkpoint.save(manager, int(state.step), state, prompts)
      checkpoint.finish(manager)
  finally:
    bar.close()
    manager.close()
    train_log.close()
    eval_log.close()
  # grpo_s: wall time of the GRPO steps and evals (this call's plus earlier calls').
  summary.update(step=step, last_metrics=last or summary.get("last_metrics", {}),
                 grpo_s=summary.get("grpo_s", 0.0) + time.perf_counter() - t_loop)
  with open(summary_path, "w") as f:
    json.dump(summary, f, indent=2)
  return {**summary, "state": state, **({"preempted": preempted} if preempted else {})}
