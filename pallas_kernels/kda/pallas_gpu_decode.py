"""One KDA decode step (T = 1) as one Pallas kernel (Triton lowering on GPU, `interpret=True`
elsewhere): everything a KDA layer does between its input and output projections.

Why: at batch 1 a decode step is a chain of small kernels, and their count, not the bytes,
sets its time (benchmarks/long_context.md: about 41 launches a layer, 107 µs of device time
inside about 275 µs). In XLA this part of a layer is three short convolutions with their
cache tails, the gate's low-rank up-projection, the q/k L2 norms, the gate, the state
update, the output gate's up-projection and the gated RMSNorm: some twenty kernels. Here
it is one.

  grid (B, H); program (b, h) reads row b's projections of head h, its [K, V] fp32 state
  and the head's slices of the weights, and writes the new state, the new conv tails (its
  own columns; program (b, 0) also their segment ids) and the gated, normed output [V] that
  o_proj reads. Every output is a new array: in place would race (see decode_step).

The maths is model/kda.py's decode path op for op, with the model dtype's roundings where
that path rounds (conv output, L2-normed q and k, the two up-projections, o, the norm and
the gate); sums are fp32.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

F32 = jnp.float32
L2_EPS = 1e-6       # reference.l2_normalize's
UP_ROWS = 16        # rows of a gate's up-projection weight read a loop step
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "f_a", "b_proj", "g_a")


def num_warps(K: int) -> int:
  """A program holds its [K, K] fp32 state in registers. For sm_90a (ptxas): K = 64 at 4
  warps takes 88 registers a thread, K = 128 at 8 warps 173, neither spilling (the gate
  projections read in UP_ROWS-row blocks; read whole, K = 128 took 255 and spilled). A
  decode grid of B·H programs does not fill the SMs, so occupancy is not the limit."""
  return 4 if K <= 64 else 8


def _kernel(*refs, n_src, where, W, K, lower_bound, eps, dtype, has_bias):
  srcs, refs = refs[:n_src], refs[n_src:]
  (seg_ref, tseg_ref, tq_ref, tk_ref, tv_ref, wq_ref, wk_ref, wv_ref, fb_ref, alog_ref,
   dtb_ref, gb_ref), refs = refs[:12], refs[12:]
  gbb_ref, refs = (refs[0], refs[1:]) if has_bias else (None, refs)
  onorm_ref, s_ref, o_ref, s_out_ref, tq_out, tk_out, tv_out, tseg_out = refs
  b, h = pl.program_id(0), pl.program_id(1)
  cols = pl.ds(pl.multiple_of(h * K, K), K)
  rnd = lambda x: x.astype(dtype).astype(F32)       # the XLA path's rounding to the model dtype
  seg = seg_ref[b]
  live = seg != 0

  def short_conv(name, t_ref, w_ref, t_out):
    """ShortConv at the last of W positions (the tail's W-1, then this token): the taps whose
    position shares this token's segment, SiLU; the tail shifts by one for a live token."""
    i, first = where[name]
    x_K = srcs[i][b, pl.ds(first + h * K, K)].astype(F32)
    w = lambda j: rnd(w_ref[j, cols].astype(F32))
    acc_K = rnd(x_K * w(0))
    rows = [t_ref[b, j, cols] for j in range(W - 1)]
    for j in range(1, W):
      same = tseg_ref[b, W - 1 - j] == seg
      acc_K = rnd(acc_K + jnp.where(same, rnd(rows[W - 1 - j].astype(F32) * w(j)), 0.0))
    for j in range(W - 1):
      nxt = rows[j + 1] if j + 1 < W - 1 else x_K.astype(rows[j].dtype)
      t_out[b, j, cols] = jnp.where(live, nxt, rows[j])
    return rnd(jax.nn.silu(acc_K))

  def l2norm(x_K):
    return rnd(x_K * jax.lax.rsqrt(jnp.sum(x_K * x_K) + L2_EPS))

  @pl.when(h == 0)
  def _():   # the tails' segment ids, once a row: shifted by one for a live token
    for j in range(W - 1):
      nxt = tseg_ref[b, j + 1] if j + 1 < W - 1 else seg
      tseg_out[b, j] = jnp.where(live, nxt, tseg_ref[b, j])

  q_K = l2norm(short_conv("q_proj", tq_ref, wq_ref, tq_out))
  k_K = l2norm(short_conv("k_proj", tk_ref, wk_ref, tk_out))
  v_V = short_conv("v_proj", tv_ref, wv_ref, tv_out)

  def up(name, w_ref):
    """x [K] (a low-rank projection of the input) times head h's [K, V] slice, in blocks of
    UP_ROWS rows (fewer registers than the whole slice at once)."""
    i, first = where[name]

    def step(r, acc_V):
      rows = pl.ds(pl.multiple_of(r * UP_ROWS, UP_ROWS), UP_ROWS)
      x_R = srcs[i][b, pl.ds(first + r * UP_ROWS, UP_ROWS)].astype(F32)
      return acc_V + jnp.sum(x_R[:, None] * rnd(w_ref[rows, h, :].astype(F32)), axis=0)
    return jax.lax.fori_loop(0, K // UP_ROWS, step, jnp.zeros((K,), F32))

  f_K = rnd(up("f_a", fb_ref))
  x_K = f_K + dtb_ref[cols].astype(F32)
  a = jnp.exp(alog_ref[h].astype(F32))
  if lower_bound is None:
    g_K = -a * jax.nn.softplus(x_K)
  else:
    g_K = lower_bound * jax.nn.sigmoid(a * x_K)
  i, first = where["b_proj"]
  beta = jax.nn.sigmoid(srcs[i][b, first + h].astype(F32))

  # The delta rule, one token (reference.kda_recurrent): padding leaves the state as it is.
  q_K, k_K, v_V, g_K = (jnp.where(live, x, 0.0) for x in (q_K, k_K, v_V, g_K))
  beta = jnp.where(live, beta, 0.0)
  S_KxV = s_ref[...] * jnp.exp(g_K)[:, None]
  v_pred_V = jnp.sum(S_KxV * k_K[:, None], axis=0)
  S_KxV = S_KxV + k_K[:, None] * (beta * (v_V - v_pred_V))[None, :]
  s_out_ref[...] = S_KxV
  o_V = rnd(jnp.sum(S_KxV * q_K[:, None], axis=0) * K ** -0.5)

  # KDA's output: RMSNorm(o) · sigmoid(g_b(g_a(x))), per head.
  gate_V = rnd(up("g_a", gb_ref))
  if has_bias:
    gate_V = rnd(gate_V + rnd(gbb_ref[h, :].astype(F32)))
  normed_V = rnd(o_V * (jax.lax.rsqrt(jnp.mean(o_V * o_V) + eps) * onorm_ref[...].astype(F32)))
  o_ref[...] = (normed_V * rnd(jax.nn.sigmoid(gate_V))).astype(o_ref.dtype)


def fits(K: int, V: int, W: int) -> bool:
  """The kernel's shapes: K == V a power of two ≥ 16 (Triton tiles), a conv of width ≥ 2."""
  return K == V and K >= 16 and not K & (K - 1) and W >= 2


def decode_step(srcs, where, segment_ids_B, conv, params, state_BxHxKxV, *, lower_bound,
                eps, dtype, interpret=None):
  """One token of a KDA layer, from its input projections to what o_proj reads.

  srcs: the projections of x [B, N_i] (one fused array or six); where[name] = (index into
  srcs, first column) for each of PROJECTIONS. segment_ids_B: this token's ids (0 =
  padding). conv: {"q"|"k"|"v": (tail [B, W-1, H·K], kernel [W, H·K]), "seg": [B, W-1]}.
  params: f_b [K, H, K], A_log [H], dt_bias [H·K], g_b [K, H, V], g_b_bias [H, V] or None,
  o_norm [V]. Returns (o [B, H, V] in dtype, state, (q, k, v tails), seg tail).
  """
  B, H, K, V = state_BxHxKxV.shape
  W = conv["q"][1].shape[0]
  if not fits(K, V, 2):
    raise ValueError(f"the fused KDA decode step needs K == V, a power of two >= 16; got "
                     f"K={K}, V={V}")
  if not fits(K, V, W):
    raise ValueError(f"the fused KDA decode step needs a conv of width >= 2, got {W}")
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  has_bias = params["g_b_bias"] is not None
  seg_B = segment_ids_B.astype(jnp.int32)
  tails = tuple(conv[n][0] for n in "qkv")
  ins = (*srcs, seg_B, conv["seg"].astype(jnp.int32), *tails, *(conv[n][1] for n in "qkv"),
         params["f_b"], params["A_log"], params["dt_bias"], params["g_b"],
         *((params["g_b_bias"],) if has_bias else ()), params["o_norm"], state_BxHxKxV)
  whole = lambda x: pl.BlockSpec(x.shape, lambda b, h: (0,) * x.ndim)
  in_specs = [whole(x) for x in ins[:-1]]
  in_specs.append(pl.BlockSpec((None, None, K, V), lambda b, h: (b, h, 0, 0)))
  out_specs = [pl.BlockSpec((None, None, V), lambda b, h: (b, h, 0)),
               pl.BlockSpec((None, None, K, V), lambda b, h: (b, h, 0, 0)),
               *(whole(t) for t in tails), whole(conv["seg"])]
  out_shape = [jax.ShapeDtypeStruct((B, H, V), dtype),
               jax.ShapeDtypeStruct(state_BxHxKxV.shape, F32),
               *(jax.ShapeDtypeStruct(t.shape, t.dtype) for t in tails),
               jax.ShapeDtypeStruct(conv["seg"].shape, jnp.int32)]
  # Nothing in place. A program's 1-D blocks ([K] of a tail row) are replicated over its
  # 128-256 threads, and warps do not synchronize between a load and another warp's store
  # to the same address: written in place, one warp's new tail row (or state) could land
  # before another warp read the old one. On an H200 that race gave 2-34% errors in o and
  # the state, fp32 included, at some launch widths (benchmarks/gpu_tests.md); interpret
  # mode cannot show it. The outputs are new arrays, every element written once (the tails'
  # segment ids by program (b, 0), the rest by the program owning the columns).
  kernel = lambda *refs: _kernel(*refs, n_src=len(srcs), where=where, W=W, K=K,
                                 lower_bound=lower_bound, eps=eps, dtype=dtype,
                                 has_bias=has_bias)
  compiler_params = None if interpret else pltriton.CompilerParams(num_warps=num_warps(K),
                                                                   num_stages=1)
  o_BxHxV, S, *new_tails, seg_tail = pl.pallas_call(
      kernel, grid=(B, H), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      interpret=interpret, name="kda_decode_step",
      compiler_params=compiler_params,
  )(*ins[:-1], state_BxHxKxV.astype(F32))
  return o_BxHxV, S, tuple(new_tails), seg_tail.astype(conv["seg"].dtype)
