#!/usr/bin/env bash
# On the GPU machine: XLA's memory-usage report and buffer assignment of one jitted forward+backward
# step (benchmarks/bench_backward_gpu.py --peak METHOD), for each METHOD given, into $OUT.
#   OUT=... scripts/gpu_memreport.sh fa4 cudnn_bf16
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
for m in "$@"; do
  d=/tmp/xla_dump_$m; rm -rf $d
  XLA_FLAGS="--xla_dump_to=$d --xla_dump_hlo_as_text" python3 benchmarks/bench_backward_gpu.py /dev/null --peak $m | tail -1
  r=$(ls -S $d/*memory-usage-report* 2>/dev/null | head -1)
  [ -n "$r" ] && cp "$r" "$OUT/memreport_$m.txt" && head -40 "$r"
  ba=$(ls -S $d/*buffer-assignment* 2>/dev/null | head -1)
  [ -n "$ba" ] && gzip -c "$ba" > "$OUT/buffers_$m.txt.gz"
  ho=$(ls -S $d/*after_optimizations.txt 2>/dev/null | head -1)
  [ -n "$ho" ] && gzip -c "$ho" > "$OUT/hlo_$m.txt.gz"
done
