"""train_and_evaluate: config → data → model → jitted steps → eval / metrics / checkpoints."""

import concurrent.futures
import contextlib
import json
import os
import time

import jax
import ml_collections
import numpy as np
from absl import logging
from tqdm import tqdm

from moe_jax import config as config_lib
from moe_jax.data import pipeline, tokenizers
from moe_jax.fields import is_moe
from moe_jax.model.transformer import HybridMoE
from moe_jax.parallel.mesh import make_mesh
from moe_jax.train import checkpoint, compile_cache, metrics, optim
from moe_jax.train import state as state_lib, step as step_lib
from moe_jax.train import probe as route_probe
from moe_jax.train.guard import DivergenceGuard
from moe_jax.train.preemption import Preemption


def evaluate(eval_step, state, eval_ds, sharding) -> dict:
  sums = None
  for batch in eval_ds:
    out = eval_step(state.params, state.router, state_lib.global_batch(batch, sharding))
    sums = out if sums is None else jax.tree.map(lambda a, b: a + b, sums, out)
  return step_lib.summarize_eval(jax.device_get(sums))


def evaluate_all(eval_step, state, eval_sets: dict, sharding) -> dict:
  """Every validation split: "validation"'s metrics under their own names, another split's
  under its suffix ("validation_digits" → "digits/accuracy")."""
  out = {}
  for name, ds in eval_sets.items():
    prefix = "" if name == "validation" else name[len("validation_"):] + "/"
    out.update({prefix + k: v for k, v in evaluate(eval_step, state, ds, sharding).items()})
  return out


def _scalars(metrics: dict) -> dict[str, float]:
  return {k: v for k, v in metrics.items() if isinstance(v, (int, float))}


def train_and_evaluate(c: ml_collections.ConfigDict, workdir: str, *, progress: bool = True,
                       stop_after: int | None = None, start_from=None, between=None):
  """Trains to schedule.total_steps, resuming from the latest checkpoint in `workdir`.

  `stop_after` ends this invocation early at that step (checkpointed), as a preempted job
  would; the schedule still follows schedule.total_steps.

  `between` = (n, fn), a curriculum: at the step trained from (0 or resumed), every n
  steps and at the last, fn(step, state) returns the data config of the steps that follow,
  or None to stop training there (that step is checkpointed). Where it differs from the
  current one, the train pipeline is rebuilt from it at the same position; the model, the
  compiled step and the optimizer state carry on (the GRPO warm-up's checks,
  rl/trainer.py). A call does not checkpoint its step (a save costs more than a check), so
  after a resume fn sees steps past the restored one again: its first call names the step
  trained from, and its answer there must be the data config in effect at that step.

  Returns a summary dict: final validation metrics, the validation split's byte-unigram
  entropy (text sources), the step resumed from (or None), the train-loss history and, for
  MoE models, the history of MaxVio averaged over MoE layers. After SIGTERM it checkpoints
  at the next step boundary and returns early with "preempted": that step (no final eval).
  """
  config_lib.validate(c)
  tokenizers.configure(c)   # a learned tokenizer sets model.vocab_size
  mesh = make_mesh(c.mesh)
  data_shards = mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape["expert"]
  if c.data.batch_size % data_shards:
    raise ValueError(f"data.batch_size={c.data.batch_size} must be a multiple of the data × fsdp "
                     f"× expert mesh size {data_shards}")
  with jax.set_mesh(mesh):  # the MoE layer reads the expert axis from the context mesh
    return _train(c, workdir, mesh, progress, stop_after, start_from, between)


def _next_data(c, between, step, state, train_iter):
  """(config, train iterator, stop) after `between`'s call at `step`: the same pair where the
  data config is unchanged, else a pipeline over the new config's train rows, moved to the
  current one's position."""
  data = between[1](step, state)
  if data is None:
    return c, train_iter, True
  if data.to_dict() == c.data.to_dict():
    return c, train_iter, False
  c = ml_collections.ConfigDict(c.to_dict())
  c.data = ml_collections.ConfigDict(data.to_dict())
  new_iter = iter(pipeline.train_dataset(pipeline.sources(c)["train"], c))
  new_iter.set_state(train_iter.get_state())
  return c, new_iter, False


