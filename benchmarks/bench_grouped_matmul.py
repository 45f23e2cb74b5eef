"""The grouped matmul's three products on the GPU, side by side: tokamax's y and dx and
pallas_kernels/moe/pallas_gpu_grouped_dw.py's dw (the `tokamax` path), the Mosaic GPU
kernels of pallas_kernels/moe/mosaic_gpu_grouped.py (the `mosaic` path) and the Triton
kernels of pallas_kernels/moe/triton_gpu_grouped.py (the `triton` path, --triton), each
checked against an fp32 per-group reference, in one process. With --tune it times every
candidate tile config of the Mosaic kernels per product and writes the fastest correct one
to --table (mosaic_gpu_grouped_tuned.json, which the kernels read at import); with
--tune_triton, the Triton kernels' candidate tiles (recorded, not written to a table).

  python -m benchmarks.bench_grouped_matmul --tune --out=$OUT     # long_context_1b's shapes
  python -m benchmarks.bench_grouped_matmul --shapes=2048x2048,1024x2048 --rows=98304 \
      --tune_triton --out=$OUT                                    # single_h200's

bf16, --rows rows (long_context_1b: 4 × 8192 tokens × top-4) in --experts groups, sizes
Dirichlet(0.5)-skewed with one empty group and 100 padding rows (NaN) past the groups.
FLOPs 2·rows·K·N per product. Median of --iters runs after warm-up.
"""

import dataclasses
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from pallas_kernels.moe import ops as moe_ops
from pallas_kernels.moe import mosaic_gpu_grouped as gm
from pallas_kernels.moe import triton_gpu_grouped as tg
from benchmarks import timing

_ROWS = flags.DEFINE_integer("rows", 131072, "Rows (tokens × top-k) of the timed products.")
_EXPERTS = flags.DEFINE_integer("experts", 32, "Groups.")
_SHAPES = flags.DEFINE_string("shapes", "1024x1408,704x1024",
                              "K x N of each forward product (long_context_1b: gate/up "
                              "1024 → 2·704, down 704 → 1024), comma-separated.")
_ITERS = flags.DEFINE_integer("iters", 10, "Timed runs per measurement (median reported).")
_TUNE = flags.DEFINE_bool("tune", False, "Time every candidate config and write --table.")
_TABLE = flags.DEFINE_string("table", gm.TUNED_PATH, "The tuned-config table --tune writes.")
_BUDGET = flags.DEFINE_float("budget_s", 30.0, "Tuning time per product (seconds).")
_OUT = flags.DEFINE_string("out", None, "Folder for grouped_matmul.md / .json.")
_XLA = flags.DEFINE_bool("xla", False, "Also time XLA's own ragged_dot for each product (y, dx: "
                         "cuDNN's grouped matmul where XLA_FLAGS holds "
                         "--xla_gpu_experimental_use_ragged_dot_fusion=true; without it XLA "
                         "emulates it densely, G times the FLOPs).")
_TRITON = flags.DEFINE_bool("triton", True, "Also time the Triton kernels at their default "
                            "tile (triton_gpu_grouped.default_config).")
_TUNE_TRITON = flags.DEFINE_bool("tune_triton", False, "Time the Triton kernels' candidate "
                                 "tiles (_TRITON_TILES), within --budget_s per product.")
_PEAK_FLOPS = 989e12  # the H100/H200 dense bf16 spec peak, as the field reports it


def _inputs(M, E, seed=7):
  rng = np.random.default_rng(seed)
  sizes = rng.multinomial(M - 100, rng.dirichlet(np.ones(E) * 0.5))
  sizes[3] = 0
  return np.asarray(sizes, np.int32)


def _reference(product, a, b, sizes):
  """fp32 on the host (numpy), group by group: y = a_g·b[g], dx = a_g·b[g]ᵀ,
  dw[g] = a_gᵀ·b_g. Rows past the groups are dropped (y, dx)."""
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  ends = np.cumsum(sizes)
  groups = list(zip(ends - sizes, ends))
  if product == "dw":
    return np.stack([a[s:e].T @ b[s:e] for s, e in groups])
  return np.concatenate([a[s:e] @ (b[g].T if product == "dx" else b[g])
                         for g, (s, e) in enumerate(groups)])


