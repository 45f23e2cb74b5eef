"""Where pallas_gpu's KDA time goes: each stage timed alone, under a few kernel knobs
(fused or separate stage-1 kernels, warps, block sizes).

  python scripts/profile_kda_stages.py --shape=1x8192x16

Stages: stage-1 Pallas kernel (intra), recurrence forward, recurrence forward with
chunk states + backward kernel, and the XLA VJP of stage 1 used by the backward pass.
"""

import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from pallas_kernels.kda import pallas_gpu as P, reference
from scripts.bench_kda import inputs

_SHAPE = flags.DEFINE_string("shape", "1x8192x16", "BxTxH (K=V=128).")
_VARIANTS = flags.DEFINE_integer("variants", 3, "How many launch-knob sets to try (1 = defaults).")
_XLA = flags.DEFINE_bool("xla", True, "Also time the XLA stage 1 and its VJP.")
_ITERS = flags.FLAGS["iters"]  # defined by bench_kda (median of this many runs)


def median_ms(fn, *args):
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(_ITERS.value):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts) * 1e3


def main(argv):
  del argv
  B, T, H = map(int, _SHAPE.value.split("x"))
  inp = inputs(B, T, H)
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)
  q, k, v, beta = bf(inp["q"]), bf(inp["k"]), bf(inp["v"]), jnp.asarray(inp["beta"])
  g = -5.0 * jax.nn.sigmoid(jnp.asarray(inp["x"]))
  C, scale = 64, 128 ** -0.5
  q, k, v, g, beta, reset = reference.prepare(q, k, v, g, beta, None, dtype=jnp.bfloat16)
  q, k, v, beta, G, seg = jax.jit(reference.chunk_layout, static_argnums=6)(
      q, k, v, g, beta, reset, C)
  S0 = jnp.zeros((B, H, 128, 128), jnp.float32)
  rows = []
  knobs = [  # (fused stage 1, stage-1 warps, recurrence warps, BLOCK_V, BWD_BLOCK_K)
      (False, 4, 4, 32, 32), (True, 4, 4, 32, 32), (True, 4, 4, 32, 16), (True, 8, 4, 32, 32)]
  for fused, intra_warps, rec_warps, bv, bwd_bk in knobs[:_VARIANTS.value]:
    P.FUSED_INTRA, P.INTRA_WARPS, P.RECURRENCE_WARPS = fused, intra_warps, rec_warps
    P.BLOCK_V, P.BWD_BLOCK_K = bv, bwd_bk
    intra = jax.jit(lambda *a: P.intra_pallas(*a, scale=scale, chunk_size=C, interpret=False)[0])
    try:
      st = intra(q, k, v, G, beta, seg)
    except Exception as e:  # still time the recurrence on the XLA stage-1 outputs
      print(f"stage 1 failed ({type(e).__name__}: {str(e)[:300]}); recurrence on XLA's",
            flush=True)
      st = P._intra_xla(q, k, v, G, beta, seg, scale, C)
    rec = jax.jit(lambda st, S0: P._recurrence_call(st, S0, chunk_size=C, with_states=False,
                                                    interpret=False))
    do = jnp.ones((B, q.shape[1], H, 128), jnp.float32)

    def rec_bwd(st, S0, do):
      _, _, states = P._recurrence_call(st, S0, chunk_size=C, with_states=True, interpret=False)
      return P._recurrence_bwd_call(st, states, do, S0, chunk_size=C, interpret=False)

    def intra_bwd(q, k, v, G, beta, st):
      _, A, T = P.intra_pallas(q, k, v, G, beta, seg, scale=scale, chunk_size=C, interpret=False)
      return P.intra_bwd_pallas(q, k, v, G, beta, seg, A, T, st, scale=scale, chunk_size=C,
                                interpret=False)

    row = {"knobs": f"fused={fused} intra_warps={intra_warps} rec_warps={rec_warps} BV={bv} "
                    f"bwd_BK={bwd_bk}"}
    for name, fn, args in [("intra", intra, (q, k, v, G, beta, seg)),
                           ("intra fwd+bwd", jax.jit(intra_bwd), (q, k, v, G, beta, st)),
                           ("recurrence", rec, (st, S0)),
                           ("recurrence states+bwd", jax.jit(rec_bwd), (st, S0, do))]:
      try:
        row[name] = f"{median_ms(fn, *args):.3f}"
      except Exception as e:
        row[name] = f"error {type(e).__name__}: {str(e)[:200]}"
    rows.append(row)
    print(row, flush=True)

  def intra_vjp(q, k, v, G, beta, st):
    _, vjp = jax.vjp(lambda *a: P._intra_xla(*a, seg, scale, C), q, k, v, G, beta)
    return vjp(st)

  print(f"stage times in ms at {_SHAPE.value}, K=V=128, bf16, C=64:")
  for r in rows:
    print(" | ".join(f"{k}: {v}" for k, v in r.items()))
  if not _XLA.value:
    return
  print({"xla stage-1 forward": f"{median_ms(jax.jit(lambda *a: P._intra_xla(*a, seg, scale, C)), q, k, v, G, beta):.3f}",
         "xla stage-1 vjp (backward)": f"{median_ms(jax.jit(intra_vjp), q, k, v, G, beta, st):.3f}"})


if __name__ == "__main__":
  app.run(main)
