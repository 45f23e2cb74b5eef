"""Where pallas_gpu's KDA time goes: each kernel timed alone, under each launch width.

  python scripts/profile_kda_stages.py --shape=4x8192x16 --warps=1,2,4,8

Stage 1 kernels (tiles, solve, wu forward; wu_bwd, tiles_bwd backward) each at every
--warps, then at each --blocks column width rolled and unrolled; then stage 2 (the
recurrence forward; chunk states + backward kernels), with each --triton setting of
triton_gpu.py's kernels (the same three timings) beside it; then, with --xla, the XLA stage 1
and its VJP. --triton_tiles times triton_gpu's tiles backward (with wu_bwd's parts added in)
at each BLOCK_K/warps/stages beside Pallas's tiles backward plus XLA's add and cast, and
--triton_wu its W/U backward beside Pallas's.
--stage2_only skips stage 1's Pallas sweeps. Each number is the median of --iters runs after
a warm-up. --knobs=NAME=VALUE,... sets pallas_gpu knobs for the whole run.
"""

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from pallas_kernels.kda import pallas_gpu as P, prologue_gpu, reference
from scripts.bench_kda import inputs, set_knobs

_SHAPE = flags.DEFINE_string("shape", "1x8192x16", "BxTxH.")
_DIM = flags.DEFINE_integer("dim", 128, "K = V (long_context_1b's heads: 64).")
_WARPS = flags.DEFINE_list("warps", ["1", "2", "4", "8"], "num_warps values to try per kernel.")
_XLA = flags.DEFINE_bool("xla", False, "Also time the XLA stage 1 and its VJP.")
_BLOCKS = flags.DEFINE_list("blocks", [], "BLOCK_K values to try, each rolled and unrolled.")
_TRITON = flags.DEFINE_list("triton", [], "BLOCK_V/warps/stages settings of triton_gpu's "
                            "stage 2 to time beside Pallas's, e.g. 32/4/2,64/8/3 (stages: "
                            "the most tried; fewer where they do not fit in shared memory).")
_TRITON_TILES = flags.DEFINE_list("triton_tiles", [], "BLOCK_K/warps/stages settings of "
                                  "triton_gpu's tiles backward, e.g. 32/4/2,64/4/1.")
_TRITON_WU = flags.DEFINE_list("triton_wu", [], "BLOCK/warps/stages settings of triton_gpu's "
                                "W/U backward, timed beside pallas_gpu's.")
_STAGE2_ONLY = flags.DEFINE_bool("stage2_only", False, "Skip stage 1's Pallas sweeps and the "
                                 "prologue.")
_ITERS = flags.FLAGS["iters"]  # defined by bench_kda (median of this many runs)
_KNOBS = flags.FLAGS["knobs"]  # also bench_kda's: here, settings for the whole run


def median_ms(fn, *args):
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(_ITERS.value):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts) * 1e3


def timed(fn, *args):
  jax.clear_caches()   # the knobs are read while tracing: never reuse an earlier trace
  try:
    return f"{median_ms(jax.jit(fn), *args):.3f}"
  except Exception as e:  # a launch width the compiler rejects is a result, not a crash
    return f"error {type(e).__name__}: {str(e)[:120]}"


def prologue_time(q, k, g, inp, kw):
  """warps -> 'fwd ms / bwd ms' of the prologue kernels (bounded gate, q/k L2 norm)."""
  H, D = q.shape[2:]
  live = jnp.ones(q.shape[:2], jnp.int32)
  a_HK = jnp.broadcast_to(jnp.exp(jnp.asarray(inp["A_log"]))[:, None], (H, D))
  bias_HK = jnp.asarray(inp["dt_bias"]).reshape(H, D)
  f = jnp.asarray(g, jnp.bfloat16)
  args = (q, k, f, a_HK, bias_HK, live)
  call = lambda *a: prologue_gpu._prologue_call(
      *a, dtype=q.dtype, gate="bounded", lower_bound=-5.0, l2norm=True, **kw)
  bwd = lambda *a: prologue_gpu._prologue_bwd_call(
      *a, q, k, g, gate="bounded", lower_bound=-5.0, l2norm=True, **kw)

  def at(w):
    default, prologue_gpu.WARPS = prologue_gpu.WARPS, w
    try:
      return f"{timed(call, *args)} / {timed(bwd, *args)}"
    finally:
      prologue_gpu.WARPS = default
  return at


