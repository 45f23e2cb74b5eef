"""The causal flash kernels of single-device MLA training
(pallas_kernels/attention/pallas_gpu_ring_step.py, called by pallas_gpu_causal.py): each
kernel's tiles swept at one shape, side by side with a baseline copy of the module and with cuDNN, and each variant's error against fp32 attention in XLA.

  python -m benchmarks.bench_attention [--shape=4,8192,16,64] [--baseline=old/ring_step.py] \
      [--out=$OUT]
  python -m benchmarks.bench_attention --shape=1,8192,32,192 --dv=128   # Kimi-48B's MLA
  python -m benchmarks.bench_attention ... --sweep=false --rounds=3   # defaults, 3 rounds

Packed documents (segment ids; lengths exponential with mean --doc_len), bf16. The forward
is timed alone; the backward (dq and dk/dv kernels, with delta in XLA as
pallas_gpu_causal.py does) with one kernel's tiles swept while the other keeps its default.
cuDNN on the same documents (its packed layout: pallas_kernels/attention/cudnn_packed.py,
mla_implementation="cudnn") gets a row, and cuDNN over whole rows
(jax.nn.dot_product_attention, causal, no segment ids) is the speed reference. TFLOP/s
counts causal attention's model FLOPs: forward 2·(D + Dv) per visible score, backward
2·(3D + 2Dv) (the dq and dk/dv kernels recompute more than that).
"""

import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from pallas_kernels.attention import cudnn_packed, pallas_gpu_ring_step as ring_step
from pallas_kernels.attention.pallas_gpu_ring_step import Tiles
from benchmarks.timing import median_ms

_SHAPE = flags.DEFINE_list("shape", ["4", "8192", "16", "64"], "B, T, H, D.")
_DV = flags.DEFINE_integer("dv", 0, "Value head dim (0: D).")
_DOC_LEN = flags.DEFINE_integer("doc_len", 2048, "Mean packed document length.")
_ITERS = flags.DEFINE_integer("iters", 10, "Timed runs (median).")
_BASELINE = flags.DEFINE_string("baseline", "",
                                 "Another pallas_gpu_ring_step.py to time (default tiles).")
_SWEEP = flags.DEFINE_bool("sweep", True, "Sweep each kernel's tiles (else defaults only).")
_ROUNDS = flags.DEFINE_integer("rounds", 1, "Rounds over all rows, interleaved; each row "
                               "reports its median round (one row's runs spread by up to 15% "
                               "between rounds at Kimi's dims, attention.md).")
_OUT = flags.DEFINE_string("out", None, "Folder for attention.json.")

F32 = jnp.float32
PEAK_TFLOPS = 762.0   # bf16 matmul, measured on the H200 (shared/device/README.md)

FWD_CANDIDATES = [Tiles(64, 64), Tiles(128, 64), Tiles(128, 64, 8), Tiles(128, 32),
                  Tiles(128, 128, 8), Tiles(64, 32), Tiles(64, 128), Tiles(128, 64, 4, 4),
                  Tiles(128, 64, 4, 2), Tiles(64, 64, 4, 4), Tiles(128, 64, 8, 4)]
DQ_CANDIDATES = [Tiles(64, 64), Tiles(128, 64), Tiles(128, 64, 8), Tiles(128, 32),
                 Tiles(64, 32), Tiles(64, 128), Tiles(64, 64, 4, 2), Tiles(128, 32, 8)]
DKV_CANDIDATES = [Tiles(64, 64), Tiles(128, 64), Tiles(128, 64, 8), Tiles(128, 32),
                  Tiles(64, 32), Tiles(32, 64), Tiles(64, 128), Tiles(64, 64, 4, 2),
                  Tiles(128, 32, 8)]
# Past 128 head dims the tiles above spill thousands of bytes a thread at 4 warps (at
# 192 / 128 on sm_90a; benchmarks/attention.md), which is why the kernels ship narrower WIDE_
# tiles there; these 8-warp ones spill little or none too. Swept with the others when D > 128.
WIDE_CANDIDATES = {"fwd": [Tiles(128, 64, 8, 2), Tiles(64, 32, 8, 2), Tiles(128, 32, 8, 2)],
                   "dq": [Tiles(32, 64, 4, 2), Tiles(32, 64, 8, 2), Tiles(64, 32, 8, 2)],
                   "dkv": [Tiles(64, 32, 8, 2), Tiles(32, 64, 8, 2), Tiles(32, 32, 4, 2)]}


