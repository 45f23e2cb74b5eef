"""Where pallas_gpu's KDA time goes: each kernel timed alone, under each launch width.

  python -m benchmarks.profile_kda_stages --shape=4x8192x16 --warps=1,2,4,8

Stage 1 kernels (tiles, solve, wu forward; wu_bwd, tiles_bwd backward) each at every
--warps, then at each --blocks column width rolled and unrolled; then stage 2 (the
recurrence forward; chunk states + backward kernels), with each --triton setting of
triton_gpu.py's kernels (the same three timings) beside it; then, with --xla, the XLA stage 1
and its VJP. --triton_stage1 times triton_gpu's stage-1 kernels at the given
BLOCK/warps/stages beside pallas_gpu's (first, before the rest).
--stage2_only skips stage 1's Pallas sweeps; --prologue_only times only the prologue
kernels, Pallas's and prologue_triton's. Each number is the median of --iters runs after
a warm-up. --knobs=NAME=VALUE,... sets pallas_gpu knobs for the whole run.
"""

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from pallas_kernels.kda import pallas_gpu as P, pallas_gpu_prologue as prologue_gpu, reference
from benchmarks.bench_kda import inputs, set_knobs

_SHAPE = flags.DEFINE_string("shape", "1x8192x16", "BxTxH.")
_DIM = flags.DEFINE_integer("dim", 128, "K = V (long_context_1b's heads: 64).")
_WARPS = flags.DEFINE_list("warps", ["1", "2", "4", "8"], "num_warps values to try per kernel.")
_XLA = flags.DEFINE_bool("xla", False, "Also time the XLA stage 1 and its VJP.")
_BLOCKS = flags.DEFINE_list("blocks", [], "BLOCK_K values to try, each rolled and unrolled.")
_TRITON = flags.DEFINE_list("triton", [], "BLOCK_V/warps/stages settings of triton_gpu's "
                            "stage 2 to time beside Pallas's, e.g. 32/4/2,64/8/3 (stages: "
                            "the most tried; fewer where they do not fit in shared memory).")
_TRITON_STAGE1 = flags.DEFINE_list("triton_stage1", [], "KERNEL:BLOCK/warps/stages settings "
                                   "of triton_gpu's stage-1 kernels (tiles, wu, wu_bwd, "
                                   "tiles_bwd) to time beside pallas_gpu's, e.g. "
                                   "tiles_bwd:64/4/2,wu:32/4/2; tiles:tile/4/2 is the tile-by-tile "
                                   "tiles kernel (TILES_BY_TILE), wu:32/4/2/low the W/U "
                                   "forward's dots on bf16 operands (WU_LOW_DOTS).")
_STAGE2_ONLY = flags.DEFINE_bool("stage2_only", False, "Skip stage 1's Pallas sweeps and the "
                                 "prologue.")
_PROLOGUE_ONLY = flags.DEFINE_bool("prologue_only", False, "Only the prologue kernels: "
                                   "Pallas's and prologue_triton's at each --warps.")
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


def prologue_time(q, k, g, inp, kw, triton=False):
  """warps -> 'fwd ms / bwd ms' of the prologue kernels (bounded gate, q/k L2 norm):
  prologue_gpu's Pallas kernels, or with `triton` prologue_triton's (both at these warps),
  then the largest difference of their outputs from Pallas's at its default warps."""
  H, D = q.shape[2:]
  live = jnp.ones(q.shape[:2], jnp.int32)
  a_HK = jnp.broadcast_to(jnp.exp(jnp.asarray(inp["A_log"]))[:, None], (H, D))
  bias_HK = jnp.asarray(inp["dt_bias"]).reshape(H, D)
  f = jnp.asarray(g, jnp.bfloat16)
  args = (q, k, f, a_HK, bias_HK, live)
  if triton:
    from pallas_kernels.kda import triton_gpu_prologue as prologue_triton, triton_gpu as module
    fwd_call, bwd_call = prologue_triton.prologue_call, prologue_triton.prologue_bwd_call
    knobs = ("PROLOGUE_WARPS", "PROLOGUE_BWD_WARPS")
  else:
    module, knobs = prologue_gpu, ("WARPS",)
    fwd_call, bwd_call = prologue_gpu._prologue_call, prologue_gpu._prologue_bwd_call
  gate = dict(gate="bounded", lower_bound=-5.0, l2norm=True, **kw)
  call = lambda *a: fwd_call(*a, dtype=q.dtype, **gate)
  bwd = lambda *a: bwd_call(*a, q, k, g, **gate)
  if triton:    # Pallas's outputs at its default warps, once for every warps setting
    reference = jax.tree.leaves(jax.jit(lambda *a: (
        prologue_gpu._prologue_call(*a, dtype=q.dtype, **gate),
        prologue_gpu._prologue_bwd_call(*a, q, k, g, **gate)))(*args))

  def at(w):
    defaults = [getattr(module, n) for n in knobs]
    for n in knobs:
      setattr(module, n, w)
    try:
      times = f"{timed(call, *args)} / {timed(bwd, *args)}"
      if not triton:
        return times
      out = jax.jit(lambda *a: (call(*a), bwd(*a)))(*args)
      err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                for a, b in zip(jax.tree.leaves(out), reference))
      return f"{times} (max |Δ| vs Pallas {err:.2g})"
    finally:
      for n, value in zip(knobs, defaults):
        setattr(module, n, value)
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


