"""The ring-step flash kernels (interpret mode) against attention written out in fp32, and
their Triton lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import reference, pallas_gpu_ring_step as ring_step
from tests.conftest import rel_err
from tests.test_kda_triton_lowering import h200  # noqa: F401 — fixture

B, T, H, D, DV = 2, 40, 2, 16, 8   # T = 40: not whole 64-blocks, so padding is exercised


def _short_docs(first):
  """Segment ids of T positions from `first` of two packed rows of short documents (row 1
  ends in padding, id 0): most key blocks share no document with a query block."""
  lengths = [5, 9, 3, 12, 7, 4, 11, 6, 2, 8, 10, 3]
  row = np.repeat(np.arange(1, len(lengths) + 1), lengths)
  rows = np.stack([row, np.where(np.arange(len(row)) < 70, row + 100, 0)])
  return rows[:, first:first + T].astype(np.int32)


def _inputs(seed, short_docs_at=None):
  """q, k, v, seg_q, seg_k, dO. short_docs_at=(q_first, k_first): both shards' ids from the
  same rows of short documents; else a few long documents."""
  ks = jax.random.split(jax.random.key(seed), 4)
  q, k = (jax.random.normal(ks[i], (B, T, H, D)) for i in (0, 1))
  v = jax.random.normal(ks[2], (B, T, H, DV))
  if short_docs_at is not None:
    seg_q, seg_k = (_short_docs(first) for first in short_docs_at)
  else:
    seg_q = np.ones((B, T), np.int32)
    seg_q[0, 20:], seg_q[1, 35:] = 2, 0        # a boundary, and trailing padding in row 1
    seg_k = np.ones((B, T), np.int32)
    seg_k[0, 30:] = 2
  return q, k, v, jnp.asarray(seg_q), jnp.asarray(seg_k), jax.random.normal(ks[3], (B, T, H, DV))


_dense = reference.block_attention   # (o, lse) of one step, every score written out


# The default tiles hold all 40 positions in one block; small ones give many blocks, so the
# loops over blocks below the diagonal (no causal mask) and across it both run, at every
# offset, with the grid's tile and the loop's block of different sizes.
SMALL = {"fwd": ring_step.Tiles(16, 8), "dq": ring_step.Tiles(8, 16),
         "dkv": ring_step.Tiles(16, 8)}
# Short documents need many blocks to skip any: they run with the small tiles only.
TILES = pytest.mark.parametrize("small,docs", [(False, "long"), (True, "long"), (True, "short")],
                                ids=["default-tiles", "small-tiles", "small-tiles-short-docs"])


@TILES
@pytest.mark.parametrize("q_first,k_first",
                         [(40, 0), (40, 40), (40, 20), (0, 40), (20, 40), (40, 18)],
                         ids=["earlier-block", "diagonal", "overlapping", "future-block",
                              "partly-future", "unaligned"])
def test_forward_matches_written_out_attention(q_first, k_first, small, docs):
  q, k, v, seg_q, seg_k, _ = _inputs(q_first + 7 * k_first,
                                     (q_first, k_first) if docs == "short" else None)
  o, lse = ring_step.ring_step_forward(q, k, v, seg_q, seg_k, jnp.int32(q_first),
                                       jnp.int32(k_first), scale=D ** -0.5, interpret=True,
                                       tiles=SMALL["fwd"] if small else None)
  o_ref, lse_ref = _dense(q, k, v, seg_q, seg_k, q_first, k_first)
  assert o.shape == (B, T, H, DV) and lse.shape == (B, H, T)
  assert rel_err(o, o_ref) < 1e-5
  seen = np.isfinite(np.asarray(lse_ref))
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), seen)   # -inf exactly where unseen
  assert rel_err(jnp.where(seen, lse, 0.0), jnp.where(seen, lse_ref, 0.0)) < 1e-5
  assert float(jnp.abs(jnp.where(seen.transpose(0, 2, 1)[..., None], 0.0, o)).max()) == 0.0


@TILES
@pytest.mark.parametrize("q_first,k_first", [(0, 0), (40, 20), (40, 18)],
                         ids=["diagonal", "overlapping", "unaligned"])
def test_backward_of_one_step_matches_autodiff(q_first, k_first, small, docs):
  """With the step's own lse (as if it were the ring's only step) its (dq, dk, dv) are the
  gradient of its output: on the diagonal with the same segments for q and k, the whole
  causal attention."""
  q, k, v, seg_q, seg_k, w = _inputs(3, (q_first, k_first) if docs == "short" else None)
  seg_k = seg_q if q_first == k_first else seg_k
  dense = lambda q, k, v: _dense(q, k, v, seg_q, seg_k, q_first, k_first)[0]
  o, vjp = jax.vjp(dense, q, k, v)
  grads_ref = vjp(w)
  lse = _dense(q, k, v, seg_q, seg_k, q_first, k_first)[1]
  delta = jnp.einsum("bthd,bthd->bht", w, o)
  grads = ring_step.ring_step_backward(q, k, v, seg_q, seg_k, jnp.int32(q_first),
                                       jnp.int32(k_first), w, lse, delta, scale=D ** -0.5,
                                       interpret=True,
                                       tiles=(SMALL["dq"], SMALL["dkv"]) if small else None)
  for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
    assert rel_err(g, g_ref) < 1e-5, name


@pytest.mark.parametrize("small", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["default-tiles", "small-tiles"])
def test_split_head_dim_matches_written_out_attention(small, monkeypatch):
  """A query/key head dim of two tiles (48 = 32 + 16, as Kimi's 192 = 128 + 64) runs as two
  summed products: forward (o, lse) and backward (dq, dk, dv) equal attention written out,
  and the padded kernels' (SPLIT_HEAD_DIM off)."""
  Dqk, q_first, k_first = 48, 40, 18
  assert ring_step._qk_parts(Dqk) == [(0, 32), (32, 16)] and ring_step._qk_parts(16) == [(0, 16)]
  q, k, v, seg_q, seg_k, w = _inputs(11, (q_first, k_first))
  q, k = (jnp.concatenate([x, jnp.roll(x, 1, axis=1) * 0.5, -x[:, ::-1]], -1) for x in (q, k))
  assert q.shape[-1] == Dqk
  args = (q, k, v, seg_q, seg_k, jnp.int32(q_first), jnp.int32(k_first))
  kw = dict(scale=Dqk ** -0.5, interpret=True)
  fwd_tiles, bwd_tiles = (SMALL["fwd"], (SMALL["dq"], SMALL["dkv"])) if small else (None, None)

  def run():
    o, lse = ring_step.ring_step_forward(*args, tiles=fwd_tiles, **kw)
    delta = jnp.einsum("bthd,bthd->bht", w, o)
    return (o, lse), ring_step.ring_step_backward(*args, w, lse, delta, tiles=bwd_tiles, **kw)

  (o, lse), grads = run()
  o_ref, lse_ref = _dense(q, k, v, seg_q, seg_k, q_first, k_first)
  assert o.shape == (B, T, H, DV) and rel_err(o, o_ref) < 1e-5
  seen = np.isfinite(np.asarray(lse_ref))
  assert rel_err(jnp.where(seen, lse, 0.0), jnp.where(seen, lse_ref, 0.0)) < 1e-5
  # With the step's own lse its (dq, dk, dv) are the gradient of its output.
  _, vjp = jax.vjp(lambda q, k, v: _dense(q, k, v, seg_q, seg_k, q_first, k_first)[0], q, k, v)
  for name, g, g_ref in zip(("dq", "dk", "dv"), grads, vjp(w)):
    assert g.shape == g_ref.shape and rel_err(g, g_ref) < 1e-5, name
  monkeypatch.setattr(ring_step, "SPLIT_HEAD_DIM", False)
  (o_pad, lse_pad), grads_pad = run()
  assert rel_err(o, o_pad) < 1e-6
  for name, g, g_pad in zip(("dq", "dk", "dv"), grads, grads_pad):
    assert rel_err(g, g_pad) < 1e-6, name


def test_outputs_in_the_model_dtype_are_the_fp32_outputs_rounded_once():
  """out_dtype=bf16 (pallas_gpu_causal.py's single-device attention): o, dq, dk, dv are
  written in bf16 by the kernels, equal to the fp32 outputs rounded, element for element."""
  q, k, v, seg_q, seg_k, w = (x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x
                              for x in _inputs(5))
  one = jnp.int32(0)
  step = lambda dt: ring_step.ring_step_forward(q, k, v, seg_q, seg_q, one, one, scale=0.25,
                                                interpret=True, out_dtype=dt)
  (o32, lse), (o16, lse16) = step(jnp.float32), step(jnp.bfloat16)
  delta = jnp.einsum("bthd,bthd->bht", w.astype(jnp.float32), o32)
  back = lambda dt: ring_step.ring_step_backward(q, k, v, seg_q, seg_q, one, one, w, lse, delta,
                                                 scale=0.25, interpret=True, out_dtype=dt)
  for x32, x16 in zip((o32, *back(jnp.float32)), (o16, *back(jnp.bfloat16))):
    assert x16.dtype == jnp.bfloat16 and x32.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(x16), np.asarray(x32.astype(jnp.bfloat16)))
  np.testing.assert_array_equal(np.asarray(lse16), np.asarray(lse))


