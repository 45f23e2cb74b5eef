"""Train state (fp32 params + optax state + step), created sharded over the mesh."""

from typing import Any

import flax.linen as nn
import jax
import ml_collections
from flax import struct
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moe_jax.parallel.mesh import LOGICAL_RULES



class TrainState(train_state.TrainState):
  """flax TrainState plus the MoE balancer state (variables["router"]): no gradient, moved by
  router.update inside the train step, checkpointed with everything else."""
  router: Any = struct.field(default_factory=dict)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batch rows over data × fsdp × expert, time over the sequence axis."""
  return NamedSharding(mesh, P(("data", "fsdp", "expert"), "sequence"))


def _boxed_state(model: nn.Module, tx, example_batch, rng):
  variables = model.init(rng, example_batch)
  return TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx,
                           router=variables.get("router", {}))


def create_train_state(model: nn.Module, tx, example_batch, mesh: Mesh, rng):
  """Returns (state, state_shardings). Params are fp32, laid out by their logical axes."""
  boxed_state = lambda r: _boxed_state(model, tx, example_batch, r)
  abstract = jax.eval_shape(boxed_state, rng)
  shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, LOGICAL_RULES)
  init = jax.jit(lambda r: nn.meta.unbox(boxed_state(r)), out_shardings=shardings)
  return init(rng), shardings


def abstract_train_state(model: nn.Module, tx, example_batch, sharding):
  """The state's shapes and dtypes (nothing allocated), every leaf placed on `sharding`:
  the target for restoring a checkpoint without building the state first."""
  abstract = nn.meta.unbox(jax.eval_shape(
      lambda r: _boxed_state(model, tx, example_batch, r), jax.random.key(0)))
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                      abstract)


def param_count(params) -> int:
  return sum(x.size for x in jax.tree.leaves(params))


def frozen_model_config(c: ml_collections.ConfigDict) -> ml_collections.FrozenConfigDict:
  """Modules take an immutable, hashable model config."""
  return ml_collections.FrozenConfigDict(c.model)
