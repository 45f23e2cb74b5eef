"""What every "" / None kernel choice resolves to on each target platform. The target is the
platform of the mesh's devices in context (abstract ones here), so these run on a CPU host,
as an ahead-of-time compile for a TPU does (scripts/aot_compile.py)."""

import jax.numpy as jnp
import pytest

from moe_jax.model import moe
from moe_jax.model.mla import mla_implementation
from moe_jax.parallel import ring_attention
from moe_jax.train.state import frozen_model_config
from pallas_kernels.moe import ops as moe_ops
from pallas_kernels import platform
from pallas_kernels.kda import ops
from tests.conftest import make_small_config, target_mesh

TARGETS = {  # target: (context, KDA at K=V=128 / K=V=24 / K=V=512, MLA, grouped matmul
             #          bf16 / f32, ring steps for shards of 256 / 200 positions)
    "cpu": (lambda: target_mesh("cpu", "cpu"), ("xla", "xla", "xla"), "xla",
            ("xla", "xla"), ("xla", "xla")),
    "gpu": (lambda: target_mesh("gpu", "NVIDIA H200"),
            ("pallas_gpu", "xla", "pallas_gpu"), "gpu", ("mosaic", "xla"),
            ("pallas", "pallas")),
    "tpu": (target_mesh, ("pallas_tpu", "pallas_tpu", "xla"), "tpu",
            ("tokamax", "tokamax"), ("tpu", "xla")),
}


@pytest.mark.parametrize("target", TARGETS)
def test_kernel_choices_resolve_for_the_target(target, monkeypatch):
  context, kda_impls, mla_impl, gmm, ring = TARGETS[target]
  cfg = frozen_model_config(make_small_config())
  with context():
    assert platform.target() == target
    monkeypatch.setattr(platform, "triton_available", lambda: False)
    assert tuple(ops.default_implementation(d, d) for d in (128, 24, 512)) == kda_impls
    assert (moe_ops.default_grouped_matmul(jnp.bfloat16),
            moe_ops.default_grouped_matmul(jnp.float32)) == gmm
    # with jax_triton installed (the gpu extra), GPU's fitting shapes get the Triton kernels
    monkeypatch.setattr(platform, "triton_available", lambda: True)
    with_triton = tuple("triton" if i == "pallas_gpu" else i for i in kda_impls)
    assert tuple(ops.default_implementation(d, d) for d in (128, 24, 512)) == with_triton
    assert (moe_ops.default_grouped_matmul(jnp.bfloat16),
            moe_ops.default_grouped_matmul(jnp.float32)) == tuple(
                "triton" if i == "mosaic" else i for i in gmm)
    assert mla_implementation(cfg) == mla_impl
    # decode experts: the fused Pallas kernels only on GPU, gathered weights elsewhere
    assert moe.decode_path("auto", 32) == ("fused" if target == "gpu" else "gather")
    assert tuple(ring_attention.default_implementation(n) for n in (256, 200)) == ring
