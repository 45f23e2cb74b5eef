"""Sequence parallelism on the GPUs of one host: ring attention and KDA state passing vs the
single-device ops, forward+backward.

  python -m benchmarks.bench_sequence [--lengths=65536,262144] [--out=$OUT]

Mesh: every local device on the `sequence` axis (2 on nvidia-h200-x2). Batch 1, bf16, one
document per row. Attention: 16 heads of 64 (the MLA shape of configs/long_context_1b.py),
causal: ring steps as Pallas flash kernels, and as XLA score blocks at each --subs sub-block
size (the fastest variant is in the table, all in the JSON); the single-device baselines are
cuDNN flash attention and jax's Pallas flash kernel. KDA: 16 heads, K = V = 128,
bounded gates; the baseline is kda(implementation=None) on one device. Memory per device is
XLA's compiled estimate (arguments + outputs + temporaries) of the fwd+bwd program.
A row whose program fails (out of memory) is recorded as such; results are written after
every row.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax.experimental.pallas.ops.gpu.attention import mha as pallas_mha
from moe_jax.parallel import ring_attention as ring_attention_lib
from moe_jax.parallel.kda_sequence import kda_sequence_parallel
from moe_jax.parallel.ring_attention import ring_attention
from pallas_kernels.kda import kda
from benchmarks.timing import median_ms

_LENGTHS = flags.DEFINE_string("lengths", "65536,262144", "Total sequence lengths.")
_ITERS = flags.DEFINE_integer("iters", 5, "Timed runs (median).")
_OUT = flags.DEFINE_string("out", None, "Folder for the JSON results.")
_SMALL = flags.DEFINE_bool("small", False, "Tiny heads (a CPU smoke run of the script).")
_SUBS = flags.DEFINE_string("subs", "512,2048",
                            "Ring attention (XLA steps) sub-block sizes to compare; empty: none.")
_OPS = flags.DEFINE_list("ops", ["attention", "kda"], "Which ops to time.")


def _inputs(T, H, Dk, Dv, mesh):
  ks = jax.random.split(jax.random.key(T), 5)
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "sequence")))
  q = put(jax.random.normal(ks[0], (1, T, H, Dk), jnp.bfloat16))
  k = jax.random.normal(ks[1], (1, T, H, Dk), jnp.float32)
  k = put((k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(jnp.bfloat16))
  v = put(jax.random.normal(ks[2], (1, T, H, Dv), jnp.bfloat16))
  g = put(-5.0 * jax.nn.sigmoid(jax.random.normal(ks[3], (1, T, H, Dk))))
  beta = put(jax.nn.sigmoid(jax.random.normal(ks[4], (1, T, H))))
  return q, k, v, g, beta


def _timed(fn, args):
  """(ms, GB per device) of a jitted fwd+bwd, or the error's last line."""
  try:
    compiled = jax.jit(fn).lower(*args).compile()
    mem = compiled.memory_analysis()
    gb = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes) / 1e9
    return median_ms(compiled, args, _ITERS.value), gb
  except Exception as e:  # noqa: BLE001 — out of memory at long lengths is a result
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}", None


def fwd_bwd(f):
  """Sum of (output · fixed weights) differentiated w.r.t. every float input."""
  def loss(*args):
    o = f(*args)
    return (o.astype(jnp.float32) * jnp.cos(o.astype(jnp.float32))).sum()
  return jax.grad(loss, argnums=tuple(range(3)))


