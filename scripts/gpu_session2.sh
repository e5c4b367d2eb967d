#!/usr/bin/env bash
# Second device call: install, the GPU tests after the first call's fixes, and a short
# convergence comparison of the training example (jax_fa4 MXFP8 vs cuDNN bf16 attention).
set -u -o pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
log() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }
log "$(nvidia-smi -L | head -1)"
( cd "$REPO" && JAX_FA4_CUDA=ON python3 -m pip install --no-build-isolation --no-deps . ) \
  > "$OUT/install.log" 2>&1 || { tail -40 "$OUT/install.log"; log "INSTALL FAILED"; exit 1; }
cd /tmp
log "pytest"
timeout 200 python3 -P -m pytest -q -rfExX --no-header -p no:cacheprovider "$REPO/tests/test_mx.py" \
  "$REPO/tests/test_api.py" "$REPO/tests/test_cuda_forward.py" > "$OUT/pytest.log" 2>&1
log "pytest rc=$?: $(tail -1 "$OUT/pytest.log")"
grep -E "^(FAILED|ERROR|XPASS)" "$OUT/pytest.log" | cut -c1-200 | tee -a "$OUT/summary.txt"
for att in jax_fa4 cudnn; do
  log "train $att"
  timeout 190 python3 "$REPO/examples/train_lm.py" --preset 20m --attention $att --steps 300 \
    --warmup 30 --eval-every 100 --eval-batches 8 --time-limit 120 --no-progress --log-every 50 \
    --log "$OUT/$att.json" 2>&1 | tail -12 | tee -a "$OUT/summary.txt"
done
log "done"