def stage1(run, kernels, q, k, g, inp, kw):
  """Each stage-1 kernel at every --warps and --blocks, then the prologue."""
  default = dict(P.WARPS)
  print(f"stage-1 kernels, ms at {_SHAPE.value}, K=V={q.shape[-1]}, bf16, C=64 (default "
        f"warps {default}, BLOCK_K {P.BLOCK_K}, ROLLED {P.ROLLED}):")
  for name in kernels:
    row = {}
    for w in map(int, _WARPS.value):
      P.WARPS[name] = w
      row[w] = run(name)
    P.WARPS[name] = default[name]
    ok = {w: float(t) for w, t in row.items() if not t.startswith("error")}
    best = min(ok, key=ok.get) if ok else None
    print(f"  {name:10s} " + " | ".join(f"warps {w}: {t}" for w, t in row.items())
          + f"  -> best {best}", flush=True)
  block_k, rolled = P.BLOCK_K, P.ROLLED
  for bk in map(int, _BLOCKS.value):
    for r in (True, False):
      P.BLOCK_K, P.ROLLED = bk, r
      print(f"  BLOCK_K {bk} ROLLED {r}: " + " | ".join(
          f"{name} {run(name)}" for name in ("tiles", "wu", "wu_bwd", "tiles_bwd")), flush=True)
  P.BLOCK_K, P.ROLLED = block_k, rolled
  pro = prologue_time(q, k, g, inp, kw)
  print("  prologue (gate, L2 norm, cumsum) fwd / bwd by warps: " + " | ".join(
      f"{w}: {pro(w)}" for w in map(int, _WARPS.value)), flush=True)


def stage2(st, B, H, D, Tp, kw):
  """The recurrence forward (without and with chunk states) and the states + backward
  kernels; each --triton setting of triton_gpu's forward beside Pallas's, with its largest
  difference from Pallas's output."""
  S0 = jnp.zeros((B, H, D, D), jnp.float32)
  do = jnp.ones((B, Tp, H, D), jnp.float32)

  def rec_bwd(st, S0, do):
    _, _, states = P._recurrence_call(st, S0, with_states=True, **kw)
    return P._recurrence_bwd_call(st, states, do, S0, **kw)

  rec = lambda st, S0: P._recurrence_call(st, S0, with_states=False, **kw)
  rec_st = lambda st, S0: P._recurrence_call(st, S0, with_states=True, **kw)
  print(f"  recurrence {timed(rec, st, S0)} | with states {timed(rec_st, st, S0)} | "
        f"recurrence states+bwd {timed(rec_bwd, st, S0, do)}", flush=True)
  if not _TRITON.value:
    return
  from pallas_kernels.kda import triton_gpu as TG
  ref = jax.jit(rec_st)(st, S0)
  knobs = (TG.BLOCK_V, TG.WARPS, TG.STAGES)
  for setting in _TRITON.value:
    TG.BLOCK_V, TG.WARPS, TG.STAGES = map(int, setting.split("/"))
    t_rec = timed(lambda st, S0: TG._recurrence_call(st, S0, with_states=False, **kw), st, S0)
    t_st = timed(lambda st, S0: TG._recurrence_call(st, S0, with_states=True, **kw), st, S0)

    def tg_bwd(st, S0, do):
      _, _, states = TG._recurrence_call(st, S0, with_states=True, **kw)
      return TG._recurrence_bwd_call(st, states, do, S0, **kw)

    t_bwd = timed(tg_bwd, st, S0, do)
    try:
      out = jax.jit(lambda st, S0: TG._recurrence_call(st, S0, with_states=True, **kw))(st, S0)
      err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                for a, b in zip(out, ref))
    except Exception as e:   # noqa: BLE001 — a failed setting is a result
      err = f"error {type(e).__name__}"
    print(f"  triton BLOCK_V {TG.BLOCK_V} warps {TG.WARPS} stages {TG.STAGES}: recurrence {t_rec} | "
          f"with states {t_st} | states+bwd {t_bwd} | max |Δ| vs Pallas {err}", flush=True)
  TG.BLOCK_V, TG.WARPS, TG.STAGES = knobs