def main(argv):
  del argv
  devices = jax.devices()
  n = len(devices)
  mesh = Mesh(np.array(devices), ("sequence",))
  one = Mesh(np.array(devices[:1]), ("sequence",))
  H, Da, Dk = (2, 16, 16) if _SMALL.value else (16, 64, 128)
  rows = []

  def save():
    if _OUT.value:
      os.makedirs(_OUT.value, exist_ok=True)
      with open(os.path.join(_OUT.value, "bench_sequence.json"), "w") as f:
        json.dump({"rows": rows, "devices": [str(d) for d in devices]}, f, indent=2)

  for T in (int(x) for x in _LENGTHS.value.split(",")):
    seg = jnp.ones((1, T), jnp.int32)
    if "attention" in _OPS.value:
      q, k, v, _, _ = _inputs(T, H, Da, Da, mesh)
      ring = {}
      with jax.set_mesh(mesh):  # each step as flash kernels (Pallas), then the XLA blocks
        ring["pallas"] = _timed(fwd_bwd(lambda q, k, v: ring_attention(
            q, k, v, seg, implementation="pallas")), (q, k, v))
      for sub in (int(x) for x in _SUBS.value.split(",") if x):
        ring_attention_lib.SUB = sub
        with jax.set_mesh(mesh):
          ring[f"xla SUB {sub}"] = _timed(fwd_bwd(lambda q, k, v: ring_attention(
              q, k, v, seg, implementation="xla")), (q, k, v))
      sub, (ms, gb) = min(ring.items(), key=lambda kv: kv[1][0] if isinstance(kv[1][0], float)
                          else float("inf"))
      impl = "xla" if _SMALL.value else "cudnn"
      base = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                          implementation=impl)
      q1, k1, v1 = (jax.device_put(x, devices[0]) for x in (q, k, v))
      ms1, gb1 = _timed(fwd_bwd(base), (q1, k1, v1))
      # jax's Pallas flash kernel with segment ids (the single-device path before pallas_gpu_causal.py).
      seg1 = jax.device_put(seg, devices[0])
      flash_ms, _ = _timed(fwd_bwd(lambda q, k, v: pallas_mha(
          q, k, v, seg1, sm_scale=q.shape[-1] ** -0.5, causal=True)), (q1, k1, v1))
      # Our ring-step kernels on one device (a ring of one): the model's path now.
      with jax.set_mesh(one):
        ring1_ms, _ = _timed(fwd_bwd(lambda q, k, v: ring_attention(
            q, k, v, seg1, implementation="pallas")), (q1, k1, v1))
      rows.append({"op": f"attention, ring ({sub})", "T": T, "shards": n, "sharded_ms": ms,
                   "sharded_gb": gb, "single_ms": ms1, "single_gb": gb1,
                   "single_pallas_flash_ms": flash_ms, "single_ring_step_ms": ring1_ms,
                   "ring_by_variant": ring})
      print(rows[-1], flush=True)
      save()

    if "kda" in _OPS.value:
      q, k, v, g, beta = _inputs(T, H, Dk, Dk, mesh)
      kw = dict(lower_bound=-5.0, chunk_size=64)
      # g and beta are arguments (not closed over: they would be compiled in as constants).
      sp = lambda q, k, v, g, beta: kda_sequence_parallel(q, k, v, g, beta, seg, **kw)[0]
      with jax.set_mesh(mesh):
        ms, gb = _timed(fwd_bwd(sp), (q, k, v, g, beta))
      single = lambda q, k, v, g, beta: kda(q, k, v, g, beta, **kw)[0]
      args1 = [jax.device_put(x, devices[0]) for x in (q, k, v, g, beta)]
      with jax.set_mesh(one):
        ms1, gb1 = _timed(fwd_bwd(single), args1)
      rows.append({"op": "kda", "T": T, "shards": n, "sharded_ms": ms, "sharded_gb": gb,
                   "single_ms": ms1, "single_gb": gb1})
      print(rows[-1], flush=True)
      save()

  fmt = lambda x: f"{x:.2f}" if isinstance(x, float) else f"— ({x})" if x else "—"
  print(f"\n{n} × {devices[0].device_kind}; batch 1, bf16, fwd+bwd")
  print("| op | T | shards | sharded ms | GB/device | single-device ms ¹ | GB | "
        "single, jax Pallas flash ms | single, ring-step kernels ms |")
  print("|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['op']} | {r['T']} | {r['shards']} | {fmt(r['sharded_ms'])} | "
          f"{fmt(r['sharded_gb'])} | {fmt(r['single_ms'])} | {fmt(r['single_gb'])} | "
          f"{fmt(r.get('single_pallas_flash_ms'))} | {fmt(r.get('single_ring_step_ms'))} |")
  print("¹ attention: cuDNN; KDA: kda() with the platform default (triton; pallas_gpu without jax-triton)")


if __name__ == "__main__":
  app.run(main)
