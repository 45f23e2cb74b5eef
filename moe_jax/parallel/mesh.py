"""Device mesh from config, and the logical-axis → mesh-axis rules every param and batch uses."""

import math

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from moe_jax.fields import MESH_AXES

# Logical names used by the model (see nn.with_logical_partitioning calls) → mesh axes.
LOGICAL_RULES = (
    ("batch", ("data", "fsdp", "expert")),  # the expert axis also splits the batch
    ("sequence", "sequence"),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kda_channels", "tensor"),
    ("expert", "expert"),
    ("kv", None),
    ("kda_rank", None),
    ("kda_fused", None),    # KDA's fused input projection (model.fused_projections): replicated
    ("moe_latent", None),   # latent MoE width (small: replicated)
    ("q_lora", None),
    ("kv_lora", None),
    ("conv", None),
    ("norm", None),
    ("patch", None),        # flattened P·P·C pixels of an image patch (model/vision.py)
    ("patch_grid", None),   # a patch's row or column
    ("layers", None),   # the scan axis of stacked layer params (model/layer_stack.py)
)


def axis_sizes(mesh_cfg: ml_collections.ConfigDict, n_devices: int) -> tuple[int, ...]:
  """Resolve the one -1 axis to the remaining devices; the product must equal n_devices."""
  sizes = [mesh_cfg[a] for a in MESH_AXES]
  fixed = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if n_devices % fixed:
      raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))}: fixed axes ({fixed}) must divide "
                       f"the device count {n_devices}")
    sizes[sizes.index(-1)] = n_devices // fixed
  if math.prod(sizes) != n_devices:
    raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} has {math.prod(sizes)} devices, "
                     f"but {n_devices} are available")
  return tuple(sizes)


def make_mesh(mesh_cfg: ml_collections.ConfigDict, devices=None) -> Mesh:
  devices = jax.devices() if devices is None else devices
  sizes = axis_sizes(mesh_cfg, len(devices))
  return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def axis_size(name: str) -> int:
  """Size of mesh axis `name` in the mesh set with jax.set_mesh (1 when none is set)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or name not in mesh.axis_names:
    return 1
  return mesh.shape[name]


def single_device() -> bool:
  """Whether no mesh of more than one device is set (jax.set_mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  return mesh.empty or mesh.size == 1


BATCH_AXES = ("data", "fsdp", "expert")


def activation_spec(mesh, ndim: int, time_axis=None) -> P:
  """shard_map spec of a [B, T] / [B, T, H, ...] activation: batch over data·fsdp·expert,
  time over `time_axis`, heads over tensor (the axes `mesh` has)."""
  bax = tuple(a for a in BATCH_AXES if a in mesh.axis_names) or None
  hax = "tensor" if "tensor" in mesh.axis_names else None
  return P(bax, time_axis, *([hax] + [None] * (ndim - 3) if ndim > 2 else []))


def state_spec(mesh, ndim: int) -> P:
  """shard_map spec of a [B, H, ...] state: batch and heads as in activation_spec."""
  spec = activation_spec(mesh, ndim + 1)
  return P(spec[0], *spec[2:])


def per_device(fn, *arrays_BxT, per_head=()):
  """fn(*arrays_BxT, *per_head) on each device's slice when a mesh with more than one device
  is set, else fn.

  Arrays are [B, T] or [B, T, H, ...], and fn returns one array laid out like the first:
  the batch splits over data·fsdp·expert and heads over tensor (time whole: sequence-sharded
  layers have their own shard_map). `per_head` arrays are [H, ...] parameters, split over
  tensor like the activations' heads. Pallas GPU kernels are opaque custom calls to XLA's
  partitioner, which would gather their operands onto every device; under shard_map each
  device runs the kernel on its own rows.
  """
  if single_device():
    return fn(*arrays_BxT, *per_head)
  mesh = jax.sharding.get_abstract_mesh()
  specs = tuple(activation_spec(mesh, x.ndim) for x in arrays_BxT)
  hax = "tensor" if "tensor" in mesh.axis_names else None
  head_specs = tuple(P(hax, *[None] * (x.ndim - 1)) for x in per_head)
  return jax.shard_map(fn, in_specs=specs + head_specs, out_specs=specs[0],
                       check_vma=False)(*arrays_BxT, *per_head)
