"""orbax checkpoints of the train state and the grain iterator position; resume from the
newest readable one.

Faults: a checkpoint that cannot be read is moved aside to `<checkpoints>_unreadable/`
(never deleted) and the next older one is restored. A save that fails (disk full,
permissions) stops the run with a CheckpointSaveError; orbax writes each step to a
temporary folder and renames it when complete, so earlier checkpoints are untouched.
"""

import os
import shutil

import grain
import jax
import ml_collections
import orbax.checkpoint as ocp
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec as P

from moe_jax.model import layer_stack


class CheckpointSaveError(RuntimeError):
  """A checkpoint could not be written; the earlier ones are intact."""


def make_manager(directory: str, c: ml_collections.ConfigDict) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(
      max_to_keep=c.checkpoint.max_to_keep,
      enable_async_checkpointing=c.checkpoint.async_save,
      create=True,
  )
  return ocp.CheckpointManager(directory, options=options, item_names=("state", "data"))


def save(manager: ocp.CheckpointManager, step: int, state, data_iter) -> bool:
  """Saves `step` (the caller decides when): async for the state, sync for the iterator.
  A step already saved is left as it is (False): a SIGTERM that lands during the step or eval
  that ended with an interval save asks for that step again. An async save that failed
  since the last call also raises here (CheckpointSaveError)."""
  if manager.latest_step() == step:
    return False
  try:
    return manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=grain.checkpoint.CheckpointSave(data_iter)), force=True)
  except Exception as e:  # orbax / tensorstore raise many kinds: OSError, ValueError, ...
    raise _save_error(manager, f"step {step}, or an asynchronous save before it", e) from e


def finish(manager: ocp.CheckpointManager):
  """Waits for async saves; one that failed raises CheckpointSaveError."""
  try:
    manager.wait_until_finished()
  except Exception as e:
    raise _save_error(manager, "an asynchronous save", e) from e


def _save_error(manager, what, e) -> CheckpointSaveError:
  return CheckpointSaveError(
      f"saving a checkpoint ({what}) in {manager.directory} failed ({type(e).__name__}: {e}). "
      "Earlier checkpoints are untouched; free space or fix permissions, then run again to "
      "resume from the newest one.")


def restore_latest(manager: ocp.CheckpointManager, state, data_iter, model_cfg=None):
  """(state, step) from the newest readable checkpoint, data_iter moved to its position;
  (state, None) unchanged when there is none. With `model_cfg`, a checkpoint in the other
  layer layout (model/layer_stack.py: written before or without scan_layers) is converted."""
  return _restore_newest(manager, state, data_iter, sorted(manager.all_steps(), reverse=True),
                         model_cfg)


def restore_before(manager: ocp.CheckpointManager, state, data_iter, step: int, model_cfg=None):
  """(state, its step) from the newest readable checkpoint before `step` (a rollback)."""
  steps = sorted((s for s in manager.all_steps() if s < step), reverse=True)
  if not steps:
    raise RuntimeError(f"no checkpoint before step {step} in {manager.directory} to roll "
                       "back to: save more often (checkpoint.every_steps)")
  return _restore_newest(manager, state, data_iter, steps, model_cfg)


def _restore_any_layout(restore, abstract, model_cfg):
  """restore(target) in the state's layout; if that fails and the model scans layers, in the
  other layout (restored replicated), converted and placed like the state."""
  try:
    return restore(abstract)
  except Exception as first:
    if model_cfg is None or layer_stack.plan(model_cfg).n == 0:
      raise
    stacked = layer_stack.is_stacked(abstract.params)
    other = jax.eval_shape(lambda s: layer_stack.convert(model_cfg, s, not stacked), abstract)
    sharding = jax.tree.leaves(abstract)[0].sharding
    if isinstance(sharding, NamedSharding):
      sharding = NamedSharding(sharding.mesh, P())
    other = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                         other)
    try:
      restored = restore(other)
    except Exception:
      raise first from None   # unreadable in either layout: report the state's own error
    state = layer_stack.convert(model_cfg, restored.state, stacked)
    state = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), state, abstract)
    print("moe_jax: converted a checkpoint to the " + ("scanned" if stacked else "per-layer")
          + " layer layout (model/layer_stack.py)", flush=True)
    return type(restored)(**{**dict(restored.items()), "state": state})


def _restore_newest(manager, state, data_iter, steps, model_cfg=None):
  """Tries `steps` newest first. Unreadable ones are logged and, once an older one has been
  restored, moved aside; if none is readable, ValueError listing each step's error (and
  nothing is moved)."""
  if not steps:
    return state, None
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  failed = []
  for step in steps:
    items = {"data": grain.checkpoint.CheckpointRestore(data_iter)}
    if not has_data(manager, step):
      items = {}   # weights only (scripts/convert_checkpoint.py): the data starts afresh
    try:
      restored = _restore_any_layout(
          lambda target: manager.restore(step, args=ocp.args.Composite(
              state=ocp.args.StandardRestore(target), **items)), abstract, model_cfg)
    except Exception as e:  # a truncated or missing file surfaces as many error types
      logging.warning("checkpoint step %d in %s cannot be read (%s: %s)", step,
                      manager.directory, type(e).__name__, e)
      failed.append((step, e))
      continue
    for bad, e in failed:
      aside = _set_aside(manager, bad)
      print(f"moe_jax: checkpoint step {bad} is unreadable ({type(e).__name__}); moved to "
            f"{aside}; restored step {step}", flush=True)
    if failed:
      manager.reload()
    return restored.state, step
  raise ValueError(f"no readable checkpoint in {manager.directory}; tried " + "; ".join(
      f"step {s}: {type(e).__name__}: {str(e)[:200]}" for s, e in failed))


def has_data(manager: ocp.CheckpointManager, step: int) -> bool:
  """Whether `step` holds a data-iterator position (converted weights have none)."""
  return (manager.directory / str(step) / "data").exists()


def save_weights(directory: str, state):
  """A step-0 checkpoint of `state` without a data position: scripts/train.py resumes from
  it with the data from the start (scripts/convert_checkpoint.py)."""
  manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=True),
                                  item_names=("state", "data"))
  manager.save(int(state.step), args=ocp.args.Composite(state=ocp.args.StandardSave(state)),
               force=True)
  manager.wait_until_finished()
  manager.close()


def _set_aside(manager, step: int) -> str:
  """Moves a step's folder to `<checkpoints>_unreadable/<step>[.n]` on the same disk."""
  src = os.fspath(manager.directory / str(step))
  dest_dir = os.fspath(manager.directory).rstrip("/") + "_unreadable"
  os.makedirs(dest_dir, exist_ok=True)
  dest, n = os.path.join(dest_dir, str(step)), 1
  while os.path.exists(dest):
    dest, n = os.path.join(dest_dir, f"{step}.{n}"), n + 1
  shutil.move(src, dest)
  return dest


def restore_state(directory: str, abstract_state, step: int | None = None, model_cfg=None):
  """(state, step) from `directory` (the latest step unless given), without the data iterator:
  for inference and evaluation. model_cfg: as in restore_latest."""
  manager = ocp.CheckpointManager(directory, item_names=("state", "data"))
  step = manager.latest_step() if step is None else step
  if step is None:
    raise ValueError(f"no checkpoint in {directory!r}: train first (scripts/train.py --workdir)")
  restored = _restore_any_layout(lambda target: manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(target))), abstract_state, model_cfg)
  manager.close()
  return restored.state, step