def _rel_err(got, ref, used):
  got = np.asarray(got, np.float32)
  got = got if got.ndim == 3 else got[:used]
  ref = np.asarray(ref, np.float32)
  if not np.isfinite(got).all():
    return float("inf")
  return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


# (block_m, block_n, block_k, stages, grid_block_n), most promising first: the accumulator
# is block_m × block_n fp32 in one warpgroup's registers (128 × 128 = 128 per thread).
_DOT_TILES = ((128, 128, 64, 4, 1), (128, 128, 64, 3, 1), (128, 128, 64, 5, 1),
              (128, 64, 64, 4, 1), (64, 256, 64, 4, 1), (128, 128, 128, 3, 1),
              (128, 128, 64, 4, 4), (64, 128, 64, 4, 1), (128, 64, 64, 6, 1),
              (128, 64, 64, 3, 1), (64, 64, 64, 4, 1))
_DW_TILES = ((128, 128, 64, 2, 1), (128, 128, 64, 4, 1), (128, 128, 128, 2, 1),
             (128, 64, 64, 4, 1), (64, 128, 64, 4, 1), (64, 256, 64, 4, 1),
             (64, 128, 128, 2, 1), (64, 64, 64, 4, 1))


def _candidates(product, K, N):
  """Tile configs to time for one product (K: contracted width, or dw's output rows)."""
  out = []
  for bm, bn, bk, st, gbn in (_DW_TILES if product == "dw" else _DOT_TILES):
    if product == "dw":
      ok = K % bm == 0 and N % bn == 0
    else:
      ok = K % bk == 0 and N % bn == 0 and (N // bn) % gbn == 0
    if ok:
      out.append(gm.Config(block_m=bm, block_n=bn, block_k=bk, stages=st, grid_block_n=gbn))
  return out


_PRODUCTS = ("y", "dx", "dw")

# Triton tiles (block_m, block_n, block_k, warps, stages, group_m): 8 warps hold a 128 × 256
# fp32 accumulator at 128 registers a thread; 4 warps a 128 × 128 one.
_TRITON_TILES = ((128, 256, 64, 8, 3, 8), (128, 256, 64, 8, 4, 8), (128, 128, 64, 4, 4, 8),
                 (128, 128, 64, 8, 4, 8), (256, 128, 64, 8, 3, 8), (128, 256, 32, 8, 5, 8),
                 (64, 256, 64, 4, 4, 8), (128, 128, 128, 8, 3, 8), (128, 256, 64, 8, 3, 1),
                 (128, 64, 64, 4, 5, 8))


def _triton_candidates(product, K, N):
  """Triton tiles to time for one product (y, dx: block_k must divide the contraction K)."""
  return [tg.Config(block_m=bm, block_n=bn, block_k=bk, warps=wp, stages=st, group_m=gm_)
          for bm, bn, bk, wp, st, gm_ in _TRITON_TILES if product == "dw" or K % bk == 0]


def _triton_fn(product, config):
  fn = {"y": tg.ragged_dot, "dx": functools.partial(tg.ragged_dot, transpose_rhs=True),
        "dw": tg.ragged_dw}[product]
  return jax.jit(functools.partial(fn, config=config))


def _mosaic_fn(product, config):
  """grouped_mgpu's kernel for the product at a tile config. (The `mosaic` path's dx takes
  tokamax's kernel instead where K is not a multiple of 128: moe_ops._mosaic_dx.)"""
  fn = {"y": gm.ragged_dot, "dx": functools.partial(gm.ragged_dot, transpose_rhs=True),
        "dw": gm.ragged_dw}[product]
  return jax.jit(functools.partial(fn, config=config))


def _baseline_fn(product):
  """The tokamax path's kernels: tokamax's y and dx (on a transposed copy of w), grouped_dw."""
  return jax.jit(moe_ops.GPU_PRODUCTS["tokamax"][_PRODUCTS.index(product)])


# XLA's ragged_dot_general for each product: dx contracts w's output dim in place (no wᵀ
# copy); dw is ragged in the contracting dim (the rows).
_XLA_DIMS = {
    "y": jax.lax.RaggedDotDimensionNumbers((([1], [1]), ([], [])), [0], [0]),
    "dx": jax.lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), [0], [0]),
    "dw": jax.lax.RaggedDotDimensionNumbers((([0], [0]), ([], [])), [0], []),
}


