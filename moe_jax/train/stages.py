"""Staged context extension: a run is a list of stages, each a normal training run at its own
sequence length, started from the previous stage's final checkpoint.

  sc = stages.get_config("cpu")                 # configs/stages.py
  run_stages(sc, workdir)                       # workdir/<stage>/ per stage, resumable

Handover: the new stage gets the previous stage's params and MoE router state (balancer
biases). The optimizer state is carried by default (`carry_optimizer`): the parameters do
not jump at a stage boundary, so Adam's moments are still good estimates, and a fresh
second moment would make the first updates of the stage too large. Only the learning-rate
schedule's step count restarts, so every stage re-warms and decays on its own schedule.
With carry_optimizer=False the moments start from zero as well.

Resuming: a stage with a checkpoint of its own resumes from it (exact, like any run); a
stage whose summary.json reports its last step is complete and skipped.
"""

import json
import os

import jax
import ml_collections
import optax
import orbax.checkpoint as ocp

from moe_jax.train import checkpoint
from moe_jax.train.loop import train_and_evaluate


def stage_names(sc: ml_collections.ConfigDict) -> list[str]:
  names = [n for n in sc.stage_names.split(",") if n]
  for n in names:
    if n not in sc.stages:
      raise ValueError(f"stage_names={sc.stage_names!r} names {n!r}, which is not one of "
                       f"stages: {sorted(sc.stages.keys())}")
  if not names:
    raise ValueError(f"stage_names={sc.stage_names!r} must name at least one stage")
  return names


def stage_config(sc: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
  """The full run config of one stage: sc.run with the stage's length, batch, schedule and
  overrides, and its metrics tagged with the stage name."""
  st = sc.stages[name]
  if st.tokens_per_step % st.seq_len:
    raise ValueError(f"stages.{name}.tokens_per_step={st.tokens_per_step} must be a multiple "
                     f"of stages.{name}.seq_len={st.seq_len}")
  c = ml_collections.ConfigDict(sc.run.to_dict())
  c.data.seq_len = st.seq_len
  c.data.batch_size = st.tokens_per_step // st.seq_len
  c.schedule.total_steps = st.steps
  c.schedule.warmup_steps = st.warmup_steps
  c.schedule.final_lr_fraction = st.final_lr_fraction
  c.optim.learning_rate = st.learning_rate
  if st.kda_chunk_size:
    c.model.kda_chunk_size = st.kda_chunk_size
  if st.mesh_sequence:
    c.mesh.sequence = st.mesh_sequence
  if st.remat is not None:
    c.model.remat = st.remat
  if st.get("remat_policy"):
    c.model.remat_policy = st.remat_policy
  c.eval.every_steps = min(c.eval.every_steps, st.steps)
  c.checkpoint.every_steps = min(c.checkpoint.every_steps, st.steps)
  c.log.stage = name
  return c


def control_config(sc: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The control run: straight at the last stage's length, for the same total tokens, with
  the first stage's learning rate and warmup (one schedule over the whole run)."""
  names = stage_names(sc)
  first, last = sc.stages[names[0]], sc.stages[names[-1]]
  tokens = sum(sc.stages[n].steps * sc.stages[n].tokens_per_step for n in names)
  c = stage_config(sc, names[-1])
  c.schedule.total_steps = max(1, tokens // last.tokens_per_step)
  c.schedule.warmup_steps = min(first.warmup_steps, c.schedule.total_steps - 1)
  c.optim.learning_rate = first.learning_rate
  c.eval.every_steps = min(sc.run.eval.every_steps, c.schedule.total_steps)
  c.checkpoint.every_steps = min(sc.run.checkpoint.every_steps, c.schedule.total_steps)
  c.log.stage = "control"
  return c


def restart_schedule(opt_state):
  """The optimizer state with the learning-rate schedule's step count at 0 (Adam's moments
  and its bias-correction count are kept)."""
  return jax.tree.map(
      lambda s: s._replace(count=jax.numpy.zeros_like(s.count))
      if isinstance(s, optax.ScaleByScheduleState) else s,
      opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByScheduleState))


def handover(previous_checkpoints: str, carry_optimizer: bool):
  """A `start_from` for train_and_evaluate: the fresh state (step 0) with the previous
  stage's final params and router state, and its optimizer state if carried."""
  def start_from(state):
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    prev, _ = checkpoint.restore_state(previous_checkpoints, abstract)
    opt_state = restart_schedule(prev.opt_state) if carry_optimizer else state.opt_state
    return state.replace(params=prev.params, router=prev.router, opt_state=opt_state)
  return start_from


def is_complete(stage_dir: str, steps: int) -> bool:
  path = os.path.join(stage_dir, "summary.json")
  if not os.path.exists(path):
    return False
  with open(path) as f:
    return json.load(f).get("step") == steps


def run_stages(sc: ml_collections.ConfigDict, workdir: str, *, progress: bool = True,
               stop_after: tuple[str, int] | None = None) -> dict:
  """Runs every stage not yet complete, in order. `stop_after=(stage, step)` ends the run
  there, checkpointed (as a kill would; used by tests). Returns {stage: summary}; a stopped
  or preempted run returns what finished so far plus that stage's partial result."""
  results, previous = {}, None
  for name in stage_names(sc):
    stage_dir = os.path.join(workdir, name)
    c = stage_config(sc, name)
    if is_complete(stage_dir, c.schedule.total_steps):
      print(f"moe_jax: stage {name} is complete; skipped", flush=True)
      with open(os.path.join(stage_dir, "summary.json")) as f:
        results[name] = json.load(f)
    else:
      print(f"moe_jax: stage {name}: seq_len {c.data.seq_len} × batch {c.data.batch_size}, "
            f"{c.schedule.total_steps} steps", flush=True)
      start = None if previous is None else handover(
          os.path.abspath(os.path.join(previous, "checkpoints")), sc.carry_optimizer)
      stop = stop_after[1] if stop_after and stop_after[0] == name else None
      out = train_and_evaluate(c, stage_dir, progress=progress, stop_after=stop,
                               start_from=start)
      results[name] = {k: v for k, v in out.items() if k != "state"}
      if out.get("preempted") is not None or out["step"] < c.schedule.total_steps:
        return results
    previous = stage_dir
  return results
