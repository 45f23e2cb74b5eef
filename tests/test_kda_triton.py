"""KDA with its main kernels in native Triton (implementation="triton", triton_gpu.py: stage
1's tiles and W/U kernels both ways, stage 2's loops; triton_gpu_prologue.py: the prologue
both ways): on CPU Triton's interpreter runs it,
against the float64 spec (outputs and all six gradients) and against the Pallas kernels
kernel by kernel; each kernel is compiled for sm_90a (ptxas) at the shipped launch knobs; on
the GPU jax_triton runs it at realistic sizes."""

import tempfile
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.kernel_registers import triton_report
from pallas_kernels import triton_launch
from pallas_kernels.kda import (kda, pallas_gpu, pallas_gpu_prologue as prologue_gpu, reference,
                                triton_gpu, triton_gpu_fwd16,
                                triton_gpu_prologue as prologue_triton, triton_gpu_stage1)
from tests.conftest import rel_err
from tests.test_gpu_kernels import _check_kda
from tests.test_kda import (LB, _impl, _inputs, _outputs_and_grads, _spec_case,
                             check_gate_inside_the_op, check_unbounded_spec)


@pytest.fixture(params=[False, pytest.param(True, marks=pytest.mark.slow)],
                ids=["three_kernels", "fused"])   # the fused form (not the default): second tier
def stage1_fused(request, monkeypatch):
  """Stage 1's forward as triton_gpu's three kernels or triton_gpu_stage1's one."""
  monkeypatch.setattr(triton_gpu_stage1, "STAGE1_FUSED", request.param)
  return request.param


