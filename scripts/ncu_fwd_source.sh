#!/usr/bin/env bash
# On the GPU machine: per-instruction warp-stall samples (ncu SourceCounters) of one forward launch
# (B=2, T=S=8192, N=16, H=128, MX inputs) per configuration "scores:pipeline_bits:persistent", and a
# table of the instructions where the consumer warps stall most. Logs go to $OUT.
#   scripts/ncu_fwd_source.sh [exact:0:0 fp8:0:0 ...]
set -u -o pipefail
source "$(dirname "$0")/gpu_env.sh"
cat > /tmp/fa4_prof1.py <<'PY'
import os, sys, jax, jax.numpy as jnp
from jax_fa4 import _cuda_ops as co, mx
B, T, N, H = 2, 8192, 16, int(os.environ.get("PROF_H", "128"))
ks = jax.random.split(jax.random.key(0), 3)
q, k, v = (jax.random.normal(kk, (B, T, N, H), jnp.float32).astype(jnp.bfloat16) for kk in ks)
qm, km, vm = mx.quantize(q, 3), mx.quantize(k, 3), mx.quantize(v, 1)
L = jnp.full((B,), T, jnp.int32)
jax.block_until_ready(co.forward_mx(qm, km, vm, L, L, scale=H ** -0.5, scores=sys.argv[1],
                                    is_causal=os.environ.get("PROF_CAUSAL", "0") == "1"))
print("prof ok")
PY
for cfg in "${@:-exact:0:0}"; do
  IFS=: read -r sc bits pers <<< "$cfg"
  tag="${sc}_${bits}_${pers}"
  echo "== ncu source counters: scores=$sc JAX_FA4_SM90_PIPELINE=$bits JAX_FA4_SM90_PERSISTENT=$pers"
  JAX_FA4_SM90_PIPELINE=$bits JAX_FA4_SM90_PERSISTENT=$pers timeout ${NCU_TIMEOUT:-150} ncu --clock-control none \
    -k regex:fwd_sm90 -c 1 --section SourceCounters --section WarpStateStats --section SpeedOfLight \
    --metrics "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active" \
    -f -o /tmp/prof_$tag $PY /tmp/fa4_prof1.py "$sc" > "$OUT/ncu_$tag.log" 2>&1 || { echo "ncu failed"; tail -5 "$OUT/ncu_$tag.log"; continue; }
  ncu -i /tmp/prof_$tag.ncu-rep --page details --print-units base 2>/dev/null | grep -E "Duration|pipe_tensor|pipe_xu|issue_active|Stall|Warp Cycles" | head -12
  ncu -i /tmp/prof_$tag.ncu-rep --page source --csv --print-source sass > /tmp/src_$tag.csv 2>/dev/null
  $PY scripts/ncu_top_stalls.py /tmp/src_$tag.csv 45 > "$OUT/stalls_$tag.txt"; head -${TOP:-25} "$OUT/stalls_$tag.txt" | cut -c1-200
  [ "${KEEP_CSV:-0}" = 1 ] && gzip -c /tmp/src_$tag.csv > "$OUT/src_$tag.csv.gz"
done
