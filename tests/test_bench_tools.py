"""The benchmark's kernel attribution: GPU profiles name every XLA fusion's op "XlaModule",
so scripts/bench_train.py reads each kernel's named scope from the compiled HLO."""

import jax
import jax.numpy as jnp

from scripts import bench_train, xprof_tables


def test_fusion_kernels_map_to_their_named_scope():
  def f(x):
    with jax.named_scope("kda"):
      y = jnp.exp(x) * 2.0 + 1.0
    with jax.named_scope("optimizer"):
      return jnp.sum(jnp.tanh(y) * x, axis=0)

  hlo = jax.jit(f).lower(jnp.ones((64, 32))).compile().as_text()
  ops = xprof_tables.hlo_ops(hlo)
  fusions = {k: v for k, v in ops.items() if "fusion" in k}
  assert fusions, list(ops)[:10]
  phases = {bench_train.phase_of(xprof_tables.op_of(k, ops)) for k in fusions}
  assert phases <= {"kda", "optimizer"} and phases, fusions
  # XLA's kernel names: the instruction name with '.' → '_', or with a trailing index.
  name = next(iter(fusions))
  assert xprof_tables.op_of(name + "_7", ops) == ops[name]
  assert bench_train.phase_of("XlaModule", "ring_step_dkv") == "mla"
  assert bench_train.phase_of("XlaModule", "grouped_mgpu_dw_704x1024_mosaic_gpu_kernel") == \
      "moe_experts"
