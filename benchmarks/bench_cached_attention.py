"""The attention kernels over a cache, Pallas vs the XLA block loops (attention/xla_cached.py).

  python -m benchmarks.bench_cached_attention [--filled=8192,65536,262144] [--out=$OUT]
  python -m benchmarks.bench_cached_attention --decode [--filled=65536,262144,1048576]

Prefill (default):
One prefill chunk of T queries (the last T of `filled` positions) against a cache of
--cache positions, --heads heads of --dqk query/key and --dv value dims (16 of 64: the
shape of configs/long_context_1b.py's MLA layers; 32 of 192 + 128 with --cache=65536: a
window of Kimi-Linear-48B's prefill), bf16, batch 1. FLOPs count the visible (causal)
scores only: 2·(Dqk+Dv)·H·visible pairs. --num_warps=4,8 and --split=true,false time the
kernel at each launch width and with the head dim split or padded (a 192-wide head as 128 +
64 or as 256), every pair in the same process (default: what it ships with).

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
_HEADS = flags.DEFINE_integer("heads", 16, "Prefill: heads.")
_DQK = flags.DEFINE_integer("dqk", 64, "Prefill: query/key head dim.")
_DV = flags.DEFINE_integer("dv", 64, "Prefill: value head dim.")
_NUM_WARPS = flags.DEFINE_list("num_warps", [], "Prefill: launch widths to time (default: "
                               "the shipped one).")
_SPLIT = flags.DEFINE_list("split", [], "Prefill: pallas_gpu_cached.SPLIT_HEAD_DIM values to "
                           "time, true/false (default: the shipped one).")
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
  H, D, Dv, T, S = _HEADS.value, _DQK.value, _DV.value, _T.value, _S.value
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (1, T, H, D), jnp.bfloat16) * D ** -0.5
  k = jax.random.normal(keys[1], (1, S, H, D), jnp.bfloat16)
  v = jax.random.normal(keys[2], (1, S, H, Dv), jnp.bfloat16)
  widths = [int(w) for w in _NUM_WARPS.value] or [ca.num_warps(D)]
  splits = [x.lower() == "true" for x in _SPLIT.value] or [ca.SPLIT_HEAD_DIM]
  wide = ca.tile_dim(D) > 128   # the knob num_warps(D) reads

  def pallas_at(warps, split):
    knobs = {"WIDE_NUM_WARPS" if wide else "NUM_WARPS": warps, "SPLIT_HEAD_DIM": split}
    old = {n: getattr(ca, n) for n in knobs}
    for n, x in knobs.items():
      setattr(ca, n, x)
    try:   # traced and compiled now, with the knobs set
      return jax.jit(lambda *a: ca.cached_attention(*a, scale=1.0)).lower(
          q, k, v, jnp.array([0]), jnp.array([1])).compile()
    finally:
      for n, x in old.items():
        setattr(ca, n, x)

  variant = lambda w, sp: f"w{w}" + ("_split" if sp else "_padded")
  kernels = {variant(w, sp): pallas_at(w, sp) for w in widths for sp in splits}
  xla = None
  if D == Dv:   # the XLA loop's single K/V array needs equal widths
    kv = jnp.concatenate([k.reshape(1, S, -1), v.reshape(1, S, -1)], -1)
    xla = jax.jit(xla_loop)
  rows = []
  for L in (int(x) for x in _FILLED.value.split(",")):
    q_start, kv_len = jnp.array([L - T]), jnp.array([L])
    pairs = T * (L - T) + T * (T + 1) / 2
    flops = 2 * (D + Dv) * H * pairs
    row = {"filled": L, "chunk": T, "heads": H, "dqk": D, "dv": Dv}
    outs = {}
    for w, fn in kernels.items():
      ms = median_ms(fn, (q, k, v, q_start, kv_len), _ITERS.value)
      row[f"pallas_{w}_ms"], row[f"pallas_{w}_tflops"] = ms, flops / ms / 1e9
      outs[w] = fn(q, k, v, q_start, kv_len).astype(jnp.float32)
    first = outs[next(iter(kernels))]
    row["rel_err_between_variants"] = max(
        float(jnp.linalg.norm(o - first) / jnp.linalg.norm(first)) for o in outs.values())
    if xla is not None:
      ref = xla(q, kv, q_start, kv_len).astype(jnp.float32)
      row["rel_err"] = float(jnp.linalg.norm(first - ref) / jnp.linalg.norm(ref))
      ms = median_ms(xla, (q, kv, q_start, kv_len), _ITERS.value)
      row["xla_ms"], row["xla_tflops"] = ms, flops / ms / 1e9
    rows.append(row)
    print(row, flush=True)
  save("bench_cached_attention.json", rows,
       {"BLOCK_Q": ca.BLOCK_Q, "BLOCK_K": ca.BLOCK_K, "NUM_STAGES": ca.NUM_STAGES,
        "variants_timed": list(kernels)})
  print(f"\n{jax.devices()[0]}; T={T} queries, H={H}, Dqk={D}, Dv={Dv}, bf16, cache {S}")
  print("| filled | variant | pallas ms | TFLOP/s | % of 989 | xla loop ms |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    for w in kernels:
      tf = r[f"pallas_{w}_tflops"]
      print(f"| {r['filled']} | {w} | {r[f'pallas_{w}_ms']:.2f} | {tf:.0f} | "
            f"{100 * tf / 989:.0f}% | {r.get('xla_ms', float('nan')):.2f} |")


if __name__ == "__main__":
  app.run(main)
