#!/usr/bin/env bash
# On the GPU machine, one call (~7 min): the branch's backward tests, the A/B of this tree against
# main's package in ab_old/pkg (peaks, then alternating --quick rounds), XLA's memory report of the
# step, the backward alone per dQ chunking, and racecheck on a tiny backward; only small files are
# left in $OUT (the device tool brings back 8 at most).
#   OUT=... scripts/gpu_grid_order.sh
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/card.txt"
TEST_TIMEOUT=120 bash scripts/gpu_backward.sh test 2>&1 | tail -3
bash scripts/gpu_ab_backward.sh ${AB_ROUNDS:-2} 2>&1 | grep -v "^  mgpu"
bash scripts/gpu_memreport.sh fa4 cudnn_bf16 > "$OUT/memreport.log" 2>&1
grep -v "^$" "$OUT/memreport.log" | head -40
[ "${PROBE:-1}" = 1 ] && PYTHONPATH=$PWD timeout 120 python3 scripts/probe_dq_chunks.py 2>&1 | grep -v Warn | tee "$OUT/probe.log"
SAN_TOOLS=racecheck SAN_FWD=0 SAN_H=128 SAN_TIMEOUT=60 bash scripts/gpu_backward.sh sanitize
head -c 3000 "$OUT/sanitize_bwd_racecheck.log"
# Keep what matters under the 8-file limit: logs folded into one.
cat "$OUT/pytest_bwd.log" "$OUT/ab_summary.txt" "$OUT/probe.log" "$OUT/sanitize_bwd_racecheck.log" > "$OUT/run.log" 2>/dev/null
rm -f "$OUT"/bench_*.json "$OUT/summary.txt" "$OUT/pytest_bwd.log" "$OUT/ab_summary.txt" "$OUT/probe.log" \
  "$OUT"/sanitize_bwd_*.log "$OUT/memreport.log" "$OUT/card.txt"
ls "$OUT"
