#!/usr/bin/env bash
# On the GPU machine: the training example's short convergence comparison (docs/TRAINING.md
# section 3), jax_fa4 MXFP8 attention (Hopper kernels, forward and backward) vs cuDNN bf16.
# Logs and JSON go to $OUT (default ./gpu_out). Env: TRAIN_STEPS (300), TRAIN_LIMIT (seconds of
# training per run, 120), TRAIN_TIMEOUT (per run, 200).
set -u -o pipefail
source "$(dirname "$0")/gpu_env.sh"
log "$(nvidia-smi -L 2>/dev/null | head -1)"
for att in jax_fa4 cudnn; do
  log "train $att"
  timeout ${TRAIN_TIMEOUT:-200} $PY examples/train_lm.py --preset 20m --attention $att --steps ${TRAIN_STEPS:-300} \
    --warmup 30 --eval-every 100 --eval-batches 8 --time-limit ${TRAIN_LIMIT:-120} --no-progress --log-every 50 \
    --log "$OUT/train_$att.json" 2>&1 | tail -12 | tee -a "$OUT/summary.txt"
done
log "train done"