def _segments(B, T, mean, rng):
  """[B, T] ids 1, 2, ... of packed documents with exponential lengths (≥ 16)."""
  seg = np.zeros((B, T), np.int32)
  for b in range(B):
    t, i = 0, 1
    while t < T:
      n = max(16, int(rng.exponential(mean)))
      seg[b, t:t + n], t, i = i, t + n, i + 1
  return jnp.asarray(seg)


def _inputs(B, T, H, D, Dv):
  ks = jax.random.split(jax.random.key(0), 4)
  q, k = (jax.random.normal(kk, (B, T, H, D), jnp.bfloat16) for kk in ks[:2])
  v, do = (jax.random.normal(kk, (B, T, H, Dv), jnp.bfloat16) for kk in ks[2:])
  return q, k, v, do, _segments(B, T, _DOC_LEN.value, np.random.default_rng(0))


def _dense(q, k, v, seg):
  """fp32 attention written out: o [B, T, H, D]."""
  T = q.shape[1]
  s = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=F32) * q.shape[-1] ** -0.5
  visible = jnp.tril(jnp.ones((T, T), bool))[None] & (seg[:, :, None] == seg[:, None, :])
  p = jax.nn.softmax(jnp.where(visible[:, None], s, -jnp.inf), axis=-1)
  return jnp.einsum("bhts,bshd->bthd", p, v.astype(F32))


def _fns(module, fwd_tiles=None, bwd_tiles=None):
  """(forward, forward+backward) of causal attention on `module`'s kernels."""
  zero = jnp.zeros((), jnp.int32)
  kw = lambda t: {} if t is None else {"tiles": t}

  def fwd(q, k, v, seg):
    return module.ring_step_forward(q, k, v, seg, seg, zero, zero, scale=q.shape[-1] ** -0.5,
                                    **kw(fwd_tiles))

  def both(q, k, v, seg, do):
    o, lse = fwd(q, k, v, seg)
    o = o.astype(q.dtype)
    delta = jnp.einsum("bthd,bthd->bht", do.astype(F32), o.astype(F32))
    grads = module.ring_step_backward(q, k, v, seg, seg, zero, zero, do, lse, delta,
                                      scale=q.shape[-1] ** -0.5, **kw(bwd_tiles))
    return o, grads

  return jax.jit(fwd), jax.jit(both)


def _error(both, q, k, v, seg, do, n_heads=4):
  """Relative error of o, dq, dk, dv on row 0, the first n_heads heads, against fp32."""
  sl = lambda x: x[:1, :, :n_heads]
  o, grads = both(q, k, v, seg, do)
  o_ref, vjp = jax.vjp(lambda q, k, v: _dense(q, k, v, seg[:1]),
                       *(sl(x).astype(F32) for x in (q, k, v)))
  refs = (o_ref, *vjp(sl(do).astype(F32)))
  rel = lambda a, b: float(jnp.linalg.norm(a.astype(F32) - b) / jnp.linalg.norm(b))
  return max(rel(sl(a), b) for a, b in zip((o, *grads), refs))


