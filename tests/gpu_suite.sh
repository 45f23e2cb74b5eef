#!/usr/bin/env bash
# The test suite natively on a GPU machine, with a per-file table (benchmarks/gpu_tests.md).
#   bash tests/gpu_suite.sh [pytest args]      (default: tests; WORKERS=8 xdist processes)
#   HALF=kernels bash tests/gpu_suite.sh       the kernel and inference files (KERNELS below)
#   HALF=rest bash tests/gpu_suite.sh          every other tests/test_*.py
# The two halves together are every test file, each half within one 10-minute device call.
# On the project's lent H200 (no network) this installs the carried wheels first
# (tests/gpu_wheels.sh). The device tool carries 64 MiB with the tracked tree, so each half
# carries what its tests import: tokamax imports xprof, which only the kernel half's tests
# reach; the live Kimi Linear comparison (rest) needs transformers 5.23:
#   HALF=kernels WHEELS=".whl_gpu .whl_prof" WORKERS=16 bash tests/gpu_suite.sh
#   HALF=rest    WHEELS=.whl_gpu             WORKERS=16 bash tests/gpu_suite.sh   (+ .whl_ref)
# Workers share the GPU: conftest turns JAX's 75% preallocation and XLA's autotuning off,
# and the suite's time is mostly compiles, which several processes run side by side.
# Each output line starts with the seconds since the start; failures are written to
# failures.txt as they happen, so a run the time limit stops still says why each failed.
set -o pipefail
source "$(dirname "$0")/gpu_site.sh"
# shellcheck disable=SC2086  # carried folders of wheels, space-separated
install_wheels /tmp/site ${WHEELS:-.whl} || exit 1
# The live Kimi Linear comparison (tests/test_kimi_hf.py) runs transformers 5.23 in a
# subprocess: the image's Python with .whl_ref's transformers in front of its own 5.17.
ref_wheels=${REF_WHEELS:-.whl_ref}
if [ -d "$ref_wheels" ] && [ -z "${KIMI_REFERENCE_PYTHON:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/ref "$ref_wheels"/*.whl || exit 1
  printf '#!/bin/sh\nPYTHONPATH=/tmp/ref:$PYTHONPATH exec python3 "$@"\n' > /tmp/ref/python
  chmod +x /tmp/ref/python
  export KIMI_REFERENCE_PYTHON=/tmp/ref/python
fi
export PYTHONUNBUFFERED=1
# Workers share the GPU. JAX's default allocator keeps each process's peak as a pool it never
# gives back: 14 pools ran the H200's 139 GiB out (11 tests failed with out-of-memory in the
# kernel half); the platform allocator frees each buffer back to CUDA (0 failed).
export XLA_PYTHON_CLIENT_ALLOCATOR=${XLA_PYTHON_CLIENT_ALLOCATOR:-platform}
KERNELS="test_kda.py test_kda_triton.py test_kda_tpu.py test_kda_triton_lowering.py test_infer.py
  test_model.py test_gpu_kernels.py test_cached_attention.py test_mla.py test_ring_step.py
  test_few_rows.py test_grouped_dw.py test_grouped_mgpu.py test_decode_experts.py test_xla_flags.py
  test_triton_precompile.py test_jax_triton_compat.py test_platform.py test_kda_decode.py
  test_decode_moe_layer.py test_cudnn_packed.py"
case "${HALF:-}" in
  "") ;;
  kernels) set -- $(for f in $KERNELS; do echo "tests/$f"; done) "$@" ;;
  rest) set -- $(cd tests && for f in test_*.py; do [[ " "$KERNELS" " == *[[:space:]]$f[[:space:]]* ]] \
                   || echo "tests/$f"; done) "$@" ;;
  *) echo "HALF must be kernels, rest or unset, got '$HALF'" >&2; exit 2 ;;
esac
out=${OUT:-/tmp/gpu_suite}; mkdir -p "$out"
export PYTEST_FAILURE_LOG="$out/failures.txt"; rm -f "$PYTEST_FAILURE_LOG"
SECONDS=0
# --dist load: round-robin, so the long tests conftest collects first start on separate workers.
# SIGINT at the time limit: pytest prints its summary and writes the junit report, unless
# the interrupt lands while xdist tears its workers down.
timeout -s INT -k 30 "${SUITE_TIMEOUT:-3000}" python3 -m pytest -v -n "${WORKERS:-8}" --dist load -rfE --tb=short \
  -o addopts="-p no:cacheprovider" --junitxml="$out/junit.xml" "${@:-tests}" 2>&1 \
  | grep --line-buffered -v "Autotuning cache miss" \
  | while IFS= read -r line; do printf '%4d %s\n' "$SECONDS" "$line"; done > "$out/pytest_gpu.txt"
echo "wall $SECONDS s"
tail -n 3 "$out/pytest_gpu.txt"
python3 - "$out/junit.xml" "$out/pytest_gpu.txt" <<'PY'
import collections, re, sys, xml.etree.ElementTree as ET
rows = collections.defaultdict(collections.Counter)
try:
    for tc in ET.parse(sys.argv[1]).iter("testcase"):
        f = (tc.get("classname") or "?").replace(".", "/") + ".py"
        kind = next((k for k in ("failure", "error", "skipped") if tc.find(k) is not None), "passed")
        rows[f][kind] += 1
        rows[f]["secs"] += float(tc.get("time") or 0)
except Exception as e:   # no report: count the -v lines (no per-test seconds then)
    print(f"no junit report ({e}); counts from the -v lines")
    kinds = {"PASSED": "passed", "FAILED": "failure", "ERROR": "error", "SKIPPED": "skipped"}
    for line in open(sys.argv[2]):
        m = re.search(r"\] (PASSED|FAILED|ERROR|SKIPPED) (tests/[^:]+)::", line)
        if m:
            rows[m[2]][kinds[m[1]]] += 1
print("| file | passed | failed | errors | skipped | test seconds |\n|---|---|---|---|---|---|")
for f, c in sorted(rows.items()):
    print(f"| {f} | {c['passed']} | {c['failure']} | {c['error']} | {c['skipped']} | {c['secs']:.0f} |")
tot = sum(rows.values(), collections.Counter())
print(f"| **all** | {tot['passed']} | {tot['failure']} | {tot['error']} | {tot['skipped']} | {tot['secs']:.0f} |")
PY
[ -s "$PYTEST_FAILURE_LOG" ] && { echo "failures (first lines of each):"; grep -A12 "^==== " "$PYTEST_FAILURE_LOG" | head -150; }
true
