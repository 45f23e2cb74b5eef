"""Train state (fp32 params + optax state + step), created sharded over the mesh."""

import contextlib
from typing import Any

import flax.linen as nn
import jax
import ml_collections
from flax import struct
from flax.training import train_state
from jax._src import config as jax_config
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moe_jax.fields import is_moe
from moe_jax.parallel.mesh import LOGICAL_RULES
from moe_jax.train import compile_cache



class TrainState(train_state.TrainState):
  """flax TrainState plus the MoE balancer state (variables["router"]): no gradient, moved by
  router.update inside the train step, checkpointed with everything else."""
  router: Any = struct.field(default_factory=dict)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batch rows over data × fsdp × expert, time over the sequence axis."""
  return NamedSharding(mesh, P(("data", "fsdp", "expert"), "sequence"))


def init_model(model: nn.Module) -> nn.Module:
  """The model as init builds it: params depend on no kernel choice, so the XLA paths run
  (no Pallas or tokamax kernel is lowered and compiled only to be thrown away)."""
  c = ml_collections.ConfigDict(model.cfg.to_dict())
  c.kda_implementation, c.mla_implementation = "xla", "xla"
  if is_moe(c):
    c.moe.grouped_matmul = "xla"
  return model.clone(cfg=ml_collections.FrozenConfigDict(c))


def init_batch(example_batch, mesh: Mesh | None = None):
  """The smallest batch that builds the same params: one KDA chunk per sequence shard, one
  row per batch shard (params depend on no batch or sequence length)."""
  rows = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape["expert"]
  seq = 1 if mesh is None else mesh.shape["sequence"]
  T = example_batch["tokens"].shape[1]
  return {k: v[:1].repeat(rows, 0)[:, :min(T, seq * _INIT_CHUNK)]
          for k, v in example_batch.items()}


_INIT_CHUNK = 128  # ≥ every kda_chunk_size


def abstract_batch(c, example_batch, sharding: NamedSharding) -> dict:
  """The global train batch's shapes and dtypes (data.batch_size × data.seq_len, trailing
  dims as in `example_batch`, any batch size) on `sharding`: what the step compiles for."""
  return {k: jax.ShapeDtypeStruct((c.data.batch_size, c.data.seq_len) + v.shape[2:], v.dtype,
                                  sharding=sharding) for k, v in example_batch.items()}


def global_batch(local_batch: dict, sharding: NamedSharding) -> dict:
  """The global batch array from each process's rows (data/pipeline.py shards them by
  process); with one process, a device_put."""
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x),
                      local_batch)


def _boxed_state(model: nn.Module, tx, example_batch, rng):
  variables = init_model(model).init(rng, example_batch)
  return TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx,
                           router=variables.get("router", {}))


def train_state_plan(model: nn.Module, tx, example_batch, mesh: Mesh, config=None):
  """(abstract state: shapes, dtypes and shardings; state shardings; init: rng → state),
  without building anything: the train step can compile from the abstract state while init
  runs, and a resumed run restores into it and never inits. Params are fp32, laid out by
  their logical axes; init runs the XLA paths on a batch of one chunk per shard
  (init_model, init_batch). With `config` (the run's, which built model and tx) init's
  executable goes through compile_cache.compiled: stored, or loaded untraced."""
  example_batch = init_batch(example_batch, mesh)
  boxed_state = lambda r: _boxed_state(model, tx, example_batch, r)
  # An abstract key: nothing runs, so this also plans for devices that are not attached
  # (scripts/aot_compile.py's TPU topology).
  boxed = jax.eval_shape(boxed_state, jax.eval_shape(jax.random.key, 0))
  shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, LOGICAL_RULES)
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          nn.meta.unbox(boxed), shardings)
  jitted = jax.jit(lambda r: nn.meta.unbox(boxed_state(r)), out_shardings=shardings)

  def init(rng):
    with _threefry_kernels():
      if config is None:
        return jitted(rng)
      return compile_cache.compiled(jitted, (rng,), name="init", config=config,
                                    devices=mesh.devices.flat, known={"state": abstract})(rng)

  return abstract, shardings, init


def _threefry_kernels():
  """On GPU, each threefry call of the initialisers as one CUDA kernel instead of its
  unrolled HLO (jax_threefry_gpu_kernel_lowering; the same bits): init is almost nothing
  but random draws for every parameter, and their HLO was most of its compile time.
  A no-op elsewhere; jax has no public context manager for the flag."""
  flag = getattr(jax_config, "threefry_gpu_kernel_lowering", None)
  return flag(True) if flag is not None else contextlib.nullcontext()


def create_train_state(model: nn.Module, tx, example_batch, mesh: Mesh, rng):
  """Returns (state, state_shardings): train_state_plan's init, run."""
  _, shardings, init = train_state_plan(model, tx, example_batch, mesh)
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