def _xla_fn(product):
  return jax.jit(lambda a, b, sizes: jax.lax.ragged_dot_general(
      a, b, sizes, _XLA_DIMS[product],
      preferred_element_type=jnp.float32 if product == "dw" else None))


def _xla_cell(x, pct):
  if x is None:
    return "—"
  if "error" in x:
    return "failed: " + x["error"][:80].replace("|", "/")
  return f"{x['ms']:.3f} ({x['tflops']:.0f}, {pct(x['tflops']):.0f}%, {x['err']:.1e})"


def _sweep(label, candidates, fn_of, timed, best):
  """Time each candidate config (fn_of(config) -> a jitted product) within --budget_s:
  (every try as a record, the fastest correct (ms, config, err), or `best` if none beat
  it)."""
  tried, t0 = [], time.time()
  for cfg in candidates:
    if time.time() - t0 > _BUDGET.value:
      break
    try:
      ms, err = timed(fn_of(cfg))
    except Exception as e:  # noqa: BLE001 — e.g. shared memory exceeded: skip it
      tried.append({"config": dataclasses.asdict(cfg), "error": str(e)[:200]})
      print(f"  {label} {cfg}: {str(e)[:120]}", flush=True)
      continue
    tried.append({"config": dataclasses.asdict(cfg), "ms": ms, "err": err})
    print(f"  {label} {cfg}: {ms:.3f} ms, err {err:.1e}", flush=True)
    if err < 1e-2 and ms < best[0]:
      best = (ms, cfg, err)
  return tried, best


def _triton_cell(t, pct, with_config):
  if t is None:
    return "—"
  cell = f"{t['ms']:.3f} ({t['tflops']:.0f}, {pct(t['tflops']):.0f}%, {t['err']:.1e})"
  if with_config:
    c = t["config"]
    cell += (f" ({c['block_m']}, {c['block_n']}, {c['block_k']}, {c['warps']}, "
             f"{c['stages']}, {c['group_m']})")
  return cell


