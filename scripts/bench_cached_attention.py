"""The prefill attention kernel over a cache: Pallas flash kernel vs the XLA block loop.

  python scripts/bench_cached_attention.py [--filled=8192,65536,262144] [--out=$OUT]

One prefill chunk of T queries (the last T of `filled` positions) against a cache of
--cache positions, 16 heads of 64, bf16, batch 1: the shape of configs/long_context_1b.py's
MLA layers. FLOPs count the visible (causal) scores only: 2·(Dqk+Dv)·H·visible pairs.
"""

import json
import os

import jax
import jax.numpy as jnp
from absl import app, flags

from moe_jax.model import mla
from pallas_kernels.attention import cached_attention as ca
from scripts.timing import median_ms

_FILLED = flags.DEFINE_string("filled", "8192,65536,262144", "Filled cache lengths.")
_T = flags.DEFINE_integer("chunk", 8192, "Queries per call (the prefill chunk).")
_S = flags.DEFINE_integer("cache", 1 << 20, "Preallocated cache positions.")
_ITERS = flags.DEFINE_integer("iters", 10, "Timed runs (median).")
_OUT = flags.DEFINE_string("out", None, "Folder for the JSON results.")
PEAK_TFLOPS = 762.0  # bf16 dense matmul through JAX on the H200 (shared/device/README.md)


def xla_loop(q_BxTxHxD, kv_BxSx2HD, q_start_B, kv_len_B):
  """The XLA online-softmax loop of model/mla.py over the same K/V, given as one
  [B, S, 2·H·D] array (the loop slices one array along S)."""
  B, T, H, D = q_BxTxHxD.shape
  pos_BxT = q_start_B[:, None] + jnp.arange(T)
  keys = lambda c: c[..., :H * D].reshape(B, -1, H, D)
  values = lambda c: c[..., H * D:].reshape(B, -1, H, D)
  return mla._online_softmax(q_BxTxHxD, kv_BxSx2HD, keys, values, pos_BxT, kv_len_B,
                             min(mla.KEY_BLOCK, kv_BxSx2HD.shape[1]))


def main(argv):
  del argv
  H, D, T, S = 16, 64, _T.value, _S.value
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (1, T, H, D), jnp.bfloat16) * D ** -0.5
  k = jax.random.normal(keys[1], (1, S, H, D), jnp.bfloat16)
  v = jax.random.normal(keys[2], (1, S, H, D), jnp.bfloat16)
  kv = jnp.concatenate([k.reshape(1, S, -1), v.reshape(1, S, -1)], -1)
  pallas = jax.jit(lambda *a: ca.cached_attention(*a, scale=1.0))
  xla = jax.jit(xla_loop)
  rows = []
  for L in (int(x) for x in _FILLED.value.split(",")):
    q_start, kv_len = jnp.array([L - T]), jnp.array([L])
    pairs = T * (L - T) + T * (T + 1) / 2
    flops = 2 * 2 * D * H * pairs
    row = {"filled": L, "chunk": T}
    ref = xla(q, kv, q_start, kv_len).astype(jnp.float32)
    err = float(jnp.linalg.norm(pallas(q, k, v, q_start, kv_len).astype(jnp.float32) - ref)
                / jnp.linalg.norm(ref))
    for name, fn, args in (("pallas", pallas, (q, k, v, q_start, kv_len)),
                           ("xla", xla, (q, kv, q_start, kv_len))):
      ms = median_ms(fn, args, _ITERS.value)
      row[f"{name}_ms"], row[f"{name}_tflops"] = ms, flops / ms / 1e9
    row["rel_err"] = err
    rows.append(row)
    print(row, flush=True)
  if _OUT.value:
    os.makedirs(_OUT.value, exist_ok=True)
    with open(os.path.join(_OUT.value, "bench_cached_attention.json"), "w") as f:
      json.dump({"rows": rows, "device": str(jax.devices()[0]),
                 "knobs": [ca.BLOCK_Q, ca.BLOCK_K, ca.NUM_WARPS, ca.NUM_STAGES]}, f, indent=2)
  print(f"\n{jax.devices()[0]}; T={T} queries, H={H}, D={D}, bf16, cache {S}")
  print("| filled | pallas ms | TFLOP/s | % of 762 | xla loop ms | TFLOP/s | speed-up | rel err |")
  print("|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['filled']} | {r['pallas_ms']:.2f} | {r['pallas_tflops']:.0f} | "
          f"{100 * r['pallas_tflops'] / PEAK_TFLOPS:.0f}% | {r['xla_ms']:.2f} | "
          f"{r['xla_tflops']:.0f} | {r['xla_ms'] / r['pallas_ms']:.1f}× | {r['rel_err']:.1e} |")


if __name__ == "__main__":
  app.run(main)