@pytest.mark.usefixtures("x64", "stage1_fused")
def test_fp32_matches_fp64_spec_with_gradients():
  """Three chunks and a remainder, two V blocks (V 64 at BLOCK_V 32), K ≠ V, an initial
  state; outputs, final state and all six gradients; stage 1's forward both ways. (B = 2,
  chunk 32 and packed segments: the bf16 test below.)"""
  B, T, H, K, V, chunk = 1, 130, 2, 32, 64, 64
  (q, k, v, g, beta), S0, w_o, w_S, (o_ref, S_ref), ref_grads = _spec_case(B, T, H, K, V, T, 1)
  f32 = tuple(x.astype(jnp.float32) for x in (q, k, v, g, beta))
  (o, S), grads = _outputs_and_grads(_impl("triton", chunk), f32, S0.astype(jnp.float32),
                                     w_o, w_S)
  assert o.shape == (B, T, H, V) and S.shape == (B, H, K, V) and o.dtype == jnp.float32
  assert rel_err(o, o_ref) <= 1e-4 and rel_err(S, S_ref) <= 1e-4
  for name, a, b in zip(["q", "k", "v", "g", "beta", "initial_state"], grads, ref_grads):
    assert np.isfinite(np.asarray(a)).all(), name
    assert rel_err(a, b) <= 1e-4, name


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_recurrence_equals_the_pallas_kernel(dtype):
  """Output, final state and every chunk-start state of the Triton forward, and every
  cotangent of its backward, against pallas_gpu's kernels on the same stage-1 inputs: the
  same dots in the same order per chunk, so fp32 agrees to rounding and bf16 to one bf16
  step."""
  B, Tp, H, K, V, C = 1, 128, 2, 32, 64, 64
  rng = np.random.default_rng(0)
  arr = lambda D, s=0.3: jnp.asarray(rng.normal(size=(B, Tp, H, D)) * s, dtype)
  st = {"W": arr(K), "U0": arr(V), "Qg": arr(K), "Kd": arr(K), "Aqk": arr(C),
        "decay": jnp.asarray(rng.uniform(0.5, 1.0, size=(B, Tp // C, H, K)), jnp.float32)}
  S0 = jnp.asarray(rng.normal(size=(B, H, K, V)), jnp.float32)
  kw = dict(chunk_size=C, with_states=True, interpret=True)
  ours = triton_gpu._recurrence_call(st, S0, **kw)
  ref = pallas_gpu._recurrence_call(st, S0, **kw)
  for name, a, b in zip(["O", "S", "states"], ours, ref):
    assert a.shape == b.shape and a.dtype == b.dtype, name
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    tol = 1e-6 if dtype == jnp.float32 or name != "O" else 2 ** -7
    assert np.abs(a - b).max() <= tol * max(1.0, np.abs(b).max()), name
  O, SN = triton_gpu._recurrence_call(st, S0, **{**kw, "with_states": False})
  assert np.array_equal(np.asarray(O), np.asarray(ours[0])) and np.array_equal(SN, ours[1])
  # The backward from the same chunk states: all six stage-1 cotangents and dS0.
  dO = jnp.asarray(rng.normal(size=(B, Tp, H, V)), dtype)
  dSN = jnp.asarray(rng.normal(size=(B, H, K, V)), jnp.float32)
  kw = dict(chunk_size=C, interpret=True)
  (d_ours, dS0), (d_ref, dS0_ref) = (m._recurrence_bwd_call(st, ref[2], dO, dSN, **kw)
                                     for m in (triton_gpu, pallas_gpu))
  for name, a, b in [*((n, d_ours[n], d_ref[n]) for n in st), ("S0", dS0, dS0_ref)]:
    assert a.shape == b.shape and a.dtype == b.dtype, name
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    tol = 1e-5 if dtype == jnp.float32 else 2 ** -7
    assert np.abs(a - b).max() <= tol * max(1.0, np.abs(b).max()), name


@pytest.mark.usefixtures("x64")
def test_bf16_with_segments_gate_and_l2_norm_in_the_op():
  """The training path: bf16 raw inputs, the gate and L2 norm inside the op, packed
  segments and padding; outputs and gradients of q, k, v, x, β, A_log, dt_bias vs fp64."""
  check_gate_inside_the_op("triton", 2, 100, 2, 32, 32, LB, jnp.bfloat16, 1e-2, 8, 32)


@pytest.mark.usefixtures("x64")
def test_gate_inside_the_op_without_l2_norm_or_padding():
  """fla's benchmark setting (no L2 norm, no segments, whole chunks): q̂ = q and k̂ = k, so
  the prologue launches _kda_gate_triton (G only) and its backward _kda_gate_bwd_triton,
  and dq, dk are the stages' cotangents as they are; outputs and all seven gradients vs
  fp64."""
  with mock.patch.object(triton_launch, "launch", wraps=triton_launch.launch) as launch:
    check_gate_inside_the_op("triton", 1, 64, 2, 32, 32, LB, jnp.float32, 1e-4, 5, 32,
                             plain=True)
  names = {c.kwargs["name"] for c in launch.call_args_list}
  assert {"kda_gate_triton", "kda_gate_bwd_triton"} <= names, names
  assert not names & {"kda_prologue_triton", "kda_prologue_bwd_triton"}, names


def _tiles_bwd_inputs(B, Tp, H, K, C, dtype, rng):
  """The tiles backward's inputs: q, k, a decreasing chunk cumsum G (gates near the bound
  in the first chunk, small after it), a reset inside the first chunk, dA masked to A's
  support (as wu_bwd emits it), raw dAqk, wu_bwd's parts."""
  arr = lambda D, dt=jnp.float32, s=1.0: jnp.asarray(rng.normal(size=(B, Tp, H, D)) * s, dt)
  g = LB * jax.nn.sigmoid(arr(K) - 6.0 * (jnp.arange(Tp) >= C)[None, :, None, None])
  G = jnp.cumsum(g.reshape(B, Tp // C, C, H, K), axis=2).reshape(B, Tp, H, K)
  reset = np.zeros((B, Tp), bool)
  reset[:, [C // 2 + 3]] = True
  seg = np.asarray(reference.chunk_segments(jnp.asarray(reset), C)).reshape(B, Tp // C, C)
  i, j = np.arange(C)[:, None], np.arange(C)[None, :]
  support = (seg[..., :, None] == seg[..., None, :]) & (i > j)          # [B, N, C, C]
  dA = arr(C) * jnp.asarray(support.reshape(B, Tp, 1, C))
  return (arr(K, dtype, 0.3), arr(K, dtype, 0.3), G, jnp.asarray(seg.reshape(B, Tp)), dA,
          arr(C, dtype), arr(K), arr(K), arr(K))


def _close(a, b, tol, name):
  assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  assert np.abs(a - b).max() <= tol * max(np.abs(b).max(), 1e-6), name


# bf16 in the second tier: make test checks the bf16 path end to end
# (test_bf16_with_segments_gate_and_l2_norm_in_the_op).
@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
def test_stage1_equals_the_pallas_kernels(dtype):
  """Stage 1 with Triton's kernels against pallas_gpu's, kernel by kernel: the forward (A,
  T and every output), the W/U backward (every output), and the tiles backward (a program
  per 16-row sub-chunk, the W/U parts added in) against pallas_gpu's plus those parts:
  fp32 to rounding, bf16 outputs to one rounding. Segments reset inside chunks (the second
  chunk has none, so its decay is not zero); K ≠ V, two column blocks."""
  B, Tp, H, K, V, C = 1, 128, 2, 64, 32, 64
  rng = np.random.default_rng(0)
  q, k, G, seg, dA, dAqk, dq0, dk0, dG0 = _tiles_bwd_inputs(B, Tp, H, K, C, dtype, rng)
  kw = dict(scale=K ** -0.5, chunk_size=C, interpret=True)
  v = jnp.asarray(rng.normal(size=(B, Tp, H, V)) * 0.3, dtype)
  beta = jnp.asarray(rng.uniform(0.1, 1.0, size=(B, Tp, H)), jnp.float32)
  st, A, T = pallas_gpu.intra_pallas(q, k, v, G, beta, seg, **kw)
  # both tiles kernels (the second, K >= 128's default)
  for by_tile in (False, True):
    with mock.patch.object(triton_gpu, "TILES_BY_TILE", by_tile):
      ours, A_ours, T_ours = triton_gpu.intra_triton(q, k, v, G, beta, seg, **kw)
    assert float(jnp.abs(st["decay"]).max()) > 0.01
    for name, a, b in [("A", A_ours, A), ("T", T_ours, T),
                       *((n, ours[n], st[n]) for n in st)]:
      # bf16 W and U0 come from dots on bf16 operands (WU_LOW_DOTS), Pallas's from fp32
      tol = (2 ** -6 if name in ("W", "U0") else 2 ** -8) if a.dtype == jnp.bfloat16 else 1e-6
      _close(a, b, tol, name)
  d_st = {n: jnp.asarray(rng.normal(size=x.shape), x.dtype) for n, x in st.items()}
  ours = triton_gpu.wu_bwd_call(T, A, q, k, v, G, beta, seg, d_st, **kw)
  ref = pallas_gpu.wu_bwd_call(T, A, q, k, v, G, beta, seg, d_st, **kw)
  for name, a, b in zip(["dA", "dq0", "dk0", "dv", "dbeta", "dG0"], ours, ref):
    _close(a, b, 2 ** -8 if a.dtype == jnp.bfloat16 else 1e-6, name)
  ours = triton_gpu.tiles_bwd_call(q, k, G, seg, dA, dAqk, dq0, dk0, dG0, **kw)
  ref = [a + b for a, b in zip(pallas_gpu.tiles_bwd_call(q, k, G, seg, dA, dAqk, **kw),
                               (dq0, dk0, dG0))]
  for name, a, b, dt in zip(["dq", "dk", "dG"], ours, ref, [q.dtype, k.dtype, jnp.float32]):
    assert a.shape == b.shape and a.dtype == dt, name
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    tol = 2 ** -8 if dt == jnp.bfloat16 else 1e-6
    assert np.abs(a - b).max() <= tol * np.abs(b).max(), name


@pytest.mark.slow   # bounded gates' non-default form: second tier (7 s on 2 cores)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_stage1_equals_the_three_kernels(dtype, monkeypatch):
  """triton_gpu_stage1's one kernel against triton_gpu's three (tiles, Pallas solve, W/U)
  on _tiles_bwd_inputs' chunks
  (gates near the bound in the first, a reset inside it): every output and both
  residuals. Their solve is a product of Neumann factors where the three kernels
  substitute row by row: T in fp32 differs by rounding, 1.4e-6 of its largest entry
  measured here, under the 1e-5 bound; the rest to 1e-6 as above. Without residuals: the
  same outputs, A and T not returned."""
  monkeypatch.setattr(triton_gpu_stage1, "STAGE1_FUSED", True)
  B, Tp, H, K, V, C = 1, 128, 2, 64, 32, 64
  rng = np.random.default_rng(0)
  q, k, G, seg, *_ = _tiles_bwd_inputs(B, Tp, H, K, C, dtype, rng)
  v = jnp.asarray(rng.normal(size=(B, Tp, H, V)) * 0.3, dtype)
  beta = jnp.asarray(rng.uniform(0.1, 1.0, size=(B, Tp, H)), jnp.float32)
  kw = dict(scale=K ** -0.5, chunk_size=C, interpret=True)
  st, A, T = triton_gpu.intra_triton(q, k, v, G, beta, seg, **kw)
  ours, A_ours, T_ours = triton_gpu_stage1.intra_fused(q, k, v, G, beta, seg, **kw)
  assert float(jnp.abs(st["decay"]).max()) > 0.01
  for name, a, b in [("A", A_ours, A), ("T", T_ours, T), *((n, ours[n], st[n]) for n in st)]:
    tol = 1e-5 if name == "T" else 1e-6
    _close(a, b, 2 ** -8 if a.dtype == jnp.bfloat16 else tol, name)
  bare, A_none, T_none = triton_gpu_stage1.intra_fused(q, k, v, G, beta, seg, residuals=False, **kw)
  assert A_none is None and T_none is None
  for name in st:
    np.testing.assert_array_equal(np.asarray(bare[name], np.float32),
                                  np.asarray(ours[name], np.float32), err_msg=name)


@pytest.mark.slow   # FWD16 is an opt-in the default forward does not take (kda.md)
@pytest.mark.parametrize("l2_segments", [False, True], ids=["plain", "l2norm_segments"])
def test_fwd16_equals_the_chunked_forward(l2_segments, monkeypatch):
  """The op's forward without a backward through triton_gpu_fwd16 (its prepare kernel doing
  the prologue's work, 16-row steps) against the prologue and triton_gpu's stages, fp32,
  the gate inside the op, an initial state: O and the final state to rounding. plain: T a
  whole chunk, no L2 norm (fla's benchmark setting); else the L2 norm inside the op, three
  packed documents and padding in row 0, T = 100 (padded to 128)."""
  rng = np.random.default_rng(0)
  B, T, H, K, V = 2, 100 if l2_segments else 64, 2, 32, 64
  x = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  q, k, v, f, beta = x(B, T, H, K), x(B, T, H, K), x(B, T, H, V), x(B, T, H, K), x(B, T, H)
  seg = np.ones((B, T), np.int32)
  seg[0, 30:], seg[0, 60:], seg[0, 90:] = 2, 3, 0
  kw = dict(A_log=x(H), dt_bias=x(H * K), lower_bound=LB, qk_l2norm=l2_segments,
            segment_ids=jnp.asarray(seg) if l2_segments else None, initial_state=x(B, H, K, V),
            output_final_state=True, implementation="triton", chunk_size=64)
  args = (q, k, v, f, jax.nn.sigmoid(beta))
  o_ref, S_ref = kda(*args, **kw)
  monkeypatch.setattr(triton_gpu_fwd16, "FWD16", True)
  with mock.patch.object(triton_launch, "launch", wraps=triton_launch.launch) as launch:
    o, S = kda(*args, **kw)
  names = {c.kwargs["name"] for c in launch.call_args_list}
  assert names == {"kda16_prepare_triton", "kda16_recurrence_triton"}, names
  assert rel_err(o, o_ref) <= 2e-6 and rel_err(S, S_ref) <= 2e-6


@pytest.mark.slow   # the non-default forward through the op: second tier
@pytest.mark.usefixtures("x64")
def test_fwd16_matches_fp64_spec_and_keeps_the_training_path(monkeypatch):
  """implementation="triton" with FWD16: the forward without a backward runs the two
  16-row kernels and matches the fp64 spec (outputs and final state; in bf16 within 1e-2);
  with a backward the forward is triton_gpu's (its residuals) and all six gradients match
  the spec."""
  monkeypatch.setattr(triton_gpu_fwd16, "FWD16", True)
  B, T, H, K, V, chunk = 1, 130, 2, 32, 64, 64
  (q, k, v, g, beta), S0, w_o, w_S, (o_ref, S_ref), ref_grads = _spec_case(B, T, H, K, V, T, 1)
  f32 = tuple(x.astype(jnp.float32) for x in (q, k, v, g, beta))
  with mock.patch.object(triton_launch, "launch", wraps=triton_launch.launch) as launch:
    o, S = _impl("triton", chunk)(*f32, S0.astype(jnp.float32))
  names = {c.kwargs["name"] for c in launch.call_args_list}
  assert names == {"kda16_prepare_triton", "kda16_recurrence_triton"}, names
  assert rel_err(o, o_ref) <= 1e-4 and rel_err(S, S_ref) <= 1e-4
  with mock.patch.object(triton_launch, "launch", wraps=triton_launch.launch) as launch:
    (o, S), grads = _outputs_and_grads(_impl("triton", chunk), f32, S0.astype(jnp.float32),
                                       w_o, w_S)
  names = {c.kwargs["name"] for c in launch.call_args_list}
  assert "kda16_recurrence_triton" not in names and "kda_wu_bwd_triton" in names, names
  assert rel_err(o, o_ref) <= 1e-4 and rel_err(S, S_ref) <= 1e-4
  for name, a, b in zip(["q", "k", "v", "g", "beta", "initial_state"], grads, ref_grads):
    assert np.isfinite(np.asarray(a)).all(), name
    assert rel_err(a, b) <= 1e-4, name
  bf = (*(x.astype(jnp.bfloat16) for x in (q, k, v)), g.astype(jnp.float32),
        beta.astype(jnp.float32))
  o, S = _impl("triton", chunk)(*bf, S0.astype(jnp.float32))
  assert o.dtype == jnp.bfloat16 and rel_err(o, o_ref) <= 1e-2 and rel_err(S, S_ref) <= 1e-2


# 8 s each; the default's (products) first-tier case is the unbounded fp64 spec test below,
# the column form's (an opt-in) this one
@pytest.mark.parametrize("diagonal", ["columns",
                                      pytest.param("products", marks=pytest.mark.slow)])
def test_fused_stage1_of_unbounded_gates_equals_pallas(diagonal, monkeypatch):
  """Kimi's unbounded gates (steps to -120, so a 16-row block's exponents overflow e^{88}
  from any one anchor): the fused kernel's diagonal blocks (column by column, or as
  products) against pallas_gpu's unbounded stage 1, every output and both residuals, in
  fp32."""
  monkeypatch.setattr(triton_gpu_stage1, "STAGE1_FUSED_UNBOUNDED", True)
  monkeypatch.setattr(triton_gpu_stage1, "UNBOUNDED_DIAGONAL", diagonal)
  B, Tp, H, K, V, C = 1, 128, 2, 32, 32, 64
  rng = np.random.default_rng(3)
  arr = lambda D, s=0.3: jnp.asarray(rng.normal(size=(B, Tp, H, D)) * s, jnp.float32)
  g = -jnp.abs(arr(K, 1.0)) * 40.0 - 2.0
  G = jnp.cumsum(g.reshape(B, Tp // C, C, H, K), axis=2).reshape(B, Tp, H, K)
  reset = np.zeros((B, Tp), bool)
  reset[:, [C + 21]] = True
  seg = reference.chunk_segments(jnp.asarray(reset), C)
  q, k, v = arr(K), arr(K), arr(V)
  beta = jnp.asarray(rng.uniform(0.1, 1.0, size=(B, Tp, H)), jnp.float32)
  kw = dict(scale=K ** -0.5, chunk_size=C, interpret=True, bounded=False)
  st, A, T = pallas_gpu.intra_pallas(q, k, v, G, beta, seg, **kw)
  ours, A_ours, T_ours = triton_gpu_stage1.intra_fused(q, k, v, G, beta, seg, **kw)
  for name, a, b in [("A", A_ours, A), ("T", T_ours, T), *((n, ours[n], st[n]) for n in st)]:
    assert np.isfinite(np.asarray(a)).all(), name
    _close(a, b, 1e-5 if name == "T" else 1e-6, name)


def test_unbounded_diagonal_knob_rejects_unknown_forms(monkeypatch):
  monkeypatch.setattr(triton_gpu_stage1, "UNBOUNDED_DIAGONAL", "rows")
  x = jnp.zeros((1, 64, 1, 16), jnp.float32)
  with pytest.raises(ValueError, match="UNBOUNDED_DIAGONAL must be 'columns' or 'products', "
                     "got 'rows'"):
    triton_gpu_stage1.stage1_call(x, x, x, x, jnp.zeros((1, 64, 1)), jnp.zeros((1, 64), int),
                                  scale=0.25, residuals=False, interpret=True, bounded=False)


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("wu_bwd", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["triton_wu_bwd", "pallas_wu_bwd"])   # non-default: second tier
def test_unbounded_gates_match_fp64_spec_with_gradients(wu_bwd, monkeypatch):
  """implementation="triton" with Kimi's unbounded gates (the fused forward; the backward
  triton_gpu's W/U backward then pallas_gpu's unbounded tiles backward, the default, or
  pallas_gpu's whole) against the fp64 spec with all gradients (check_unbounded_spec)."""
  monkeypatch.setattr(triton_gpu_stage1, "STAGE1_FUSED_UNBOUNDED", True)
  monkeypatch.setattr(triton_gpu_stage1, "UNBOUNDED_WU_BWD", wu_bwd)
  check_unbounded_spec("triton", (1, 70, 2, 16, 16, 64))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_prologue_equals_the_pallas_kernels(dtype):
  """prologue_triton's kernels against prologue_gpu's on the same inputs, forward (q̂, k̂,
  G) and backward (dq, dk, df and the per-chunk A_log / dt_bias sums), for each gate with
  the L2 norm and padding rows: the same fp32 formulas, the cumsums summed in another
  order (scans, not a cumsum and an fp32 dot), so fp32 agrees to 1e-6 and bf16 to one
  rounding."""
  B, Tp, H, K, C = 1, 128, 2, 32, 64
  rng = np.random.default_rng(0)
  arr = lambda s=1.0: jnp.asarray(rng.normal(size=(B, Tp, H, K)) * s, dtype)
  a_HK = jnp.asarray(rng.uniform(0.5, 2.0, size=(H, K)), jnp.float32)
  bias_HK = jnp.asarray(rng.normal(size=(H, K)), jnp.float32)
  live = jnp.asarray((np.arange(Tp) < 100)[None].astype(np.int32))   # 28 padding rows
  for gate, lower_bound, l2norm in [("bounded", LB, True), ("unbounded", None, True),
                                    ("none", None, False)]:
    q, k, dqn, dkn = arr(), arr(), arr(), arr()
    f = arr(2.0) if gate != "none" else -jnp.abs(arr())
    dG = jnp.asarray(rng.normal(size=(B, Tp, H, K)), jnp.float32)
    kw = dict(gate=gate, lower_bound=lower_bound, l2norm=l2norm, chunk_size=C,
              interpret=True)
    outs = [m(q, k, f, a_HK, bias_HK, live, dtype=dtype, **kw)
            for m in (prologue_triton.prologue_call, prologue_gpu._prologue_call)]
    grads = [m(q, k, f, a_HK, bias_HK, live, dqn, dkn, dG, **kw)
             for m in (prologue_triton.prologue_bwd_call, prologue_gpu._prologue_bwd_call)]
    names = ["q̂", "k̂", "G", "dq", "dk", "df", "da", "dbias"]
    for name, a, b in zip(names, [*outs[0], *grads[0]], [*outs[1], *grads[1]]):
      _close(a, b, 2 ** -8 if a.dtype == jnp.bfloat16 else 1e-6, f"{gate} {name}")
    G = np.asarray(outs[0][2])                 # every gate < 0: G falls inside each chunk,
    assert (np.diff(G.reshape(B, Tp // C, C, H, K), axis=2) <= 0).all(), gate
    assert (G[:, 100:] == G[:, 99:100]).all(), gate   # and is flat over the padding


def _kernel_arrays(B, Tp, H, D, C, dtype):
  """Each kernel form by name: (kernel, its arrays (inputs, then outputs) as shapes and
  dtypes, its meta, its warps)."""
  rows = lambda d, dt=dtype: jax.ShapeDtypeStruct((B, Tp, H, d), dt)
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  decay, S, states = f32(B, Tp // C, H, D), f32(B, H, D, D), f32(B, H, Tp // C, D, D)
  st = [rows(D), rows(D), rows(D), rows(D), rows(C), decay]
  meta = dict(Tp=Tp, H=H, K=D, V=D, C=C, BV=min(triton_gpu.BLOCK_V, D), PREC="tf32")
  fp32 = rows(D, jnp.float32)
  tiles = [rows(D), rows(D), fp32, jax.ShapeDtypeStruct((B, Tp), jnp.int32),
           rows(C, jnp.float32), rows(C), fp32, fp32, fp32, rows(D), rows(D), fp32]
  tiles_meta = dict(Tp=Tp, H=H, K=D, C=C, BK=min(D, triton_gpu.TILES_BWD_BLOCK_K),
                    SCALE=D ** -0.5, PREC="tf32")
  wu = [rows(C, jnp.float32), rows(C, jnp.float32), rows(D), rows(D), rows(D), fp32,
        jax.ShapeDtypeStruct((B, Tp, H), jnp.float32), tiles[3], rows(D), rows(D), rows(D),
        rows(D), decay, rows(C, jnp.float32), fp32, fp32, rows(D),
        jax.ShapeDtypeStruct((B, Tp, H), jnp.float32), fp32]
  wu_meta = dict(Tp=Tp, H=H, K=D, V=D, C=C, BK=min(D, triton_gpu.WU_BWD_BLOCK),
                 SCALE=D ** -0.5, PREC="tf32")
  beta = jax.ShapeDtypeStruct((B, Tp, H), jnp.float32)
  stage1 = dict(Tp=Tp, H=H, K=D, V=D, C=C, SCALE=D ** -0.5, PREC="tf32")
  fwd_tiles = ([rows(D), rows(D), fp32, tiles[3], rows(C, jnp.float32), rows(C)],
               dict(stage1, BK=min(D, triton_gpu.TILES_BLOCK_K)), triton_gpu.TILES_WARPS)
  fwd_wu = ([rows(C, jnp.float32), rows(D), rows(D), rows(D), fp32, beta, tiles[3], rows(D),
             rows(D), rows(D), rows(D), decay], dict(stage1, BK=min(D, triton_gpu.WU_BLOCK),
                                                       LOW_DOTS=triton_gpu.WU_LOW_DOTS),
            triton_gpu.WU_WARPS)
  fwd_tiles[1].pop("V")
  per_head, live = jax.ShapeDtypeStruct((H, D), jnp.float32), tiles[3]
  pro_meta = dict(Tp=Tp, H=H, K=D, C=C, GATE=1, LOWER=-5.0, L2NORM=True)
  partial = jax.ShapeDtypeStruct((B, Tp // C, H, D), jnp.float32)
  pro = ([rows(D), rows(D), rows(D), per_head, per_head, live, rows(D), rows(D), fp32],
         pro_meta, triton_gpu.PROLOGUE_WARPS)
  pro_bwd = ([rows(D), rows(D), rows(D), per_head, per_head, live, rows(D), rows(D), fp32,
              rows(D), rows(D), rows(D), partial, partial], pro_meta,
             triton_gpu.PROLOGUE_BWD_WARPS)
  by_tile = (fwd_tiles[0], {n: v for n, v in fwd_tiles[1].items() if n != "BK"},
             triton_gpu.TILES_WARPS)
  # the fused stage 1 with its residuals (the training forward: A and T stored)
  fused = ([rows(D), rows(D), rows(D), fp32, beta, tiles[3], rows(D), rows(D), rows(D), rows(D),
            decay, rows(C), rows(C, jnp.float32), rows(C, jnp.float32)],
           dict(Tp=Tp, H=H, K=D, V=D, BK=min(D, triton_gpu_stage1.STAGE1_BLOCK_K),
                BW=min(D, triton_gpu_stage1.STAGE1_WU_BLOCK), SCALE=D ** -0.5, PREC="tf32",
                SOLVE=triton_gpu_stage1.STAGE1_SOLVE_PREC, LOW_DOTS=triton_gpu.WU_LOW_DOTS,
                RESIDUALS=True, DIAG="anchored"),
           triton_gpu_stage1.STAGE1_WARPS)
  # and Kimi's unbounded gates through it (STAGE1_FUSED_UNBOUNDED), the diagonal blocks
  # either way (UNBOUNDED_DIAGONAL)
  unbounded = lambda diag: (fused[0], dict(fused[1], DIAG=diag), fused[2])
  # the 16-row forward (triton_gpu_fwd16): its prepare kernel (the gate and L2 norm in it)
  # and its recurrence
  tiles16 = jax.ShapeDtypeStruct((B, Tp // 16, H, D), jnp.float32)
  per_head16 = jax.ShapeDtypeStruct((H, D), jnp.float32)
  prepare16 = ([rows(D), rows(D), rows(D), per_head16, per_head16, tiles[3], beta, tiles[3],
                rows(D), rows(D), rows(D), tiles16, rows(16)],
               dict(Tp=Tp, H=H, K=D, C=C, SCALE=D ** -0.5, PREC="tf32",
                    SOLVE=triton_gpu_stage1.STAGE1_SOLVE_PREC, GATE=1, LOWER=-5.0,
                    L2NORM=True), triton_gpu_fwd16.FWD16_PREPARE_WARPS)
  recurrence16 = ([rows(D), rows(D), rows(D), tiles16, rows(16), rows(D), S, rows(D), S],
                  dict(Tp=Tp, H=H, K=D, V=D, BV=min(D, triton_gpu_fwd16.FWD16_BLOCK_V),
                       PREC="tf32"), triton_gpu_fwd16.FWD16_WARPS)
  return {
      "fwd16_prepare": (triton_gpu_fwd16._kda16_prepare_triton, *prepare16),
      "fwd16_recurrence": (triton_gpu_fwd16._kda16_recurrence_triton, *recurrence16),
      "stage1_fused_bounded": (triton_gpu_stage1._kda_stage1_triton, *fused),
      "stage1_fused_unbounded": (triton_gpu_stage1._kda_stage1_triton, *unbounded("products")),
      "stage1_fused_unbounded_columns": (triton_gpu_stage1._kda_stage1_triton,
                                         *unbounded("columns")),
      "tiles": (triton_gpu._kda_tiles_triton, *fwd_tiles),
      "wu": (triton_gpu._kda_wu_triton, *fwd_wu),
      "tiles_blocks": (triton_gpu._kda_tiles_blocks_triton, *by_tile),
      "recurrence": (triton_gpu._kda_recurrence_triton, [*st, S, rows(D), S, states],
                     dict(meta, WITH_STATES=True), triton_gpu.WARPS),
      "recurrence_bwd": (triton_gpu._kda_recurrence_bwd_triton,
                         [*st, states, rows(D), S, rows(D), rows(D), states, S], meta,
                         triton_gpu.WARPS),
      "recurrence_grads": (
          triton_gpu._kda_recurrence_grads_triton,
          [states, states, rows(D), rows(D), rows(D), rows(D), rows(D), rows(D), rows(C),
           decay], dict(meta, BK=min(D, triton_gpu.GRADS_BLOCK_K),
                        BV=min(D, triton_gpu.GRADS_BLOCK_V)), triton_gpu.GRADS_WARPS),
      "tiles_bwd": (triton_gpu._kda_tiles_bwd_triton, tiles, tiles_meta,
                    triton_gpu.TILES_BWD_WARPS),
      "wu_bwd": (triton_gpu._kda_wu_bwd_triton, wu, wu_meta, triton_gpu.WU_BWD_WARPS),
      "prologue": (prologue_triton._kda_prologue_triton, *pro),
      "prologue_bwd": (prologue_triton._kda_prologue_bwd_triton, *pro_bwd),
      "gate": (prologue_triton._kda_gate_triton, [rows(D), per_head, per_head, live, fp32],
               pro_meta, triton_gpu.PROLOGUE_WARPS),
      "gate_bwd": (prologue_triton._kda_gate_bwd_triton,
                   [rows(D), per_head, per_head, live, fp32, rows(D), partial, partial],
                   pro_meta, triton_gpu.PROLOGUE_BWD_WARPS)}


# Optional forms the default path does not launch: the bounded fused stage 1
# (STAGE1_FUSED = False), its unbounded diagonal column by column (UNBOUNDED_DIAGONAL =
# "products") and the 16-row forward (FWD16 = False).
_OPTIONAL_FORMS = ("stage1_fused_bounded", "stage1_fused_unbounded_columns", "fwd16_prepare",
                   "fwd16_recurrence")
# Bytes a thread spilled that a form was timed with: the unbounded fused stage 1 spills 4-8
# at 4 warps and is 1.28x the three kernels' forward with the column form's 56
# (triton_gpu_stage1's knobs, benchmarks/kda.md).
_SPILLS = {"stage1_fused_unbounded": 8, "stage1_fused_unbounded_columns": 56}


# make test builds the shipped kernels at the seeds' head dims (128); long_context_1b's 64
# (15 s) and the optional forms (about 20 s with an empty Triton cache) in the second tier.
@pytest.mark.parametrize("forms", ["shipped", pytest.param("optional", marks=pytest.mark.slow)])
@pytest.mark.parametrize("D", [pytest.param(64, marks=pytest.mark.slow), 128])
def test_compiles_for_h200_within_registers_and_shared_memory(D, forms):
  """The kernels in bf16 (forms: those the default path launches, or the optional ones),
  built as jax_triton builds them for sm_90a (Triton 3.6, the GPU
  machine's, and ptxas) at the shipped knobs and pipeline depths (stage 1's fixed, the
  recurrences' as fitting_stages picks them): within the H200's 227 KB of shared memory
  (3 stages of the K = V = 128 backward asked for 237 KB and failed to launch; shared_for,
  which fitting_stages asks, reads the same number), no spills beyond those a form was
  timed and adopted with (_SPILLS; the state [K, BLOCK_V] would go through local memory
  every chunk) and at least 2 stages in flight. (fp32,
  IEEE dots off the training path, spills and gets 1 stage at K = 128; its builds take
  35 s, so not here.)"""
  for name, (kernel, arrays, meta, warps) in _kernel_arrays(4, 8192, 16, D, 64,
                                                            jnp.bfloat16).items():
    if (name in _OPTIONAL_FORMS) != (forms == "optional"):
      continue
    fixed = {triton_gpu._kda_tiles_bwd_triton: triton_gpu.TILES_BWD_STAGES,
             triton_gpu._kda_recurrence_grads_triton: triton_gpu.GRADS_STAGES,
             triton_gpu._kda_wu_bwd_triton: triton_gpu.WU_BWD_STAGES,
             triton_gpu._kda_tiles_triton: triton_gpu.TILES_STAGES,
             triton_gpu._kda_tiles_blocks_triton: triton_gpu.TILES_STAGES,
             triton_gpu_stage1._kda_stage1_triton: triton_gpu_stage1.STAGE1_STAGES,
             triton_gpu._kda_wu_triton: triton_gpu.WU_STAGES,   # stage 1's, as launched
             prologue_triton._kda_prologue_triton: 1,            # (no loop)
             prologue_triton._kda_prologue_bwd_triton: 1,
             prologue_triton._kda_gate_triton: 1,
             prologue_triton._kda_gate_bwd_triton: 1,
             triton_gpu_fwd16._kda16_prepare_triton: 1}
    stages = fixed.get(kernel) or triton_launch.fitting_stages(kernel, arrays, meta, warps,
                                                               triton_gpu.STAGES)
    compiled = triton_launch.build(kernel, arrays, meta, stages, warps)
    shared = compiled.metadata.shared
    # fitting_stages's lighter check (passes up to LLVM IR) reads the same bytes
    signature = triton_launch.signature(kernel, arrays, meta, stages)
    assert triton_launch.shared_for(kernel, *signature, warps, stages) == shared, name
    regs, spilled = triton_report(compiled, tempfile.mkdtemp())
    assert shared <= triton_launch.MAX_SHARED[90], (name, stages, shared)
    assert stages >= 2 or fixed.get(kernel) == 1, (name, stages)
    assert 0 < regs <= 255 and spilled <= _SPILLS.get(name, 0), (name, stages, regs, spilled)


@pytest.mark.gpu
@pytest.mark.usefixtures("x64", "stage1_fused")
@pytest.mark.parametrize("dtype,bound", [("bfloat16", 1e-2), ("float32", 1e-4)])
def test_gpu_matches_fp64_spec(dtype, bound):
  """jax_triton on the GPU: 2 × 1000 × 16, K = V = 128, all six gradients."""
  (q, k, v, g, beta), S0 = _inputs(2, 1000, 16, 128, 128, seed=0)
  dt = jnp.dtype(dtype)
  args = (q.astype(dt), k.astype(dt), v.astype(dt), g.astype(jnp.float32), beta.astype(dt))
  _check_kda(args, S0.astype(jnp.float32), LB, bound, 0, impl="triton")


@pytest.mark.gpu
@pytest.mark.usefixtures("x64", "stage1_fused")
@pytest.mark.parametrize("gates", ["at_bound", "near_zero"])
def test_gpu_extreme_gates(gates):
  (q, k, v, _, beta), S0 = _inputs(2, 500, 4, 64, 64, seed=7)
  g = jnp.full(q.shape, LB if gates == "at_bound" else -1e-6)
  args = (q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), g, beta)
  _check_kda(args, S0.astype(jnp.float32), LB, 1e-4, 3, impl="triton")


@pytest.mark.gpu
@pytest.mark.usefixtures("x64", "stage1_fused")
def test_gpu_training_path():
  check_gate_inside_the_op("triton", 2, 1000, 16, 128, 128, LB, jnp.bfloat16, 1e-2, 8, 64)
  # fla's benchmark setting: the gate-only prologue (no L2 norm, no padding)
  check_gate_inside_the_op("triton", 2, 1024, 16, 128, 128, LB, jnp.bfloat16, 1e-2, 9, 64,
                           plain=True)


@pytest.mark.gpu
def test_gpu_same_output_as_pallas_at_4x8192x16():
  """The benchmark shape: forward output and final state within bf16 rounding of pallas_gpu,
  stage 1's forward both ways and the 16-row forward (FWD16)."""
  B, T, H, D = 4, 8192, 16, 128
  ks = jax.random.split(jax.random.key(0), 5)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q, k = unit(jax.random.normal(ks[0], (B, T, H, D))), unit(jax.random.normal(ks[1], (B, T, H, D)))
  v = jax.random.normal(ks[2], (B, T, H, D))
  g = LB * jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H, D)))
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
  args = [x.astype(jnp.bfloat16) for x in (q, k, v)] + [g, beta.astype(jnp.bfloat16)]
  run = lambda impl: kda(*args, lower_bound=LB, output_final_state=True, implementation=impl)
  (o, S), (o_ref, S_ref) = run("triton"), run("pallas_gpu")
  with mock.patch.object(triton_gpu_stage1, "STAGE1_FUSED", not triton_gpu_stage1.STAGE1_FUSED):
    o_other, S_other = run("triton")       # stage 1's forward the other way
  assert rel_err(o_other.astype(jnp.float32), o.astype(jnp.float32)) <= 1e-2
  assert rel_err(S_other, S) <= 1e-2
  with mock.patch.object(triton_gpu_fwd16, "FWD16", True):
    o16, S16 = run("triton")
  assert rel_err(o16.astype(jnp.float32), o.astype(jnp.float32)) <= 1e-2
  assert rel_err(S16, S) <= 1e-2
  assert np.isfinite(np.asarray(o, np.float32)).all()
  assert rel_err(o.astype(jnp.float32), o_ref.astype(jnp.float32)) <= 1e-2
  assert rel_err(S, S_ref) <= 1e-2
