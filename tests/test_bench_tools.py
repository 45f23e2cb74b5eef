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


def test_kernel_registers_dumps_every_kda_kernel_with_its_launch_width(tmp_path):
  """scripts/kernel_registers.py's CPU half: one Triton IR file per KDA kernel (forward and
  backward), each with the num_warps the code ships (pallas_gpu.WARPS, the prologue's)."""
  from pallas_kernels.kda import pallas_gpu, prologue_gpu
  from scripts import kernel_registers
  fn, args = kernel_registers.kda_kernels(64)
  kernels = kernel_registers.dump_ttir(fn, args, str(tmp_path))
  shipped = {f"kda_intra_{n}": w for n, w in pallas_gpu.WARPS.items()}
  shipped.update(kda_prologue=prologue_gpu.WARPS, kda_prologue_bwd=prologue_gpu.WARPS)
  assert {n: kernels[n] for n in shipped} == shipped
  assert {"kda_recurrence", "kda_recurrence_bwd", "kda_recurrence_grads"} <= set(kernels)
  for name in kernels:
    assert f"tt.func public @{name}" in (tmp_path / f"{name}.ttir").read_text()
