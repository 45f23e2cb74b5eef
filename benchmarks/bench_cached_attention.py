"""The attention kernels over a cache, Pallas vs the XLA block loops (attention/xla_cached.py).

  python -m benchmarks.bench_cached_attention [--filled=8192,65536,262144] [--out=$OUT]
  python -m benchmarks.bench_cached_attention --decode [--filled=65536,262144,1048576]

Prefill (default):
One prefill chunk of T queries (the last T of `filled` positions) against a cache of
--cache positions, 16 heads of 64, bf16, batch 1: the shape of configs/long_context_1b.py's
MLA layers. FLOPs count the visible (causal) scores only: 2·(Dqk+Dv)·H·visible pairs.

--decode: one new token's 16 heads in the latent space (R = 256, k_b absorbed) over a cache
filled to each length, batch --batches: the split-cache kernel (pallas_gpu_latent_decode.py)
vs the XLA online softmax, against the byte floor (the filled latents read once, 4.3 TB/s).
"""

import json
import os

import jax
import jax.numpy as jnp
from absl import app, flags

from benchmarks.timing import median_ms
from pallas_kernels.attention import pallas_gpu_cached as ca
from pallas_kernels.attention import pallas_gpu_latent_decode as ld
from pallas_kernels.attention import xla_cached

_FILLED = flags.DEFINE_string("filled", "8192,65536,262144", "Filled cache lengths.")
_T = flags.DEFINE_integer("chunk", 8192, "Queries per call (the prefill chunk).")
_S = flags.DEFINE_integer("cache", 1 << 20, "Preallocated cache positions.")
_ITERS = flags.DEFINE_integer("iters", 10, "Timed runs (median).")
_OUT = flags.DEFINE_string("out", None, "Folder for the JSON results.")
_DECODE = flags.DEFINE_bool("decode", False, "Time the decode kernel instead (see above).")
_BATCHES = flags.DEFINE_string("batches", "1,8", "Batch sizes for --decode.")
PEAK_TFLOPS = 762.0  # bf16 dense matmul through JAX on the H200 (shared/device/README.md)
PEAK_TBS = 4.3       # device copy, read+write (shared/device/README.md)


def xla_loop(q_BxTxHxD, kv_BxSx2HD, q_start_B, kv_len_B):
  """The XLA online-softmax loop (attention/xla_cached.py) over the same K/V, given as one
  [B, S, 2·H·D] array (the loop slices one array along S)."""
  B, T, H, D = q_BxTxHxD.shape
  pos_BxT = q_start_B[:, None] + jnp.arange(T)
  keys = lambda c: c[..., :H * D].reshape(B, -1, H, D)
  values = lambda c: c[..., H * D:].reshape(B, -1, H, D)
  return xla_cached.online_softmax(q_BxTxHxD, kv_BxSx2HD, keys, values, pos_BxT, kv_len_B,
                                   min(xla_cached.KEY_BLOCK, kv_BxSx2HD.shape[1]))


def save(name, rows, knobs):
  if _OUT.value:
    os.makedirs(_OUT.value, exist_ok=True)
    with open(os.path.join(_OUT.value, name), "w") as f:
      json.dump({"rows": rows, "device": str(jax.devices()[0]), "knobs": knobs}, f, indent=2)


def decode_main():
  H, R = 16, 256
  rows = []
  for B in (int(x) for x in _BATCHES.value.split(",")):
    for L in (int(x) for x in _FILLED.value.split(",")):
      keys = jax.random.split(jax.random.key(L), 2)
      q = jax.random.normal(keys[0], (B, 1, H, R), jnp.bfloat16) * R ** -0.5
      c = jax.random.normal(keys[1], (B, _S.value, R), jnp.bfloat16)
      pos, kv_len = jnp.full((B, 1), L - 1), jnp.full((B,), L)
      pallas = jax.jit(lambda q, c, pos, n: ld.latent_decode_attention(
          q.reshape(B, H, R), c, jnp.repeat(pos, H, axis=1), n))
      block = min(_S.value, max(xla_cached.KEY_BLOCK, min(xla_cached.MAX_KEY_BLOCK,
                                                          xla_cached.SCORE_BUDGET // (B * H))))
      xla = jax.jit(lambda q, c, pos, n: xla_cached.online_softmax(
          q, c, lambda x: x, lambda x: x, pos, n, block).reshape(B, H, R))
      ref = xla(q, c, pos, kv_len).astype(jnp.float32)
      err = float(jnp.linalg.norm(pallas(q, c, pos, kv_len) - ref) / jnp.linalg.norm(ref))
      row = {"batch": B, "filled": L, "rel_err": err, "floor_ms": B * L * R * 2 / PEAK_TBS / 1e9}
      for name, fn in (("pallas", pallas), ("xla", xla)):
        row[f"{name}_ms"] = median_ms(fn, (q, c, pos, kv_len), _ITERS.value)
      rows.append(row)
      print(row, flush=True)
      del c
  save("bench_latent_decode.json", rows, [ld.CHUNK, ld.BLOCK_K, ld.NUM_WARPS, ld.NUM_STAGES])
  print(f"\n{jax.devices()[0]}; decode: 1 token × {H} heads, latent R={R}, bf16, cache {_S.value}")
  print("| batch | filled | pallas ms | % of byte floor | xla ms | speed-up | rel err |")
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['batch']} | {r['filled']} | {r['pallas_ms']:.3f} | "
          f"{100 * r['floor_ms'] / r['pallas_ms']:.0f}% | {r['xla_ms']:.3f} | "
          f"{r['xla_ms'] / r['pallas_ms']:.1f}× | {r['rel_err']:.1e} |")


def main(argv):
  del argv
  if _DECODE.value:
    return decode_main()
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
  save("bench_cached_attention.json", rows, [ca.BLOCK_Q, ca.BLOCK_K, ca.NUM_WARPS, ca.NUM_STAGES])
  print(f"\n{jax.devices()[0]}; T={T} queries, H={H}, D={D}, bf16, cache {S}")
  print("| filled | pallas ms | TFLOP/s | % of 762 | xla loop ms | TFLOP/s | speed-up | rel err |")
  print("|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['filled']} | {r['pallas_ms']:.2f} | {r['pallas_tflops']:.0f} | "
          f"{100 * r['pallas_tflops'] / PEAK_TFLOPS:.0f}% | {r['xla_ms']:.2f} | "
          f"{r['xla_tflops']:.0f} | {r['xla_ms'] / r['pallas_ms']:.1f}× | {r['rel_err']:.1e} |")


if __name__ == "__main__":
  app.run(main)
