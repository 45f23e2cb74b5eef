#!/usr/bin/env bash
# The device jobs behind benchmarks/grpo_gpu.json and context_gpu.json: scripts/grpo.py
# (configs/grpo.py:h200) and scripts/extend_context.py (configs/stages.py:h200) runs on the
# lent GPU machine. A run outlives a 10-minute job: its workdir stays on the machine's disk
# ($RUNS_DIR/<name>, default /tmp/gpu_runs), SIGTERM before the job's limit checkpoints it,
# and the same command on the same warm machine resumes it. Each job tars every workdir, checkpoints
# left out, to $OUT/<name>.tgz (the device tool returns at most 8 files).
#
#   UNITS="grpo:g1:--config.rl.seed=1 --config.seed=1" bash benchmarks/gpu_runs.sh
#   UNITS="grpo:g1:--config.rl.seed=1 --config.seed=1;grpo:g0off:--config.rl.routing_replay=False" \
#     bash benchmarks/gpu_runs.sh
#   UNITS="context:s1:--config.run.seed=1 --config.run.data.shuffle_seed=1 --nocontrol" \
#     bash benchmarks/gpu_runs.sh
#
# UNITS: kind:name:flags, ';'-separated (kind grpo or context). Several units run side by
# side, one per GPU where the machine has enough, else on one GPU with
# XLA_PYTHON_CLIENT_MEM_FRACTION=$MEM_FRACTION each (default 0.46: GRPO's :h200 needs about
# 30 GB, so three fit an H200's 139 GB at 0.30 but not an H100's 80; a context stage asks for
# 0.95 and runs alone). LIMIT (default 540 s) is when SIGTERM comes, KILL (30 s)
# the grace after it. Carry the wheels in WHEELS (default ".whl_gpu .whl_prof": tokamax imports
# xprof; ".whl_run .whl_prof" is smaller, tests/gpu_wheels.sh). Then, here:
#   tar xzf g1.tgz -C /tmp
#   python -m benchmarks.grpo_gpu --workdirs=/tmp/g1,... --out=benchmarks --machine="..."
#   python -m benchmarks.context_gpu --workdirs=/tmp/s1,... --out=benchmarks --machine="..."
set -o pipefail
: "${UNITS:?UNITS=kind:name:flags[;...] (kind grpo or context)}"
OUT=${OUT:-/tmp/gpu_runs_out}; LIMIT=${LIMIT:-540}; KILL=${KILL:-30}; STAGGER=${STAGGER:-10}
ROOT=${RUNS_DIR:-/tmp/gpu_runs}; SITE=${SITE:-/tmp/site}; mkdir -p "$OUT" "$ROOT"
source tests/gpu_site.sh
# shellcheck disable=SC2086  # folders of wheels, space-separated
install_wheels "$SITE" ${WHEELS:-.whl_gpu .whl_prof} || exit 1
IFS=';' read -ra units <<< "$UNITS"
gpus=$(nvidia-smi -L | wc -l)
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown);" \
  "$gpus GPU(s); ${#units[@]} unit(s)"

run_unit() {   # kind name flags gpu
  local kind=$1 name=$2 flags=$3 gpu=$4 script config
  case $kind in
    grpo) script=scripts/grpo.py; config=configs/grpo.py:h200 ;;
    context) script=scripts/extend_context.py; config=configs/stages.py:h200 ;;
    *) echo "unit $name: kind must be grpo or context, got '$kind'" >&2; return 2 ;;
  esac
  SECONDS=0
  # shellcheck disable=SC2086  # flags split into arguments on purpose
  CUDA_VISIBLE_DEVICES=$gpu timeout --foreground -s TERM -k "$KILL" "$LIMIT" \
    python3 "$script" --config="$config" --workdir="$ROOT/$name" $flags \
    >> "$ROOT/$name.log" 2>&1
  echo "== $name: rc=$? after $SECONDS s"
  grep -vE "Autotuning|it/s\]|step/s" "$ROOT/$name.log" | tail -n 8
  tar czf "$OUT/$name.tgz" --exclude=checkpoints -C "$ROOT" "$name" "$name.log"
}

i=0; pids=()
for u in "${units[@]}"; do
  kind=${u%%:*}; rest=${u#*:}; name=${rest%%:*}; flags=${rest#*:}
  [ "$flags" = "$rest" ] && flags=""
  if [ "$gpus" -ge "${#units[@]}" ]; then gpu=$i; else
    gpu=0; [ ${#units[@]} -gt 1 ] && export XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.46}
  fi
  run_unit "$kind" "$name" "$flags" "$gpu" & pids+=($!)
  i=$((i + 1)); [ "$i" -lt "${#units[@]}" ] && sleep "$STAGGER"   # their compiles overlap less
done
failed=0
for p in "${pids[@]}"; do wait "$p" || failed=1; done
exit $failed