@pytest.mark.parametrize("D,Dv", [(64, 64), (24, 40), (192, 128)])   # odd dims padded, 192 split
def test_forward_and_backward_lower_to_triton(h200, D, Dv):  # noqa: F811
  bf = lambda *shape: jnp.zeros(shape, jnp.bfloat16)
  seg = jnp.ones((B, 128), jnp.int32)
  q, k, v, do = bf(B, 128, H, D), bf(B, 128, H, D), bf(B, 128, H, Dv), bf(B, 128, H, Dv)
  rows = jnp.zeros((B, H, 128))

  def both(q, k, v, do):
    o, lse = ring_step.ring_step_forward(q, k, v, seg, seg, jnp.int32(128), jnp.int32(0),
                                         scale=0.125, interpret=False, out_dtype=q.dtype)
    return o, ring_step.ring_step_backward(q, k, v, seg, seg, jnp.int32(128), jnp.int32(0), do,
                                           rows, rows, scale=0.125, interpret=False)

  text = jax.jit(both).trace(q, k, v, do).lower(lowering_platforms=("cuda",)).as_text()
  for kernel in ("ring_step_fwd", "ring_step_dq", "ring_step_dkv"):
    assert kernel in text


# make test builds Kimi's dims (the larger tiles); 64 / 64 in the second tier.
@pytest.mark.parametrize("D,Dv", [pytest.param(64, 64, marks=pytest.mark.slow), (192, 128)])
def test_kernels_fit_the_gpus_shared_memory(D, Dv, tmp_path):
  """Each training flash kernel, compiled for sm_90a by the triton package at the pipeline
  depth it launches with, asks for at most the 232,448 bytes of shared memory an H100/H200
  block may have. At Kimi Linear's MLA head dims (192 = 128 + 64 shared key dims, 128
  values) three stages of dq asked for 246,784 and the train step did not compile; there
  the kernels' WIDE_ tiles spill at most a few dozen bytes a thread (0, 88 and 12 measured;
  the 128-row tiles spilled 2.3-4.1 KB, benchmarks/attention.md)."""
  from benchmarks.kernel_registers import dump_ttir, ptxas_report, shared_bytes
  from pallas_kernels.attention.pallas_gpu_causal import causal_attention
  bf = lambda *shape: jnp.zeros(shape, jnp.bfloat16)
  seg = jnp.ones((1, 512), jnp.int32)

  def fwd_bwd(q, k, v):
    o, vjp = jax.vjp(lambda *a: causal_attention(*a, seg, interpret=False), q, k, v)
    return vjp(o)

  kernels = dump_ttir(fwd_bwd, (bf(1, 512, 2, D), bf(1, 512, 2, D), bf(1, 512, 2, Dv)),
                      str(tmp_path), stages=True)
  assert set(kernels) == {"ring_step_fwd", "ring_step_dq", "ring_step_dkv"}
  for name, (warps, stages) in kernels.items():
    assert shared_bytes(str(tmp_path / f"{name}.ttir"), warps, stages) <= 232448, name
    if D > 128:   # the WIDE_ tiles: next to no register spills (the defaults spilled 2-4 KB)
      assert ptxas_report(str(tmp_path / f"{name}.ttir"), warps)[1] <= 128, name
