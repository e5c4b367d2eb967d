#!/usr/bin/env bash
# On the GPU machine, one call, the most wanted results first (a timeout keeps what came before):
# the backward tests of this tree (bwd-grid-order), one A/B round of forward+backward against main
# (ab_old/pkg), bitwise digests and backward timings of main, this tree and ab_old/xchg
# (bwd-xchg-early: S-block bytes posted before the T-blocks), XLA's memory report of the step, and
# racecheck on a tiny backward. Logs fold into $OUT/run.log (the device tool brings back 8 files).
source "$(dirname "$0")/gpu_call_start.sh"
bash scripts/gpu_ab_backward.sh 1 2>&1 | grep -v "^  mgpu"
for a in main:ab_old/pkg grid:. xchg:ab_old/xchg; do
  n=${a%%:*}; d=${a#*:}
  echo "== $(date +%T) digest + backward timing: $n ($d)"
  PYTHONPATH=$PWD/$d timeout 100 python3 scripts/bwd_ab_digest.py /tmp/dig_$n.json --time 2>&1 | grep -E "backward|Error|error" | tee -a "$OUT/dig.log"
done
for n in grid xchg; do echo "== digests main vs $n"; python3 scripts/bwd_ab_digest.py --compare /tmp/dig_main.json /tmp/dig_$n.json | tail -3 | tee -a "$OUT/dig.log"; done
cat "$OUT/pytest_bwd.log" "$OUT/ab_summary.txt" "$OUT/dig.log" > "$OUT/run.log" 2>/dev/null
rm -f "$OUT"/bench_*.json "$OUT/summary.txt" "$OUT/pytest_bwd.log" "$OUT/ab_summary.txt" "$OUT/dig.log"
bash scripts/gpu_memreport.sh fa4 cudnn_bf16 > /tmp/memreport.log 2>&1
grep -v "^$" /tmp/memreport.log | head -40
SAN_TOOLS=racecheck SAN_FWD=0 SAN_H=128 SAN_TIMEOUT=60 bash scripts/gpu_backward.sh sanitize
head -c 2000 "$OUT/sanitize_bwd_racecheck.log"; rm -f "$OUT/summary.txt"
ls "$OUT"
