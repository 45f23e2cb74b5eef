#!/usr/bin/env bash
# Variants of one train-step row timed one after another in one device call: each variant a
# cold bench_train process (`--warm=none`) with its own flags, recorded as row <row>_<name>
# in $OUT/train.json (a copy of benchmarks/train.json, so the file that comes back is the
# record with the new rows merged), then one table of all of them. A variant that would
# start past BUDGET seconds is skipped (a cold 1B row takes about 100 s on an H100).
#
#   VARIANTS="default:;unroll:--set=model.scan_layers=False;lhs:--xla_flags=--xla_gpu_..." \
#     ROWS=1b_dropless BUDGET=420 bash benchmarks/train_variants.sh
#
# VARIANTS: ';'-separated name:flags (flags: bench_train's --set=k=v, --xla_flags=...,
# --baseline_dir=DIR, --steps=N, as shell words, so --xla_flags='--a=true --b=true' is one;
# name `default` records the row under its own name).
# Carry the wheels in WHEELS (default ".whl_gpu .whl_prof": the profile needs xprof). The
# per-process logs and HLO dumps stay in $OUT/logs unless KEEP_LOGS=0 (they are large).
set -o pipefail
: "${VARIANTS:?VARIANTS=name:flags[;...]}"
ROWS=${ROWS:-1b_dropless}; BUDGET=${BUDGET:-420}; OUT=${OUT:-/tmp/train_variants}
mkdir -p "$OUT"
source tests/gpu_site.sh
# shellcheck disable=SC2086  # folders of wheels, space-separated
install_wheels "${SITE:-/tmp/site}" ${WHEELS:-.whl_gpu .whl_prof} || exit 1
cp benchmarks/train.json "$OUT/train.json"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown); $gpu"

IFS=';' read -ra variants <<< "$VARIANTS"
labels=(); SECONDS=0
for v in "${variants[@]}"; do
  name=${v%%:*}; flags=${v#*:}; [ "$flags" = "$v" ] && flags=""
  if [ "$SECONDS" -ge "$BUDGET" ]; then
    echo "== $name: skipped at $SECONDS s (BUDGET $BUDGET)"; continue
  fi
  label=(); [ "$name" != default ] && label=(--label="$name")
  start=$SECONDS
  eval "args=($flags)"   # shell words: a quoted value may hold spaces (--xla_flags='--a --b')
  python3 -m benchmarks.bench_train --rows="$ROWS" --warm=none --out="$OUT" "${label[@]}" \
    "${args[@]}" > "$OUT/$name.out" 2>&1
  echo "== $name: rc=$? after $((SECONDS - start)) s"; grep -E "first step|failed" "$OUT/$name.out"
  labels+=("$name")
done
[ "${KEEP_LOGS:-1}" = 0 ] && rm -rf "$OUT/logs"

python3 - "$OUT/train.json" "$ROWS" "${labels[@]}" <<'PY'
import json, sys
path, rows, labels = sys.argv[1], sys.argv[2].split(","), sys.argv[3:]
recs = {r["row"]: r for r in json.load(open(path)) if r.get("mode", "cold") == "cold"}
cols = ("step_ms", "step_ms_pipelined", "mfu", "launch_to_first_step_s", "loss_after",
        "peak_memory_gib", "kernel_ms_per_step", "device_busy_ms_per_step",
        "device_idle_ms_per_step", "copy_only_ms_per_step")
print("| row | " + " | ".join(cols) + " | phases (ms) |")
print("|---|" + "---|" * (len(cols) + 1))
for row in rows:
  for lab in labels:
    variant = row if lab == "default" else f"{row}_{lab}"
    for name in (variant, f"{variant}_baseline"):
      r = recs.get(name)
      if r is None or "error" in r:
        continue
      vals = [f"{r[c]:.4g}" if isinstance(r.get(c), (int, float)) else "—" for c in cols]
      phases = ", ".join(f"{k} {v:.1f}" for k, v in sorted(
          (r.get("phase_ms") or {}).items(), key=lambda kv: -kv[1])[:6])
      print(f"| {name} | " + " | ".join(vals) + f" | {phases} |")
PY