def _train(c, workdir, mesh, progress, stop_after, start_from, between):
  os.makedirs(workdir, exist_ok=True)
  primary = jax.process_index() == 0   # the one process that writes files and logs
  if primary:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(c.to_json_best_effort(indent=2))

  # Data.
  sources = pipeline.sources(c)
  train_iter = iter(pipeline.train_dataset(sources["train"], c))
  eval_sets = {name: pipeline.eval_dataset(src, c) for name, src in sources.items()
               if name.startswith("validation")}
  eval_ds = eval_sets["validation"]
  unigram = (None if c.data.source in ("mqar", "tasks")
             else pipeline.unigram_entropy_bits(sources["validation"]))
  passes = pipeline.train_passes(sources["train"], c)
  if passes is not None:
    print(f"moe_jax: train split {len(sources['train']):,} rows of {c.data.seq_len}; "
          f"{c.schedule.total_steps:,} steps x {c.data.batch_size} rows read it "
          f"{passes:.3g} times", flush=True)

  # Model, optimizer, state.
  model = HybridMoE(state_lib.frozen_model_config(c))
  tx = optim.make_optimizer(c)
  manager = checkpoint.make_manager(os.path.abspath(os.path.join(workdir, "checkpoints")), c)
  state, resumed, state_sh, batch_sh, train_step, timings = start(
      c, mesh, model, tx, next(iter(eval_ds)), manager, train_iter, start_from)
  start_step = int(state.step)
  print(f"moe_jax: {state_lib.param_count(state.params):,} params; "
        + (f"resumed from checkpoint at step {resumed}" if resumed is not None
           else "no checkpoint, starting from step 0")
        + f"; train step {timings['executable']} in {timings['lower']:.1f} s, compiled in "
        f"{timings['compile']:.1f} s", flush=True)

  eval_step = step_lib.jit_eval_step(model.apply, state_sh, batch_sh, c.model)
  tags = {"stage": c.log.stage} if c.log.stage else None
  train_log = metrics.MetricWriter(workdir, "train", tags)
  eval_log = metrics.MetricWriter(workdir, "eval", tags)
  tokens_per_step = c.data.batch_size * c.data.seq_len
  history, max_vio_history, eval_metrics = [], [], None
  fluctuation_history, probe, fluctuation = [], None, None
  if c.log.route_fluctuation and is_moe(c.model):
    probe = route_probe.RouteProbe(model.apply, state_sh, batch_sh,
                       state_lib.global_batch(next(iter(eval_ds)), batch_sh))

  total = c.schedule.total_steps
  end = total if stop_after is None else min(stop_after, total)
  bar = tqdm(total=total, initial=start_step, disable=not (progress and primary), unit="step",
             dynamic_ncols=True)
  last_time, last_step = time.perf_counter(), start_step
  guard = DivergenceGuard(c.train.guard) if c.train.guard.enabled else None
  preempted = None
  step = start_step
  closing = contextlib.ExitStack()   # however the loop ends: a fault, SIGTERM, or done
  closing.callback(_close_quietly, manager)
  closing.callback(train_log.close)
  closing.callback(eval_log.close)
  with closing, Preemption() as preemption:
    stop = False
    if between is not None:
      c, train_iter, stop = _next_data(c, between, step, state, train_iter)
    while step < end and not stop:
      if preemption.requested(step, manager):
        checkpoint.save(manager, step, state, train_iter)
        bar.write(f"moe_jax: preempted (SIGTERM); saved step {step}, run again to resume")
        preempted = step
        break
      batch = state_lib.global_batch(next(train_iter), batch_sh)
      state, m = train_step(state, batch)
      done = step + 1
      if guard is not None and (trigger := guard.observe(
          done, float(m["loss"]), float(m["skipped_updates"]))) is not None:
        state, step = _roll_back(manager, state, train_iter, guard, trigger, c, train_log, bar)
        last_time, last_step = time.perf_counter(), step
        bar.reset(total=total)
        bar.update(step)
        continue
      bar.update(1)
      if probe is not None and (route_probe.needed(done, c.log.every_steps) or done == end):
        fluctuation = probe.observe(done, state)
      if done % c.log.every_steps == 0 or done == end:
        m = jax.device_get(m)
        if fluctuation is not None:   # taken at this step (every logging step is `needed`)
          m["moe/route_fluctuation"] = fluctuation
          fluctuation_history.append((done, fluctuation))
        now = time.perf_counter()
        m["tokens_per_sec"] = tokens_per_step * (done - last_step) / (now - last_time)
        last_time, last_step = now, done
        train_log.write(done, m)
        history.append((done, float(m["loss"])))
        if "moe/max_vio_mean" in m:
          max_vio_history.append((done, float(m["moe/max_vio_mean"])))
        postfix = {"loss": f"{m['loss']:.3f}", "tok_s": f"{m['tokens_per_sec']:.0f}",
                   "skipped": int(m["skipped_updates"])}
        if "moe/max_vio_mean" in m:
          postfix["max_vio"] = f"{m['moe/max_vio_mean']:.2f}"
        if "moe/route_fluctuation" in m:
          postfix["route_fluct"] = f"{m['moe/route_fluctuation']:.3f}"
        bar.set_postfix(postfix)
      if done % c.eval.every_steps == 0 or done == end:
        eval_metrics = evaluate_all(eval_step, state, eval_sets, batch_sh)
        eval_log.write(done, eval_metrics)
        bar.write(f"step {done}: " + ", ".join(f"val_{k}={v:.4f}" for k, v in
                                               _scalars(eval_metrics).items()
                                               if "moe/" not in k))
      if between is not None and (done % between[0] == 0 or done == total):
        c, train_iter, stop = _next_data(c, between, done, state, train_iter)
      if done % c.checkpoint.every_steps == 0 or done == end or stop:
        checkpoint.save(manager, done, state, train_iter)
      step = done
    checkpoint.finish(manager)
  bar.close()
  if preempted is not None:  # the grace period is short: no final evaluation
    return {"step": int(state.step), "resumed_from": resumed, "preempted": preempted,
            "state": state, "history": history, "max_vio_history": max_vio_history}
  if eval_metrics is None:  # nothing left to train: report the restored model
    eval_metrics = evaluate_all(eval_step, state, eval_sets, batch_sh)

  summary = {"step": int(state.step), "resumed_from": resumed, "unigram_entropy_bits": unigram,
             **{f"val_{k}": v.tolist() if isinstance(v, np.ndarray) else v
                for k, v in eval_metrics.items()}}
  if primary:
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
    _print_final(_scalars(eval_metrics), unigram)
  return {**summary, "state": state, "history": history, "max_vio_history": max_vio_history,
          "route_fluctuation_history": fluctuation_history, "start": timings,
          "skipped_updates": int(optim.skipped_updates(state.opt_state))}


