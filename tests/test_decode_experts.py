"""The decode-experts kernels: each assignment's SwiGLU by its own expert, equal to the
gathered einsums in interpret mode (with repeated experts and bf16), and lowering to Triton."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import pallas_gpu_decode_experts as de
from pallas_kernels.moe import reference
from tests.conftest import rel_err
from tests.test_kda_triton_lowering import h200  # noqa: F401 — fixture


def _gathered(x_NxD, idx_NxK, gate_up, down):
  """The MoE layer's gather path (what the kernels replace), in fp32."""
  f32 = lambda a: a.astype(jnp.float32)
  return reference.swiglu_experts(f32(x_NxD), idx_NxK, f32(gate_up), f32(down))


@pytest.mark.parametrize("fill", [1, de.FILL])
@pytest.mark.parametrize("dtype,bound", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_equals_gathered_einsums(dtype, bound, fill, monkeypatch):
  """fill 1: 64-wide column tiles; the shipped fill: 16-wide (6 assignments)."""
  monkeypatch.setattr(de, "FILL", fill)
  assert de.tiles(6, 128, 192) == ((64, 64) if fill == 1 else (16, 16))
  rng = np.random.default_rng(0)
  N, K, E, D, F = 3, 2, 5, 128, 192
  x = jnp.asarray(rng.normal(size=(N, D)), dtype)
  idx = jnp.asarray([[4, 0], [0, 0], [2, 4]], jnp.int32)   # repeats, across and within rows
  gate_up = jnp.asarray(rng.normal(size=(E, D, 2, F)) / np.sqrt(D), dtype)
  down = jnp.asarray(rng.normal(size=(E, F, D)) / np.sqrt(F), dtype)
  got = de.swiglu_experts(x, idx, gate_up, down, interpret=True)
  assert got.shape == (N, K, D) and got.dtype == dtype
  assert np.isfinite(np.asarray(got, np.float32)).all()
  assert rel_err(got, _gathered(x, idx, gate_up, down)) < bound


def test_tiles_narrow_until_the_grid_fills_the_gpu():
  """long_context_1b's experts (D 1024, F 704): batch 1 at top-4 narrows both kernels to 16
  columns (176 and 256 programs), batch 2 to 32 (176 and 256), batch 8 keeps 64."""
  assert de.tiles(4, 1024, 704) == (16, 16)
  assert de.tiles(8, 1024, 704) == (32, 32)
  assert de.tiles(32, 1024, 704) == (64, 64)


def test_rejects_shapes_it_cannot_tile():
  with pytest.raises(ValueError, match=r"D % 64 == 0 and F % 64 == 0; got D=96, F=128"):
    de.swiglu_experts(jnp.ones((1, 96)), jnp.zeros((1, 2), jnp.int32),
                      jnp.ones((4, 96, 2, 128)), jnp.ones((4, 128, 96)), interpret=True)


@pytest.mark.parametrize("N", [1, 8])
def test_lowers_to_triton(h200, N):  # noqa: F811
  """Batch 1 (16-wide tiles) and batch 8 (64-wide)."""
  fn = lambda x, i, g, d: de.swiglu_experts(x, i, g, d, interpret=False)
  args = (jnp.zeros((N, 1024), jnp.bfloat16), jnp.zeros((N, 4), jnp.int32),
          jnp.zeros((32, 1024, 2, 704), jnp.bfloat16), jnp.zeros((32, 704, 1024), jnp.bfloat16))
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "decode_experts_up" in text and "decode_experts_down" in text
