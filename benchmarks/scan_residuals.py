"""What the train step stores for the backward pass: the residuals in the jaxpr of the
loss's VJP, in all and the layer scan's stacked ones by shape and dtype, traced abstractly
on the CPU (no device, no data).

Under `model.scan_layers` every value the backward pass reads from a period is stored
per period in a stack [n_periods, ...]; on a GPU, each one a custom call (a Triton, Mosaic
or Pallas kernel) produces reaches its stack through a device-to-device copy
(benchmarks/train.md). The policy (model.remat_policy) decides which values these are;
this lists them, so a change to the policy or the model can be weighed before a GPU runs.

  python -m benchmarks.scan_residuals --row=1b_dropless [--set=k=v ...]

The row is one of benchmarks/bench_train.py's ROWS (its batch and sequence length); --set
is bench_train's flag, overriding the row's config. --target picks the platform the
kernels resolve for (default gpu; on a host without triton, KDA's Pallas GPU kernels and
Mosaic's grouped matmul stand in for the Triton ones, with the same residual tags). The
unscanned layers' residuals (the head's and tail's, or every layer's without
model.scan_layers) count in the total only.
"""

import collections
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks import bench_train   # its --set flag, the rows' configs
from pallas_kernels.platform import target_mesh

_ROW = flags.DEFINE_string("row", "1b_dropless", "A row of benchmarks/bench_train.py.")
_TARGET = flags.DEFINE_enum("target", "gpu", ["gpu", "tpu", "cpu"],
                            "The platform the kernels resolve for (pallas_kernels/platform.py): "
                            "the residuals are those of its kernels' custom VJPs.")


def vjp_jaxpr(c, platform: str = "gpu"):
  """The jaxpr of jax.vjp of the train loss (train/step.loss_fn) in the params, for config
  c at its data.batch_size × data.seq_len with the kernels `platform` resolves to: its
  outputs are the residuals the backward pass reads."""
  import flax.linen as nn
  from moe_jax.model.transformer import HybridMoE
  from moe_jax.train import step as step_lib

  model = HybridMoE(c.model)
  B, L = c.data.batch_size, c.data.seq_len
  ints = lambda: jnp.zeros((B, L), jnp.int32)
  batch = {"tokens": ints(), "targets": ints(), "segment_ids": jnp.ones((B, L), jnp.int32),
           "loss_mask": jnp.ones((B, L), jnp.float32)}
  variables = nn.meta.unbox(jax.eval_shape(model.init, jax.random.key(0), batch))

  def residuals(params):
    loss = lambda p: step_lib.loss_fn(p, variables["router"], model.apply, batch)[0]
    return jax.vjp(loss, params)[1]

  kind = {"gpu": "NVIDIA H100 80GB HBM3", "tpu": "TPU v5"}.get(platform)
  with contextlib.nullcontext() if kind is None else target_mesh(platform, kind):
    return jax.make_jaxpr(residuals)(variables["params"]).jaxpr


def stacked_residuals(jaxpr) -> dict:
  """{(shape, dtype): count} of the layer scan's stacked outputs in a vjp_jaxpr: {} when
  the model has no scanned periods."""
  out = collections.Counter()
  for eqn in jaxpr.eqns:           # the layer scan is a top-level scan of the VJP's jaxpr
    if eqn.primitive.name != "scan":
      continue
    n = eqn.params["length"]
    for v in eqn.outvars:          # the stacks: a leading axis of the scan's length
      if v.aval.ndim >= 2 and v.aval.shape[0] == n:
        out[(tuple(v.aval.shape), str(v.aval.dtype))] += 1
  return dict(out)


def residual_bytes(jaxpr) -> int:
  """All the residuals of a vjp_jaxpr, stacked or not, each once, the params (its inputs)
  left out."""
  params = {id(v) for v in jaxpr.invars}
  out = {id(v): v.aval for v in jaxpr.outvars
         if not isinstance(v, jax.extend.core.Literal) and id(v) not in params}
  return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in out.values())


def total_bytes(stacks: dict) -> int:
  return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize * n
             for (shape, dtype), n in stacks.items())


def main(argv):
  del argv
  jax.config.update("jax_platforms", "cpu")
  sets = bench_train._SET.value
  jaxpr = vjp_jaxpr(bench_train.row_config(_ROW.value, sets), _TARGET.value)
  stacks = stacked_residuals(jaxpr)
  print(f"{_ROW.value} {' '.join(sets)} ({_TARGET.value} kernels): residuals "
        f"{residual_bytes(jaxpr) / 2**30:.2f} GiB, of them {total_bytes(stacks) / 2**30:.2f} "
        f"GiB in {sum(stacks.values())} stacks")
  print("| stacks | shape | dtype | GiB |\n|---|---|---|---|")
  for (shape, dtype), n in sorted(stacks.items(), key=lambda kv: -total_bytes(dict([kv]))):
    print(f"| {n} | {list(shape)} | {dtype} | {total_bytes({(shape, dtype): n}) / 2**30:.2f} |")


if __name__ == "__main__":
  app.run(main)
