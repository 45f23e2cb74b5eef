"""orbax checkpoints of the train state and the grain iterator position; resume from latest."""

import jax
import ml_collections
import orbax.checkpoint as ocp
import grain


def make_manager(directory: str, c: ml_collections.ConfigDict) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(
      max_to_keep=c.checkpoint.max_to_keep,
      enable_async_checkpointing=c.checkpoint.async_save,
      create=True,
  )
  return ocp.CheckpointManager(directory, options=options, item_names=("state", "data"))


def save(manager: ocp.CheckpointManager, step: int, state, data_iter) -> bool:
  """Saves `step` (the caller decides when): async for the state, sync for the iterator."""
  return manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      data=grain.checkpoint.CheckpointSave(data_iter)), force=True)


def restore_latest(manager: ocp.CheckpointManager, state, data_iter):
  """(state, step) from the latest checkpoint, data_iter moved to its position; else unchanged."""
  step = manager.latest_step()
  if step is None:
    return state, None
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  restored = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract),
      data=grain.checkpoint.CheckpointRestore(data_iter)))
  return restored.state, step


def restore_state(directory: str, abstract_state, step: int | None = None):
  """(state, step) from `directory` (the latest step unless given), without the data iterator:
  for inference and evaluation."""
  manager = ocp.CheckpointManager(directory, item_names=("state", "data"))
  step = manager.latest_step() if step is None else step
  if step is None:
    raise ValueError(f"no checkpoint in {directory!r}: train first (scripts/train.py --workdir)")
  restored = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract_state)))
  manager.close()
  return restored.state, step
