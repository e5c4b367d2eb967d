#!/usr/bin/env bash
# NOTE: the loop variants 1/3 for the exact path, bit 2 in the sequential loop and JAX_FA4_SM90_PERSISTENT
# belong to the kernel of commits 53fb31e..34f6462, reverted in 8829a8f (docs/HOPPER_FORWARD.md, "Loop
# variants and a persistent scheduler"); against the kernel in this tree they select nothing new.
# One device call (<= 600 s): build; the forward's loop variants (bit-identity + timings); the GPU
# tests of the forward, API, MX quantizer and backward; the quick forward and forward+backward
# benchmarks; racecheck on tiny shapes with ping-pong and a 2-CTA persistent grid. Every test and
# benchmark stage runs with JAX_FA4_SM90_PIPELINE=${PIPE:-3} (the loop variant under test). Logs: $OUT.
set -u -o pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/gpu_out} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT"
PY=${PYTHON:-python3}
log() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }
T0=$(date +%s)
left() { echo $(( ${BUDGET:-575} - ($(date +%s) - T0) )); }
# Runs "$@" with a timeout of min($1, time left - reserve $2).
run_for() { local want=$1 reserve=$2; shift 2; local l=$(( $(left) - reserve )); (( l > want )) && l=$want;
  if (( l < 15 )); then log "skipped (no time left): $*"; return 99; fi; timeout "$l" "$@"; }

# PREBUILT=1: use a carried jax_fa4/_jax_fa4_cuda*.so (built on the dev machine) if it imports here.
if [ "${PREBUILT:-0}" = 1 ] && PYTHONPATH=$PWD $PY -c "from jax_fa4 import _jax_fa4_cuda as m; m.registrations()"; then
  log "prebuilt module: $(ls jax_fa4/_jax_fa4_cuda*.so)"; bash scripts/gpu_forward.sh sass
else
  bash scripts/gpu_forward.sh build,sass || exit 1
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # (the probe failed without it on 2026-12-05)
log "loops probe"
QUICK=""; (( $(left) < 450 )) && QUICK=--quick  # a short lease: H = 128 timings only
run_for 140 $([ -n "$QUICK" ] && echo 230 || echo 300) $PY scripts/probe_fwd_loops.py $QUICK --json "$OUT/loops.json" 2>&1 | tee "$OUT/loops.log" | grep -vE "bitwise equal$" | tail -60
export JAX_FA4_SM90_PIPELINE=${PIPE:-3}
log "pytest forward/api/mx (JAX_FA4_SM90_PIPELINE=$JAX_FA4_SM90_PIPELINE)"
run_for 170 130 $PY -m pytest -q -rfE --no-header -p no:cacheprovider tests/test_cuda_forward.py tests/test_api.py \
  tests/test_mx.py > "$OUT/pytest_fwd.log" 2>&1
echo "rc=$?"; grep -E "seed|FAILED|ERROR|passed|failed" "$OUT/pytest_fwd.log" | tail -25
log "quick forward benchmark"
run_for 45 85 $PY benchmarks/bench_forward_gpu.py "$OUT/bench_fwd.json" --quick 2>&1 | tee "$OUT/bench_fwd.log" | tail -22
log "racecheck (ping-pong, persistent grid of 2 CTAs)"
JAX_FA4_SM90_PERSISTENT=2 SAN_TOOLS=racecheck SAN_TIMEOUT=$(( $(left) > 100 ? 70 : $(left) - 30 )) bash scripts/gpu_forward.sh sanitize
log "pytest backward"
run_for 90 25 $PY -m pytest -q -rfE --no-header -p no:cacheprovider tests/test_cuda_backward.py > "$OUT/pytest_bwd.log" 2>&1
echo "rc=$?"; grep -E "seed|FAILED|ERROR|passed|failed" "$OUT/pytest_bwd.log" | tail -12
log "quick forward+backward benchmark"
run_for 80 3 $PY benchmarks/bench_backward_gpu.py "$OUT/bench_bwd.json" --quick 2>&1 | tee "$OUT/bench_bwd.log" | tail -12
log "done"