# triton_gpu's stage-1 kernels: --triton_stage1 name -> their knobs (BLOCK, warps, stages).
TRITON_KNOBS = {"tiles": ("TILES_BLOCK_K", "TILES_WARPS", "TILES_STAGES"),
                "wu": ("WU_BLOCK", "WU_WARPS", "WU_STAGES"),
                "wu_bwd": ("WU_BWD_BLOCK", "WU_BWD_WARPS", "WU_BWD_STAGES"),
                "tiles_bwd": ("TILES_BWD_BLOCK_K", "TILES_BWD_WARPS", "TILES_BWD_STAGES")}


def triton_stage1(kernels, seg, scale, kw):
  """Each --triton_stage1 setting of triton_gpu's stage-1 kernel beside pallas_gpu's, with
  its largest difference from Pallas's outputs. The tiles backward adds wu_bwd's parts and
  casts dq, dk in the kernel: its Pallas row includes XLA's add and cast."""
  from pallas_kernels.kda import triton_gpu as TG
  tiles_bwd, tiles_bwd_args = kernels["tiles_bwd"]
  rng = np.random.default_rng(1)
  parts = tuple(jnp.asarray(rng.normal(size=tiles_bwd_args[0].shape), jnp.float32)
                for _ in range(3))

  def pallas_tiles_bwd(q, k, G, dA, dAqk, *p):
    d = tiles_bwd(q, k, G, dA, dAqk)
    return ((d[0] + p[0]).astype(q.dtype), (d[1] + p[1]).astype(k.dtype), d[2] + p[2])

  ours = {"tiles": (lambda q, k, G: TG.tiles_call(q, k, G, seg, scale=scale, **kw)),
          "wu": (lambda *a: TG.wu_call(*a, seg, scale=scale, **kw)),
          "wu_bwd": (lambda *a: TG.wu_bwd_call(*a[:-1], seg, a[-1], scale=scale, **kw)),
          "tiles_bwd": (lambda q, k, G, dA, dAqk, *p: TG.tiles_bwd_call(
              q, k, G, seg, dA, dAqk, *p, scale=scale, **kw))}
  theirs = {n: kernels[n] for n in ours}
  theirs["tiles_bwd"] = (pallas_tiles_bwd, (*tiles_bwd_args, *parts))
  by_name = {}
  for setting in _TRITON_STAGE1.value:
    name, knobs = setting.split(":")
    by_name.setdefault(name, []).append(knobs)
  for name, settings in by_name.items():
    fn, args = theirs[name]
    ref = jax.jit(fn)(*args)
    print(f"  {name}, Pallas: {timed(fn, *args)}", flush=True)
    default = [getattr(TG, k) for k in TRITON_KNOBS[name]]
    by_tile, low = TG.TILES_BY_TILE, TG.WU_LOW_DOTS
    for knobs in settings:
      values = knobs.split("/")
      TG.TILES_BY_TILE = values[0] == "tile"   # tiles:tile/w/s, the tile-by-tile kernel
      TG.WU_LOW_DOTS = values[3:] == ["low"]   # wu:B/w/s/low, its dots on bf16 operands
      for k, value in zip(TRITON_KNOBS[name], values[:3]):
        if value != "tile":
          setattr(TG, k, int(value))
      t = timed(ours[name], *args)
      try:
        out = jax.jit(ours[name])(*args)
        err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)))
      except Exception as e:   # noqa: BLE001 — a failed setting is a result
        err = f"error {type(e).__name__}"
      print(f"  triton {name} {knobs}: {t} | max |Δ| vs Pallas {err}", flush=True)
    for k, value in zip(TRITON_KNOBS[name], default):
      setattr(TG, k, value)
    TG.TILES_BY_TILE, TG.WU_LOW_DOTS = by_tile, low


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
  if _PROLOGUE_ONLY.value:
    for name, triton in (("Triton", True), ("Pallas", False)):
      pro = prologue_time(q, k, g, inp, kw, triton=triton)
      print(f"prologue {name}, {_SHAPE.value}, K={D}, fwd / bwd ms by warps: " + " | ".join(
          f"{w}: {pro(w)}" for w in map(int, _WARPS.value)), flush=True)
    return
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
  if _TRITON_STAGE1.value:
    triton_stage1(kernels, seg, scale, kw)
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
