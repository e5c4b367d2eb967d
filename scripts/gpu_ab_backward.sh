#!/usr/bin/env bash
# On the GPU machine: forward+backward benchmark and peak memory of this tree and of an older
# package (OLD, a directory holding a jax_fa4 package with its built extension; default ab_old/pkg),
# in alternating fresh processes on the same card, so the two builds' numbers are comparable.
#   OUT=... scripts/gpu_ab_backward.sh [rounds]
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
OLD=${OLD:-$PWD/ab_old/pkg}
ROUNDS=${1:-2}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
run() {  # run <label> <pythonpath> <args...>
  local label=$1 pp=$2; shift 2
  echo "== $(date +%T) $label: $*" | tee -a "$OUT/ab_summary.txt"
  PYTHONPATH=$pp timeout ${AB_TIMEOUT:-120} $PY benchmarks/bench_backward_gpu.py "$@" 2>&1 | tee -a "$OUT/ab_summary.txt" | tail -4
}
for m in fa4 cudnn_bf16; do run new "$PWD" /dev/null --peak $m | tail -1; done
run old "$OLD" /dev/null --peak fa4 | tail -1
for r in $(seq 1 "$ROUNDS"); do
  run old "$OLD" "$OUT/bench_old_$r.json" --quick
  run new "$PWD" "$OUT/bench_new_$r.json" --quick
done
