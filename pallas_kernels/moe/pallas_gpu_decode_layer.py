"""A whole MoE layer for a few tokens (decoding) in three Pallas kernels (Triton lowering on
GPU, `interpret=True` elsewhere): the router with its top-k, the routed and shared experts'
up-projections, and their down-projections summed with the combine weights.

Why: at batch 1 the decode step's time follows its kernel count (benchmarks/long_context.md),
and in XLA an MoE layer at decode is some fifteen kernels: the router's product, scores,
bias and top-k, the combine weights, the gathered experts, the shared expert's three
products and the sums. Here it is three, with the expert weights read as in
pallas_gpu_decode_experts.py (each assignment's tiles loaded directly, full bandwidth).

  route: grid (N,): logits = x · W_r (fp32 sums of router-dtype operands), scores (sigmoid or
         softmax), top-k of scores + bias (lowest index on ties, as lax.top_k), combine
         weights = the chosen scores renormalised × route_scale; idx and w [N, KP] (KP = k
         rounded up to a power of two; padding slots have weight 0)
  up:    grid (N·(k + S), F / cols, P): slot s < k of token t runs expert idx[t, s], slot k
         (S = 1 with one shared expert) the shared one; program p sums x · Wg and x · Wu
         over its part of D (`up_tiles`) into fp32 partials g, u [N·(k + S), P, F]
  down:  grid (N, D / cols, (k + S) · F / rows), one slot and one block of F rows a
         program: a = silu(Σ_p g) ⊙ Σ_p u for those rows (rounded to x's dtype), then
         part = w[t, s] · a · Wd[idx[t, s]][rows] (the shared slot: weight 1), fp32;
         y[t] = Σ part over slots and row blocks (an XLA sum, fused with its consumer)

At batch 1 a program is latency-bound: its time is its dependent loop steps, and the
kernel's is how many bytes its programs have in flight. So each program reads one or a
few wide tiles and the sums over the contracted dims are split across programs and
finished by the next kernel: long_context_1b's 1024 × 704 experts take 880 up programs of
one step and 440 down programs of one step, where programs that looped over the whole
contracted dim took 4 and 11 steps and ran at 0.97 and 0.57 TB/s (H100,
benchmarks/decode.md).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.moe import pallas_gpu_decode_experts as experts

F32 = jnp.float32
MAX_ROWS = 256      # router rows the route kernel reads a loop step, at most
TILE_BUDGET = 8192  # fp32 elements a program holds of a step's weight tiles (64 registers a
                    # thread at 4 warps)
MAX_SPLITS = 16     # parts of D the up kernel's programs sum separately, at most
NUM_WARPS = 4


def fits(D: int, F: int, E: int) -> bool:
  """D and F in whole 64-row steps and column tiles; E a power of two (the scores are one
  Triton vector)."""
  return experts.fits(D, F) and E >= 1 and E & (E - 1) == 0


def _pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def rows(n: int, cols: int) -> int:
  """Rows a route-kernel step reads of a router whose contracted dim is n: the largest power
  of two ≤ MAX_ROWS dividing n with a [rows, cols] fp32 tile within TILE_BUDGET (at least
  16, Triton's smallest tile side; n is a multiple of 64, as `fits` asks)."""
  r = MAX_ROWS
  while r > 16 and (n % r or r * cols > TILE_BUDGET):
    r //= 2
  return r


def route_steps(W: int, E: int) -> int:
  """Dependent loop steps of the route kernel's one program a token: W rows of the [W, E]
  router read `rows(W, E)` at a time (4 at long_context_1b's 1024 × 32; 72 at Kimi
  Linear's 2304 × 256, where the whole router is 2.4 MB in fp32)."""
  return W // rows(W, E)


def _route_kernel(x_ref, w_ref, bias_ref, idx_ref, wt_ref, *, k, score, route_scale, dtype):
  W, E = w_ref.shape
  KP = idx_ref.shape[-1]
  t = pl.program_id(0)
  rnd = lambda a: a.astype(dtype).astype(F32)
  R = rows(W, E)

  def step(i, acc_E):
    block = pl.ds(pl.multiple_of(i * R, R), R)
    return acc_E + jnp.sum(rnd(x_ref[t, block].astype(F32))[:, None]
                           * rnd(w_ref[block, :].astype(F32)), axis=0)

  logits_E = jax.lax.fori_loop(0, W // R, step, jnp.zeros((E,), F32))
  if score == "sigmoid":
    scores_E = jax.nn.sigmoid(logits_E)
  else:
    scores_E = jnp.exp(logits_E - jnp.max(logits_E))
    scores_E = scores_E / jnp.sum(scores_E)
  sel_E = scores_E + bias_ref[...].astype(F32)
  iota_E = jax.lax.broadcasted_iota(jnp.int32, (E,), 0)
  iota_K = jax.lax.broadcasted_iota(jnp.int32, (KP,), 0)
  idx_K = jnp.zeros((KP,), jnp.int32)
  chosen_K = jnp.full((KP,), -jnp.inf, F32)
  for j in range(k):
    best = jnp.max(sel_E)
    i = jnp.min(jnp.where(sel_E == best, iota_E, E))
    hit_E = iota_E == i
    logit = jnp.sum(jnp.where(hit_E, logits_E, 0.0))
    idx_K = jnp.where(iota_K == j, i, idx_K)
    chosen_K = jnp.where(iota_K == j, logit, chosen_K)
    sel_E = jnp.where(hit_E, -jnp.inf, sel_E)
  # router.combine_weights: a softmax over the k of log σ(l) (sigmoid) or of l (softmax).
  live_K = iota_K < k
  log_s_K = jax.nn.log_sigmoid(chosen_K) if score == "sigmoid" else chosen_K
  log_s_K = jnp.where(live_K, log_s_K, -jnp.inf)
  p_K = jnp.where(live_K, jnp.exp(log_s_K - jnp.max(log_s_K)), 0.0)
  idx_ref[t, :] = idx_K
  wt_ref[t, :] = p_K / jnp.sum(p_K) * route_scale


def route(x_NxW, kernel_WxE, bias_E, top_k: int, score: str, route_scale: float, dtype,
          *, interpret=None):
  """(expert ids [N, KP] int32, combine weights [N, KP] fp32), KP = top_k rounded up to a
  power of two: slot j < top_k as router.select gives them; the rest weigh 0. `dtype`: the
  router's operand dtype (model.moe.router_dtype, resolved)."""
  N, W = x_NxW.shape
  E = kernel_WxE.shape[1]
  KP = _pow2(top_k)
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  whole = lambda shape: pl.BlockSpec(shape, lambda t: (0,) * len(shape))
  params = None if interpret else pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=2)
  return pl.pallas_call(
      functools.partial(_route_kernel, k=top_k, score=score, route_scale=route_scale,
                        dtype=dtype),
      grid=(N,), in_specs=[whole((N, W)), whole((W, E)), whole((E,))],
      out_specs=[whole((N, KP)), whole((N, KP))],
      out_shape=[jax.ShapeDtypeStruct((N, KP), jnp.int32), jax.ShapeDtypeStruct((N, KP), F32)],
      interpret=interpret, name="decode_moe_route", compiler_params=params,
  )(x_NxW, kernel_WxE, bias_E)


def up_tiles(D: int, F: int) -> tuple[int, int, int]:
  """(rows, columns, splits) of the up kernel: a program reads `rows` × `columns` of gate
  and of up (within TILE_BUDGET), `D / rows / splits` loop steps of them, and writes partial
  sums for one of `splits` parts of D (the largest power of two ≤ MAX_SPLITS dividing the
  row blocks: the down kernel reads the parts as one [splits, rows] tile). F is a
  multiple of 64 (`fits`): 64 columns, 128 bytes of bf16 a row."""
  cols = 64
  r = TILE_BUDGET // (2 * cols)
  while D % r:
    r //= 2
  blocks, splits = D // r, 1
  while splits < MAX_SPLITS and blocks % (2 * splits) == 0:
    splits *= 2
  return r, cols, splits


def down_tiles(D: int, F: int) -> tuple[int, int]:
  """(rows, columns) a down program reads in one step: the widest columns of 256, 128, 64
  dividing D, and as many rows of F as TILE_BUDGET allows (F is a multiple of 64)."""
  cols = next(c for c in (256, 128, 64) if D % c == 0)
  r = TILE_BUDGET // cols
  while F % r:
    r //= 2
  return r, cols


def _up_kernel(idx_ref, x_ref, gu_ref, *shared_and_out, k, slots, rows, cols, steps):
  g_ref, u_ref = shared_and_out[-2:]
  a, j, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  t, s = a // slots, a % slots
  cs = pl.ds(j * cols, cols)
  zeros = jnp.zeros((cols,), F32)

  def product(gate_rows, up_rows):
    def step(i, acc):
      block = pl.ds(pl.multiple_of((p * steps + i) * rows, rows), rows)
      x_R = x_ref[t, block]
      return (acc[0] + experts.row_times(x_R, gate_rows(block)),
              acc[1] + experts.row_times(x_R, up_rows(block)))
    return jax.lax.fori_loop(0, steps, step, (zeros, zeros))

  def routed():
    e = idx_ref[t, jnp.minimum(s, k - 1)]
    return product(lambda b: gu_ref[e, b, 0, cs], lambda b: gu_ref[e, b, 1, cs])

  if len(shared_and_out) == 2:
    g_C, u_C = routed()
  else:
    sg_ref, su_ref = shared_and_out[:2]
    g_C, u_C = jax.lax.cond(s < k, routed,
                            lambda: product(lambda b: sg_ref[b, cs], lambda b: su_ref[b, cs]))
  g_ref[...] = g_C
  u_ref[...] = u_C


def _down_kernel(idx_ref, wt_ref, g_ref, u_ref, dn_ref, *shared_and_out, k, slots, parts,
                 rows, cols, dtype):
  part_ref = shared_and_out[-1]
  t, j, q = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  s, f = q // parts, q % parts
  block, cs = pl.ds(f * rows, rows), pl.ds(j * cols, cols)
  # The up kernel's partial sums over D for these rows of F, summed; SwiGLU rounded to the
  # model's dtype, as the XLA path's activations are.
  g_R = jnp.sum(g_ref[t * slots + s, :, block], axis=0)
  u_R = jnp.sum(u_ref[t * slots + s, :, block], axis=0)
  a_R = (jax.nn.silu(g_R) * u_R).astype(dtype)

  def routed():
    slot = jnp.minimum(s, k - 1)
    return wt_ref[t, slot] * experts.row_times(a_R, dn_ref[idx_ref[t, slot], block, cs])

  if len(shared_and_out) == 1:
    part_ref[...] = routed()
  else:
    sd_ref = shared_and_out[0]
    part_ref[...] = jax.lax.cond(s < k, routed,
                                 lambda: experts.row_times(a_R, sd_ref[block, cs]))


def moe_layer(x_NxD, idx_NxKP, w_NxKP, top_k: int, gate_up_ExDx2xF, down_ExFxD, shared=None,
              *, interpret=None):
  """y [N, D] in x's dtype: Σ_j w[n, j] · SwiGLU_{idx[n, j]}(x_n) over the first top_k slots,
  plus the shared expert's SwiGLU(x_n) when `shared` = (gate [D, F], up [D, F], down [F, D])
  is given (one shared expert, as wide as a routed one). Weights in any float dtype, rounded
  to x's in the kernels; fp32 sums; the SwiGLU activations rounded to x's dtype, as the XLA
  path's are."""
  N, D = x_NxD.shape
  E, _, _, F = gate_up_ExDx2xF.shape
  if not fits(D, F, E):
    raise ValueError(f"the fused MoE decode layer needs D % 64 == 0, F % 64 == 0 and E a "
                     f"power of two; got D={D}, F={F}, E={E}")
  if shared is not None and shared[0].shape != (D, F):
    raise ValueError(f"the fused MoE decode layer takes one shared expert as wide as a routed "
                     f"one, [D, F] = {(D, F)}; got {shared[0].shape}")
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  slots = top_k + (shared is not None)
  dtype = x_NxD.dtype
  A = N * slots
  rows_u, cols_u, splits = up_tiles(D, F)
  rows_d, cols_d = down_tiles(D, F)
  parts = F // rows_d
  params = None if interpret else pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=2)
  whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
  up_in = (idx_NxKP, x_NxD, gate_up_ExDx2xF) + (tuple(shared[:2]) if shared is not None else ())
  partial = pl.BlockSpec((None, None, cols_u), lambda a, j, p: (a, p, j))
  g_AxPxF, u_AxPxF = pl.pallas_call(
      functools.partial(_up_kernel, k=top_k, slots=slots, rows=rows_u, cols=cols_u,
                        steps=D // rows_u // splits),
      grid=(A, F // cols_u, splits), in_specs=[whole(x) for x in up_in],
      out_specs=[partial, partial],
      out_shape=[jax.ShapeDtypeStruct((A, splits, F), F32)] * 2,
      interpret=interpret, name="decode_moe_up", compiler_params=params,
  )(*up_in)
  down_in = ((idx_NxKP, w_NxKP, g_AxPxF, u_AxPxF, down_ExFxD)
             + ((shared[2],) if shared is not None else ()))
  part_NxQxD = pl.pallas_call(
      functools.partial(_down_kernel, k=top_k, slots=slots, parts=parts, rows=rows_d,
                        cols=cols_d, dtype=dtype),
      grid=(N, D // cols_d, slots * parts), in_specs=[whole(x) for x in down_in],
      out_specs=pl.BlockSpec((None, None, cols_d), lambda t, j, q: (t, q, j)),
      out_shape=jax.ShapeDtypeStruct((N, slots * parts, D), F32),
      interpret=interpret, name="decode_moe_down", compiler_params=params,
  )(*down_in)
  return jnp.sum(part_NxQxD, axis=1).astype(dtype)