def start(c, mesh, model, tx, example_batch, manager, train_iter, start_from=None):
  """The state to train from and the compiled train step, side by side: the step compiles
  (or loads from the compilation cache) on a second thread from the abstract state while
  this one restores the newest checkpoint or, with none, runs init (and `start_from`).
  (Init waiting for the step's lowering, so that its trace leaves the GIL to the step's,
  measured slower on the H200: the two XLA compiles then overlap; benchmarks/train.md.)

  With train.split_step the step is two programs (step.jit_step_halves): the update half
  traces and compiles on this second thread while the gradient half compiles on a third.

  Returns (state, resumed step or None, state shardings, batch sharding, compiled train
  step, timings: seconds "init_or_restore", "lower", "compile" (the gradient half's, with
  the update half's as "update_lower", "update_compile"), "wall", and "executable":
  "traced", or "loaded" from compile_cache's store)."""
  t0 = time.perf_counter()
  abstract, state_sh, init = state_lib.train_state_plan(model, tx, example_batch, mesh, c)
  batch_sh = state_lib.batch_sharding(mesh)
  batch = state_lib.abstract_batch(c, example_batch, batch_sh)
  timings = {}
  common = dict(config=c, devices=list(mesh.devices.flat), known={"state": abstract})

  def compile_step():
    if not c.train.split_step:
      return compile_cache.compiled(step_lib.jit_train_step(c, state_sh, batch_sh),
                                    (abstract, batch), name="train_step", donate=(0,),
                                    timings=timings, **common)
    grad_fn, update_fn = step_lib.jit_step_halves(c, state_sh, batch_sh)
    grads = compile_cache.lower(grad_fn, (abstract, batch), name="train_grads",
                                timings=timings, **common)
    grads_abstract, out_abstract = grads.out_info
    with concurrent.futures.ThreadPoolExecutor(1) as second:   # both halves compile at once
      grads_compiling = second.submit(grads.compile)
      update_timings = {}
      update = compile_cache.lower(update_fn, (abstract, grads_abstract, out_abstract),
                                   name="train_update", donate=(0,), timings=update_timings,
                                   **common).compile()
      grads = grads_compiling.result()
    timings.update({f"update_{k}": v for k, v in update_timings.items()})
    if update_timings["executable"] != timings["executable"]:
      timings["executable"] = "traced"
    return step_lib.SplitStep(grads, update)

  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    compiling = pool.submit(compile_step)
    t = time.perf_counter()
    state, resumed = checkpoint.restore_latest(manager, abstract, train_iter, c.model)
    if resumed is None:
      state = init(jax.random.key(c.seed))
      if start_from is not None:
        state = start_from(state)
    jax.block_until_ready(state)
    timings["init_or_restore"] = time.perf_counter() - t
    train_step = compiling.result()
  timings["wall"] = time.perf_counter() - t0
  return state, resumed, state_sh, batch_sh, train_step, timings