def tiles_bwd_triton(q, k, G, seg, dA, dAqk, scale, kw):
  """Pallas's tiles backward + XLA adding wu_bwd's parts and casting dq, dk (what
  intra_bwd_pallas and the custom VJP do) against triton_gpu's one kernel, per setting."""
  from pallas_kernels.kda import triton_gpu as TG
  rng = np.random.default_rng(1)
  parts = [jnp.asarray(rng.normal(size=q.shape), jnp.float32) for _ in range(3)]

  def pallas(q, k, G, dA, dAqk, dq0, dk0, dG0):
    d = P.tiles_bwd_call(q, k, G, seg, dA, dAqk, scale=scale, **kw)
    return ((d[0] + dq0).astype(q.dtype), (d[1] + dk0).astype(k.dtype), d[2] + dG0)

  args = (q, k, G, dA, dAqk, *parts)
  ref = jax.jit(pallas)(*args)
  print(f"  tiles_bwd + parts, Pallas + XLA add/cast: {timed(pallas, *args)}", flush=True)
  knobs = (TG.TILES_BWD_BLOCK_K, TG.TILES_BWD_WARPS, TG.TILES_BWD_STAGES)
  for setting in _TRITON_TILES.value:
    TG.TILES_BWD_BLOCK_K, TG.TILES_BWD_WARPS, TG.TILES_BWD_STAGES = map(int, setting.split("/"))
    call = lambda q, k, G, dA, dAqk, *p: TG.tiles_bwd_call(q, k, G, seg, dA, dAqk, *p,
                                                          scale=scale, **kw)
    t = timed(call, *args)
    try:
      out = jax.jit(call)(*args)
      err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                for a, b in zip(out, ref))
    except Exception as e:   # noqa: BLE001 — a failed setting is a result
      err = f"error {type(e).__name__}"
    print(f"  triton tiles_bwd BLOCK_K {setting}: {t} | max |Δ| vs Pallas {err}", flush=True)
  TG.TILES_BWD_BLOCK_K, TG.TILES_BWD_WARPS, TG.TILES_BWD_STAGES = knobs


def wu_bwd_triton(Tinv, A, q, k, v, G, beta, seg, d_st, scale, kw):
  """pallas_gpu's W/U backward against triton_gpu's at each --triton_wu setting."""
  from pallas_kernels.kda import triton_gpu as TG
  args = (Tinv, A, q, k, v, G, beta, d_st)
  pallas = lambda *a: P.wu_bwd_call(*a[:-1], seg, a[-1], scale=scale, **kw)
  ref = jax.jit(pallas)(*args)
  print(f"  wu_bwd, Pallas: {timed(pallas, *args)}", flush=True)
  knobs = (TG.WU_BWD_BLOCK, TG.WU_BWD_WARPS, TG.WU_BWD_STAGES)
  for setting in _TRITON_WU.value:
    TG.WU_BWD_BLOCK, TG.WU_BWD_WARPS, TG.WU_BWD_STAGES = map(int, setting.split("/"))
    call = lambda *a: TG.wu_bwd_call(*a[:-1], seg, a[-1], scale=scale, **kw)
    t = timed(call, *args)
    try:
      out = jax.jit(call)(*args)
      err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                for a, b in zip(out, ref))
    except Exception as e:   # noqa: BLE001 — a failed setting is a result
      err = f"error {type(e).__name__}"
    print(f"  triton wu_bwd BLOCK {setting}: {t} | max |Δ| vs Pallas {err}", flush=True)
  TG.WU_BWD_BLOCK, TG.WU_BWD_WARPS, TG.WU_BWD_STAGES = knobs