def main(_):
  M, E = _ROWS.value, _EXPERTS.value
  sizes_np = _inputs(M, E)
  used = int(sizes_np.sum())
  sizes = jnp.asarray(sizes_np)
  rng = np.random.default_rng(1)

  def rows(cols):   # NaN past the groups: no product may read them into a sum
    a = rng.normal(size=(M, cols)).astype(np.float32)
    a[used:] = np.nan
    return jnp.asarray(a, jnp.bfloat16)

  records, tuned = [], {}
  for shape in _SHAPES.value.split(","):
    K, N = map(int, shape.split("x"))
    x, dy = rows(K), rows(N)
    w = jnp.asarray(rng.normal(size=(E, K, N)) / np.sqrt(K), jnp.bfloat16)
    clean = lambda a: jnp.where((jnp.arange(M) < used)[:, None], a, 0)
    for product, key_KN, args in (("y", (K, N), (x, w, sizes)),
                                  ("dx", (N, K), (clean(dy), w, sizes)),
                                  ("dw", (K, N), (x, dy, sizes))):
      ref = _reference(product, clean(args[0]), args[1] if product != "dw" else clean(dy),
                       sizes_np)
      flops = 2 * used * K * N
      row = {"product": product, "key": gm.tuned_key(product, *key_KN), "rows": M,
             "groups": E}

      def timed(fn):
        out = fn(*args)
        err = _rel_err(out, ref, used)
        ms = timing.median_ms(fn, args, _ITERS.value)
        return ms, err

      ms, err = timed(_baseline_fn(product))
      row["baseline"] = {"impl": "grouped_dw" if product == "dw" else "tokamax", "ms": ms,
                         "tflops": flops / ms / 1e9, "err": err}
      default = gm.default_config(product, *key_KN)
      ms, err = timed(_mosaic_fn(product, default))
      row["mosaic_default"] = {"config": dataclasses.asdict(default), "ms": ms,
                               "tflops": flops / ms / 1e9, "err": err}
      best = (ms, default, err) if err < 1e-2 else (float("inf"), None, None)
      if _TRITON.value or _TUNE_TRITON.value:
        t_default = tg.default_config(product, *key_KN)
        ms, err = timed(_triton_fn(product, t_default))
        row["triton_default"] = {"config": dataclasses.asdict(t_default), "ms": ms,
                                 "tflops": flops / ms / 1e9, "err": err}
        print(f"  {row['key']} triton {t_default}: {ms:.3f} ms, err {err:.1e}", flush=True)
      if _TUNE_TRITON.value:
        d = row["triton_default"]
        start = (d["ms"], t_default, d["err"]) if d["err"] < 1e-2 else (float("inf"), None, None)
        tried, (ms, cfg, err) = _sweep(f"{row['key']} triton",
                                       _triton_candidates(product, *key_KN),
                                       lambda c: _triton_fn(product, c), timed, start)
        row["triton_tried"] = tried
        if cfg is not None:
          row["triton_tuned"] = {"config": dataclasses.asdict(cfg), "ms": ms,
                                 "tflops": flops / ms / 1e9, "err": err}
      if _XLA.value:
        try:
          ms, err = timed(_xla_fn(product))
          row["xla"] = {"ms": ms, "tflops": flops / ms / 1e9, "err": err}
        except Exception as e:  # noqa: BLE001 — e.g. no cuDNN plan: recorded, not fatal
          row["xla"] = {"error": str(e)[:300]}
        print(f"  {row['key']} xla ragged_dot: {row['xla']}", flush=True)
      if _TUNE.value:
        tried, best = _sweep(row["key"], _candidates(product, *key_KN),
                             lambda c: _mosaic_fn(product, c), timed, best)
        row["tried"] = tried
        if best[1] is not None:
          tuned[row["key"]] = dataclasses.asdict(best[1])
          row["mosaic_tuned"] = {"config": tuned[row["key"]], "ms": best[0],
                                 "tflops": flops / best[0] / 1e9}
      records.append(row)
      print(json.dumps({k: v for k, v in row.items() if not k.endswith("tried")}), flush=True)

  if _TUNE.value and tuned:   # merged into the table: other shapes' entries stay
    table = {"configs": {}}
    if os.path.exists(_TABLE.value):
      with open(_TABLE.value) as fh:
        table = json.load(fh)
    table.update({"device": jax.devices()[0].device_kind, "rows": M, "groups": E})
    table["configs"].update(tuned)
    with open(_TABLE.value, "w") as fh:
      json.dump(table, fh, indent=1)
  pct = lambda t: 100 * t * 1e12 / _PEAK_FLOPS
  lines = ["| product | baseline | ms (TFLOP/s, % of 989) | mosaic, default tile | "
           "mosaic, tuned tile | tuned config (m, n, k, stages, grid_n) | err vs fp32 | "
           "XLA ragged_dot ms (TFLOP/s, % peak, err) | triton, default tile | "
           "triton, best tile (m, n, k, warps, stages, group_m) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in records:
    b, d, t = r["baseline"], r["mosaic_default"], r.get("mosaic_tuned")
    tc = t["config"] if t else None
    lines.append(
        f"| {r['key']} | {b['impl']} | {b['ms']:.3f} ({b['tflops']:.0f}, {pct(b['tflops']):.0f}%) "
        f"| {d['ms']:.3f} ({d['tflops']:.0f}) | "
        + (f"{t['ms']:.3f} ({t['tflops']:.0f}, {pct(t['tflops']):.0f}%) | "
           f"{tc['block_m']}, {tc['block_n']}, {tc['block_k']}, {tc['stages']}, "
           f"{tc['grid_block_n']} |" if t else "— | — |")
        + f" {b['err']:.1e} / {d['err']:.1e} | {_xla_cell(r.get('xla'), pct)} |"
        + f" {_triton_cell(r.get('triton_default'), pct, False)} |"
        + f" {_triton_cell(r.get('triton_tuned'), pct, True)} |")
  table = "\n".join(lines)
  if _OUT.value:
    os.makedirs(_OUT.value, exist_ok=True)
    with open(os.path.join(_OUT.value, "grouped_matmul.json"), "w") as fh:
      json.dump({"device": str(jax.devices()[0]), "records": records}, fh, indent=1)
    with open(os.path.join(_OUT.value, "grouped_matmul.md"), "w") as fh:
      fh.write(table + "\n")
  print(f"\n{jax.devices()[0].device_kind}: {M} rows, {E} groups, bf16")
  print(table)


if __name__ == "__main__":
  app.run(main)