def _print_final(eval_metrics, unigram):
  if unigram is not None:
    drop = 1.0 - eval_metrics["bits_per_byte"] / unigram
    print(f"final validation bits/byte {eval_metrics['bits_per_byte']:.4f} vs byte-unigram "
          f"entropy of the validation split {unigram:.4f} bits/byte ({100 * drop:.1f}% lower)",
          flush=True)
  else:
    print(f"final validation accuracy {eval_metrics['accuracy']:.4f}, loss "
          f"{eval_metrics['loss']:.4f}", flush=True)
  for k, v in eval_metrics.items():   # held-out image tasks: answer accuracy
    if k.endswith("/accuracy"):
      print(f"final held-out {k[:-len('/accuracy')]} answer accuracy {v:.4f}", flush=True)


def _roll_back(manager, state, train_iter, guard, trigger, c, train_log, bar):
  """Restores the newest checkpoint before the trigger, skips the batches from there through
  the triggering one plus train.guard.skip_batches, and logs the event. Returns (state,
  step)."""
  checkpoint.finish(manager)
  guard.rolled_back(trigger)
  state, to_step = checkpoint.restore_before(manager, state, train_iter, trigger.step, c.model)
  skip = trigger.step - to_step + c.train.guard.skip_batches
  for _ in range(skip):
    next(train_iter)
  train_log.write(trigger.step, {"guard/rollbacks": guard.rollbacks, "guard/rollback_to": to_step,
                                 "guard/skipped_batches": skip, "guard/loss": trigger.loss})
  bar.write(f"moe_jax: divergence guard: {trigger.reason} at step {trigger.step}; rolled back "
            f"to step {to_step} and skipped {skip} batches (rollback {guard.rollbacks} of at "
            f"most {c.train.guard.max_rollbacks})")
  return state, to_step


def _close_quietly(manager):
  """Closes the checkpoint manager while unwinding; checkpoint.finish has already raised any
  save error on the way out of a normal run."""
  try:
    manager.close()
  except Exception as e:  # a second report of a failed save would hide the first
    logging.warning("closing the checkpoint manager: %s: %s", type(e).__name__, e)