def main(argv):
  del argv
  set_knobs(",".join(_KNOBS.value))   # e.g. --knobs=BLOCK_K=64
  B, T, H = map(int, _SHAPE.value.split("x"))
  D = _DIM.value
  inp = inputs(B, T, H, dim=D)
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)
  q, k, v, beta = bf(inp["q"]), bf(inp["k"]), bf(inp["v"]), jnp.asarray(inp["beta"])
  g = -5.0 * jax.nn.sigmoid(jnp.asarray(inp["x"]))
  C, scale = 64, D ** -0.5
  q, k, v, g, beta, reset = reference.prepare(q, k, v, g, beta, None, dtype=jnp.bfloat16)
  q, k, v, beta, G, seg = jax.jit(reference.chunk_layout, static_argnums=6)(
      q, k, v, g, beta, reset, C)
  interpret = jax.default_backend() != "gpu"   # CPU: a slow smoke run
  kw = dict(chunk_size=C, interpret=interpret)
  st, A, Tinv = jax.jit(lambda *a: P.intra_pallas(*a, scale=scale, **kw))(q, k, v, G, beta, seg)
  rng = np.random.default_rng(0)
  d_st = {n: jnp.asarray(rng.normal(size=x.shape), x.dtype) for n, x in st.items()}
  dA = P.wu_bwd_call(Tinv, A, q, k, v, G, beta, seg, d_st, scale=scale, **kw)[0]

  kernels = {  # name: (function, arguments): arrays go in as arguments, never closed over
      "tiles": (lambda q, k, G: P.tiles_call(q, k, G, seg, scale=scale, **kw), (q, k, G)),
      "solve": (lambda A, beta: P.solve_call(A, beta, **kw), (A, beta)),
      "wu": (lambda *a: P.wu_call(*a, seg, scale=scale, **kw), (Tinv, q, k, v, G, beta)),
      "wu_bwd": (lambda *a: P.wu_bwd_call(*a[:-1], seg, a[-1], scale=scale, **kw),
                 (Tinv, A, q, k, v, G, beta, d_st)),
      "tiles_bwd": (lambda q, k, G, dA, dAqk: P.tiles_bwd_call(q, k, G, seg, dA, dAqk,
                                                               scale=scale, **kw),
                    (q, k, G, dA, d_st["Aqk"])),
  }
  run = lambda name: timed(kernels[name][0], *kernels[name][1])
  if _TRITON_TILES.value:
    tiles_bwd_triton(q, k, G, seg, dA, d_st["Aqk"], scale, kw)
  if _TRITON_WU.value:
    wu_bwd_triton(Tinv, A, q, k, v, G, beta, seg, d_st, scale, kw)
  if not _STAGE2_ONLY.value:
    stage1(run, kernels, q, k, g, inp, kw)
  stage2(st, B, H, D, q.shape[1], kw)
  if _STAGE2_ONLY.value:
    return
  intra = lambda *a: P.intra_pallas(*a, seg, scale=scale, **kw)[0]

  def intra_bwd(q, k, v, G, beta, d_st):
    _, A, Tinv = P.intra_pallas(q, k, v, G, beta, seg, scale=scale, **kw)
    return P.intra_bwd_pallas(q, k, v, G, beta, seg, A, Tinv, d_st, scale=scale, **kw)

  args = (q, k, v, G, beta)
  print(f"  stage 1 at default warps: forward {timed(intra, *args)} | "
        f"forward+backward {timed(intra_bwd, *args, d_st)}", flush=True)
  if _XLA.value:
    xla = lambda *a: P._intra_xla(*a, seg, scale, C)

    def xla_vjp(q, k, v, G, beta, d_st):
      return jax.vjp(xla, q, k, v, G, beta)[1](d_st)

    print(f"  xla stage 1: forward {timed(xla, *args)} | vjp {timed(xla_vjp, *args, d_st)}")


if __name__ == "__main__":
  app.run(main)
