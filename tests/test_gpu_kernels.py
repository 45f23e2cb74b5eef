"""The real GPU kernels at realistic sizes against their references (GPU only; skipped on CPU,
where the other test files run the same kernels in interpret mode).

KDA: several seeds, long T, many heads, odd lengths, gates at the bound, unbounded gates,
bf16 and fp32; every output and gradient finite and within tolerance of the float64
recurrent spec. Attention (training flash, ring step, prefill over a cache, latent decode),
the few-rows matmul, the decode experts and the tokamax grouped matmul against XLA.
Tolerances: 1e-2 for bf16 operands; 1e-4 for fp32 under the suite's "highest" precision
(IEEE dots); 3e-3 for fp32 at the default precision (TF32), the promise of that mode.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import platform
from pallas_kernels.moe import ops as moe_ops
from pallas_kernels.attention.pallas_gpu_causal import causal_attention
from pallas_kernels.attention import pallas_gpu_cached as ca
from pallas_kernels.attention import pallas_gpu_latent_decode as ld
from pallas_kernels.attention import reference as attention_reference
from pallas_kernels.attention import pallas_gpu_ring_step as ring_step
from pallas_kernels.matmul import pallas_gpu_few_rows as few_rows
from pallas_kernels.moe import pallas_gpu_decode_experts as de
from pallas_kernels.moe import reference as moe_reference
from tests.conftest import rel_err
from tests.test_kda import LB, _impl, _inputs, _loss_and_grads, _spec, check_gate_inside_the_op

pytestmark = pytest.mark.gpu
GRADS = ["q", "k", "v", "g", "beta", "initial_state"]


def _check_kda(args, S0, lower_bound, bound, seed, g_bound=None, impl="pallas_gpu"):
  """Outputs and all six gradients of `impl` vs the float64 spec; all finite. g_bound:
  the bound for the gate's gradient where it differs."""
  spec_args = tuple(a.astype(jnp.float64) for a in args)
  rng = np.random.default_rng(seed)
  B, T, H, _ = args[0].shape
  V = args[2].shape[-1]
  w_o, w_S = rng.normal(size=(B, T, H, V)), rng.normal(size=S0.shape)
  _, ref_grads = _loss_and_grads(_spec, spec_args, S0.astype(jnp.float64), w_o, w_S)
  o_ref, S_ref = _spec(*spec_args, S0.astype(jnp.float64))
  fn = _impl(impl, 64, lower_bound=lower_bound)
  o, S = fn(*args, S0)
  _, grads = _loss_and_grads(fn, args, S0, w_o, w_S)
  for name, a, b in [("o", o, o_ref), ("S", S, S_ref), *zip(GRADS, grads, ref_grads)]:
    a = np.asarray(a.astype(jnp.float32))
    assert np.isfinite(a).all(), f"{name} has {(~np.isfinite(a)).sum()} non-finite values"
    assert rel_err(a, b) <= (g_bound if name == "g" and g_bound else bound), (name, rel_err(a, b))


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("seed,B,T,H,K,V", [
    (0, 2, 1000, 16, 128, 128),    # many heads, T not a multiple of the chunk
    (1, 1, 4096, 4, 128, 128),     # long T
    (2, 3, 333, 8, 64, 32),        # other head dims
])
def test_kda_bf16_matches_fp64_spec(seed, B, T, H, K, V):
  """The training configuration: bf16 q/k/v/β, fp32 gates from kda_gate."""
  (q, k, v, g, beta), S0 = _inputs(B, T, H, K, V, seed=seed)
  bf = lambda x: x.astype(jnp.bfloat16)
  _check_kda((bf(q), bf(k), bf(v), g.astype(jnp.float32), bf(beta)), S0.astype(jnp.float32),
             LB, 1e-2, seed)


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("gates", ["at_bound", "near_zero", "unbounded"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kda_extreme_gates_with_gradients(gates, dtype):
  """Every gate at -5 (the bound), gates near 0, and unbounded legacy gates far below -5
  (lower_bound=None), with gradients. With the unbounded gates the decay over a chunk
  reaches e^-1000 and the gate's gradient is tiny (norm 5.5e-5 here): the elements where
  the fp64 spec's is about 0 come out as ±2^-24, the rounding residue of the O(1) terms its
  reverse cumulative sum cancels, so that gradient is held to 3e-2. Measured 2.34e-2 on the
  H100 and 2.33e-2 in interpret mode on CPU with the Pallas stage 1 of unbounded gates (the
  default), 9.4e-3 with the XLA one; every other output and gradient within 3e-7."""
  (q, k, v, _, beta), S0 = _inputs(2, 500, 4, 64, 64, seed=7)
  g, lb = {"at_bound": (jnp.full(q.shape, LB), LB), "near_zero": (jnp.full(q.shape, -1e-6), LB),
           "unbounded": (-jnp.abs(q) * 1e3 - 10.0, None)}[gates]
  dt = jnp.dtype(dtype)
  args = (q.astype(dt), k.astype(dt), v.astype(dt), g.astype(jnp.float32), beta.astype(dt))
  _check_kda(args, S0.astype(jnp.float32), lb, 1e-4 if dtype == "float32" else 1e-2, 3,
             g_bound=3e-2 if gates == "unbounded" else None)


@pytest.mark.usefixtures("x64")
def test_kda_fp32_at_default_precision_is_tf32_accurate():
  """fp32 inputs without "highest": Triton's TF32 dots, within 3e-3 of the spec."""
  (q, k, v, g, beta), S0 = _inputs(2, 700, 4, 128, 128, seed=4)
  f32 = tuple(x.astype(jnp.float32) for x in (q, k, v, g, beta))
  with jax.default_matmul_precision("default"):
    _check_kda(f32, S0.astype(jnp.float32), LB, 3e-3, 4)


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("lower_bound", [LB, None])
def test_kda_gate_and_l2_norm_in_the_prologue_kernel(lower_bound):
  """The training path (model.kda_gate_in_kernel): bf16 raw q/k/v, the gate input, packed
  segments and padding; outputs and the gradients of q, k, v, x, β, A_log and dt_bias."""
  check_gate_inside_the_op("pallas_gpu", 2, 1000, 16, 128, 128, lower_bound, jnp.bfloat16,
                           1e-2, 8, 64)


def _segments(B, T, seed):
  """Packed documents of random lengths, with trailing padding (id 0) in the last row."""
  rng = np.random.default_rng(seed)
  seg = np.cumsum(rng.random((B, T)) < 3 / T, axis=1).astype(np.int32) + 1
  seg[-1, -T // 8:] = 0
  return jnp.asarray(seg)


def test_flash_training_attention_matches_xla():
  """The causal flash kernels as MLA training uses them: bf16, causal, packed segments."""
  B, T, H, D = 2, 2048, 8, 64
  ks = jax.random.split(jax.random.key(0), 4)
  q, k, v, w = (jax.random.normal(key, (B, T, H, D)) for key in ks)
  seg = _segments(B, T, 0)

  def ref(q, k, v):
    same = seg[:, :, None] == seg[:, None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=same[:, None], is_causal=True)

  bf = lambda x: x.astype(jnp.bfloat16)
  o, vjp = jax.vjp(lambda q, k, v: causal_attention(q, k, v, seg), bf(q), bf(k), bf(v))
  o_ref, vjp_ref = jax.vjp(ref, q, k, v)
  assert rel_err(o.astype(jnp.float32), o_ref) < 1e-2
  for name, a, b in zip("qkv", vjp(bf(w)), vjp_ref(w)):
    assert np.isfinite(np.asarray(a, np.float32)).all(), name
    assert rel_err(a.astype(jnp.float32), b) < 1e-2, name


def test_ring_step_forward_and_backward_match_xla():
  """One diagonal ring step is the whole causal attention: its output and (dq, dk, dv) equal
  autodiff of the written-out attention, bf16, T not a multiple of the 64-row block."""
  B, T, H, D = 2, 1000, 8, 128
  ks = jax.random.split(jax.random.key(1), 4)
  q, k, v, w = (jax.random.normal(key, (B, T, H, D)) for key in ks)
  seg = _segments(B, T, 1)

  def dense(q, k, v):
    visible = (jnp.tril(jnp.ones((T, T), bool))[None]) & (seg[:, :, None] == seg[:, None, :])
    s = jnp.where(visible[:, None], jnp.einsum("bthd,bshd->bhts", q, k) * D ** -0.5, -jnp.inf)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v), s

  o_ref, vjp_ref = jax.vjp(lambda *a: dense(*a)[0], q, k, v)
  lse_ref = jax.nn.logsumexp(dense(q, k, v)[1], axis=-1)
  bf = lambda x: x.astype(jnp.bfloat16)
  zero = jnp.int32(0)
  o, lse = ring_step.ring_step_forward(bf(q), bf(k), bf(v), seg, seg, zero, zero,
                                       scale=D ** -0.5)
  assert rel_err(o.astype(jnp.float32), o_ref) < 1e-2
  assert rel_err(lse, lse_ref) < 1e-3
  delta = jnp.einsum("bthd,bthd->bht", bf(w).astype(jnp.float32), o.astype(jnp.float32))
  grads = ring_step.ring_step_backward(bf(q), bf(k), bf(v), seg, seg, zero, zero, bf(w), lse,
                                       delta, scale=D ** -0.5)
  for name, a, b in zip(("dq", "dk", "dv"), grads, vjp_ref(w)):
    assert np.isfinite(np.asarray(a, np.float32)).all(), name
    assert rel_err(a.astype(jnp.float32), b) < 1e-2, name


def test_cached_prefill_attention_matches_reference():
  """A 512-token prefill chunk per row over an 8K cache, rows at different offsets."""
  B, T, H, D, S = 2, 512, 8, 128, 8192
  kq, kk, kv = jax.random.split(jax.random.key(2), 3)
  q = jax.random.normal(kq, (B, T, H, D))
  k, v = jax.random.normal(kk, (B, S, H, D)), jax.random.normal(kv, (B, S, H, D))
  q_start, kv_len = jnp.array([0, 7000]), jnp.array([512, 7512])
  bf = lambda x: x.astype(jnp.bfloat16)
  got = ca.cached_attention(bf(q), bf(k), bf(v), q_start, kv_len)
  ref = attention_reference.cached_attention(q, k, v, q_start, kv_len)
  assert np.isfinite(np.asarray(got, np.float32)).all()
  assert rel_err(got.astype(jnp.float32), ref) < 1e-2


@pytest.mark.parametrize("Q,R", [(16, 256), (32, 512), (32, 576)])
def test_latent_decode_matches_materialised_attention(Q, R):
  """Decode rows (heads × new tokens) over a 32K latent cache, rows filled to different
  lengths: long_context_1b's 16 heads at rank 256, Kimi-48B's 32 heads at rank 512 and
  with its 64 shared key dims (576, two tiles)."""
  B, S = 4, 32768
  kq, kc = jax.random.split(jax.random.key(3), 2)
  q = jax.random.normal(kq, (B, Q, R)) * R ** -0.5
  c = jax.random.normal(kc, (B, S, R))
  kv_len = jnp.array([1, 5000, 20000, S])
  pos = jnp.broadcast_to(kv_len[:, None] - 1, (B, Q))
  got = ld.latent_decode_attention(q.astype(jnp.bfloat16), c.astype(jnp.bfloat16), pos, kv_len)
  s = jnp.einsum("bqr,bsr->bqs", q, c)
  visible = jnp.arange(S) < kv_len[:, None, None]
  ref = jnp.einsum("bqs,bsr->bqr", jax.nn.softmax(jnp.where(visible, s, -jnp.inf), -1), c)
  assert np.isfinite(np.asarray(got)).all() and rel_err(got, ref) < 1e-2


@pytest.mark.parametrize("M,K,N,dtype,bound", [(8, 4096, 2048, "bfloat16", 1e-2),
                                               (3, 704, 96, "float32", 1e-5)])
def test_few_rows_matmul_matches_xla(M, K, N, dtype, bound):
  rng = np.random.default_rng(5)
  x, w = rng.normal(size=(M, K)), rng.normal(size=(K, N))
  got = few_rows.matmul(jnp.asarray(x, dtype), jnp.asarray(w, dtype))
  assert rel_err(got.astype(jnp.float32), x @ w) < bound


def test_decode_experts_match_gathered_einsums():
  """8 tokens × top-8 of 60 experts at d_model 2048, expert hidden 704, bf16."""
  rng = np.random.default_rng(6)
  N, K, E, D, F = 8, 8, 60, 2048, 704
  x = jnp.asarray(rng.normal(size=(N, D)), jnp.bfloat16)
  idx = jnp.asarray(rng.integers(0, E, size=(N, K)), jnp.int32)
  gate_up = jnp.asarray(rng.normal(size=(E, D, 2, F)) / np.sqrt(D), jnp.bfloat16)
  down = jnp.asarray(rng.normal(size=(E, F, D)) / np.sqrt(F), jnp.bfloat16)
  got = de.swiglu_experts(x, idx, gate_up, down)
  f32 = lambda a: a.astype(jnp.float32)
  ref = moe_reference.swiglu_experts(f32(x), idx, f32(gate_up), f32(down))
  assert np.isfinite(np.asarray(got, np.float32)).all() and rel_err(f32(got), ref) < 1e-2


@pytest.mark.parametrize("impl", ["tokamax", "mosaic", "triton"])
def test_gpu_grouped_matmul_matches_ragged_dot(impl, absl_flags_parsed):
  """The dropless expert matmul on GPU (tokamax: its y and dx, grouped_dw's dw; mosaic: the
  Mosaic GPU kernels of grouped_mgpu, tuned tiles; triton: Triton's y and dx, Mosaic's dw;
  bf16) against jax.lax.ragged_dot in fp32,
  output and both gradients, with empty and uneven groups. tokamax's own dw failed this at
  4.6e-2 (benchmarks/gpu_tests.md)."""
  rng = np.random.default_rng(7)
  M, E, Kd, N = 4096, 32, 1024, 512
  sizes = rng.multinomial(M - 100, rng.dirichlet(np.ones(E) * 0.5))   # 100 padding rows
  sizes[3] = 0
  group_sizes = jnp.asarray(sizes, jnp.int32)
  x = jnp.asarray(rng.normal(size=(M, Kd)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(E, Kd, N)) / np.sqrt(Kd), jnp.float32)
  ct = jnp.asarray(rng.normal(size=(M, N)), jnp.float32)
  live = (jnp.arange(M) < group_sizes.sum())[:, None]   # rows past the groups are undefined

  def run(impl, x, w):
    y, vjp = jax.vjp(lambda x, w: moe_ops.grouped_matmul(x, w, group_sizes, impl), x, w)
    return (jnp.where(live, y.astype(jnp.float32), 0.0),
            *vjp(jnp.where(live, ct, 0.0).astype(y.dtype)))

  y, dx, dw = run(impl, x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
  y_ref, dx_ref, dw_ref = run("xla", x, w)
  for name, a, b in [("y", y, y_ref), ("dx", jnp.where(live, dx, 0), dx_ref), ("dw", dw, dw_ref)]:
    a = np.asarray(a, np.float32)
    assert np.isfinite(a).all(), name
    assert rel_err(a, b) < 1e-2, name


@pytest.mark.parametrize("weighted", [False, True])
def test_gpu_swiglu_with_the_gradient_in_kernel_matches_xla(weighted, absl_flags_parsed):
  """The routed SwiGLU on `triton` at long_context_1b's expert shapes (D 1024, F 704): the
  down projection's dx kernel writes the SwiGLU's gradient (ops.swiglu_down). y and the
  gradients of x, gate_up and down against XLA's ragged_dot in fp32, skewed and empty
  groups, 100 padding rows (undefined, masked); weighted (model.moe.weights_before_down):
  each row's activation times its routing weight, and the weights' gradient."""
  from moe_jax.model import experts
  rng = np.random.default_rng(8)
  M, E, D, F = 4096, 32, 1024, 704
  sizes = rng.multinomial(M - 100, rng.dirichlet(np.ones(E) * 0.5))
  sizes[5] = 0
  group_sizes = jnp.asarray(sizes, jnp.int32)
  x = jnp.asarray(rng.normal(size=(M, D)), jnp.float32)
  gate_up = jnp.asarray(rng.normal(size=(E, D, 2, F)) / np.sqrt(D), jnp.float32)
  down = jnp.asarray(rng.normal(size=(E, F, D)) / np.sqrt(F), jnp.float32)
  ct = jnp.asarray(rng.normal(size=(M, D)), jnp.float32)
  rw = jnp.asarray(rng.uniform(0.1, 1.0, size=M), jnp.float32) if weighted else None
  live = (jnp.arange(M) < group_sizes.sum())[:, None]
  assert moe_ops.swiglu_grad_in_kernel("triton", F, D)

  def run(impl, *args):
    y, vjp = jax.vjp(lambda x, gu, dn: experts.swiglu_grouped(x, group_sizes, gu, dn, impl,
                                                              grad_in_kernel=True, w_M=rw),
                     *args)
    return (jnp.where(live, y.astype(jnp.float32), 0.0),
            *vjp(jnp.where(live, ct, 0.0).astype(y.dtype)))

  got = run("triton", *(a.astype(jnp.bfloat16) for a in (x, gate_up, down)))
  ref = run("xla", x, gate_up, down)
  got = (got[0], jnp.where(live, got[1], 0), *got[2:])
  if weighted:   # the weights' gradient: rw as an argument too
    f = lambda impl, *a: jax.grad(lambda w: (experts.swiglu_grouped(
        a[0], group_sizes, a[1], a[2], impl, grad_in_kernel=True, w_M=w).astype(jnp.float32)
        * jnp.where(live, ct, 0.0)).sum())(rw)
    got = (*got, f("triton", *(a.astype(jnp.bfloat16) for a in (x, gate_up, down))))
    ref = (*ref, f("xla", x, gate_up, down))
  for name, a, b in zip(("y", "dx", "dgate_up", "ddown", "dweights"), got, ref):
    a = np.asarray(a, np.float32)
    assert np.isfinite(a).all(), name
    assert rel_err(a, b) < 1e-2, name


def test_float32_models_take_xla_grouped_matmul_on_gpu():
  assert moe_ops.default_grouped_matmul(jnp.float32) == "xla"
  assert moe_ops.default_grouped_matmul(jnp.bfloat16, 1024, 1408) == (
      "triton" if platform.triton_available() else "mosaic")