def _flops(B, T, H, D, Dv, seg):
  """Model FLOPs of the forward and the backward over the visible (causal, same-document)
  scores."""
  s = np.asarray(seg)
  visible = 0
  for b in range(B):
    _, counts = np.unique(s[b], return_counts=True)
    visible += int(np.sum(counts * (counts + 1) // 2))
  return H * visible * 2 * (D + Dv), H * visible * 2 * (3 * D + 2 * Dv)


def main(argv):
  del argv
  B, T, H, D = (int(x) for x in _SHAPE.value)
  Dv = _DV.value or D
  q, k, v, do, seg = _inputs(B, T, H, D, Dv)
  f_fwd, f_bwd = _flops(B, T, H, D, Dv, seg)
  wide = D > 128
  candidates = {kern: base + (WIDE_CANDIDATES[kern] if wide else [])
                for kern, base in (("fwd", FWD_CANDIDATES), ("dq", DQ_CANDIDATES),
                                   ("dkv", DKV_CANDIDATES))}
  rows, entries = [], []

  def record(name, fwd, both, kernel):   # timed below, in --rounds interleaved rounds
    entries.append((name, fwd, both, kernel))

  if _BASELINE.value:
    spec = importlib.util.spec_from_file_location("baseline_ring_step", _BASELINE.value)
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    record("baseline", *_fns(base), "all")
  fwd0, dq0, dkv0 = ((ring_step.WIDE_FWD, ring_step.WIDE_DQ, ring_step.WIDE_DKV) if wide
                     else (ring_step.FWD, ring_step.DQ, ring_step.DKV))   # what ships here
  record(f"default {fwd0} {dq0} {dkv0}", *_fns(ring_step), "all")
  if _SWEEP.value:
    for t in candidates["fwd"]:
      record(f"fwd {t}", *_fns(ring_step, fwd_tiles=t), "fwd")
    for t in candidates["dq"]:
      record(f"dq {t}", *_fns(ring_step, bwd_tiles=(t, dkv0)), "dq")
    for t in candidates["dkv"]:
      record(f"dkv {t}", *_fns(ring_step, bwd_tiles=(dq0, t)), "dkv")

  def packed_both(q, k, v, seg, do):   # cuDNN on the documents (cudnn_packed.py)
    o, vjp = jax.vjp(lambda *a: cudnn_packed.causal_attention(*a, seg), q, k, v)
    return o, vjp(do)

  record("cudnn packed (documents)", jax.jit(cudnn_packed.causal_attention),
         jax.jit(packed_both), "all")

  runs = {e[0]: ([], []) for e in entries}
  for r in range(_ROUNDS.value):
    for name, fwd, both, kernel in list(entries):
      try:
        runs[name][0].append(median_ms(fwd, (q, k, v, seg), _ITERS.value))
        runs[name][1].append(median_ms(both, (q, k, v, seg, do), _ITERS.value))
      except Exception as e:  # noqa: BLE001 — e.g. a platform without cuDNN attention
        print(f"{name}: {str(e).splitlines()[0]}")
        entries.remove((name, fwd, both, kernel))
        continue
      print(f"{name:<40} fwd {runs[name][0][-1]:7.3f} ms  fwd+bwd {runs[name][1][-1]:7.3f} ms"
            f"  (round {r + 1})", flush=True)
  for name, fwd, both, kernel in entries:
    ms_f, ms_b = (float(np.median(x)) for x in runs[name])
    rows.append({"variant": name, "kernel": kernel, "fwd_ms": ms_f, "fwd_bwd_ms": ms_b,
                 "fwd_ms_rounds": runs[name][0], "fwd_bwd_ms_rounds": runs[name][1],
                 "fwd_tflops": f_fwd / ms_f / 1e9,
                 "fwd_bwd_tflops": (f_fwd + f_bwd) / ms_b / 1e9,
                 "error": _error(both, q, k, v, seg, do)})
    print(f"{name:<40} fwd {ms_f:7.3f} ms  fwd+bwd {ms_b:7.3f} ms  "
          f"{rows[-1]['fwd_bwd_tflops']:6.1f} TFLOP/s  err {rows[-1]['error']:.2e}", flush=True)

  causal = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                        implementation="cudnn")

  def cudnn_both(q, k, v, do):   # one forward, as the kernels' `both`
    o, vjp = jax.vjp(causal, q, k, v)
    return o, vjp(do)

  try:
    ms_f = median_ms(jax.jit(causal), (q, k, v), _ITERS.value)
    ms_b = median_ms(jax.jit(cudnn_both), (q, k, v, do), _ITERS.value)
    dense_flops = B * H * T * (T + 1) // 2 * 2 * (D + Dv)
    rows.append({"variant": "cudnn (no segments)", "fwd_ms": ms_f, "fwd_bwd_ms": ms_b,
                 "fwd_tflops": dense_flops / ms_f / 1e9,
                 "fwd_bwd_tflops": dense_flops * 3.5 / ms_b / 1e9})
    print(f"{'cudnn (no segments, all causal scores)':<40} fwd {ms_f:7.3f} ms  "
          f"fwd+bwd {ms_b:7.3f} ms", flush=True)
  except Exception as e:  # noqa: BLE001 — a platform without cuDNN attention
    print("cudnn:", str(e).splitlines()[0])

  best = {kern: min((r for r in rows if r.get("kernel") == kern),
                    key=lambda r: r["fwd_ms"] if kern == "fwd" else r["fwd_bwd_ms"])
          for kern in ("fwd", "dq", "dkv") if any(r.get("kernel") == kern for r in rows)}
  whole_fwd = B * H * T * (T + 1) // 2 * 2 * (D + Dv)
  summary = {"shape": [B, T, H, D], "dv": Dv, "doc_len": _DOC_LEN.value,
             "visible_fraction": f_fwd / whole_fwd, "device": jax.devices()[0].device_kind,
             "rows": rows, "best": {k: r["variant"] for k, r in best.items()}}
  if _OUT.value:
    os.makedirs(_OUT.value, exist_ok=True)
    with open(os.path.join(_OUT.value, "attention.json"), "w") as f:
      json.dump(summary, f, indent=1)
  print("\nbest per kernel:", json.dumps(summary["best"]))
  print(f"visible scores: {summary['visible_fraction']:.3f} of the causal triangle; "
        f"peak {PEAK_TFLOPS} TFLOP/s")


if __name__ == "__main__":
  app.run(main)
