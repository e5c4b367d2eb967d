#!/usr/bin/env bash
# On the GPU machine: build the CUDA module (scripts/gpu_forward.sh's build stage), then the backward
# kernel's GPU tests, the forward tests, the forward+backward benchmark and peak memory, and
# compute-sanitizer on a tiny backward. Logs go to $OUT.
#   scripts/gpu_backward.sh [stages]   stages: any of build,test,fwdtest,bench,peak,sanitize
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
STAGES=${1:-build,test,fwdtest,bench,peak,sanitize}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
has() { [[ ",$STAGES," == *",$1,"* ]]; }
log() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }
if has build; then OUT=$OUT bash scripts/gpu_forward.sh build || exit 1; fi
if has test; then
  log "pytest tests/test_cuda_backward.py"
  timeout ${TEST_TIMEOUT:-240} $PY -m pytest -q -rA -s --no-header -p no:cacheprovider -x --maxfail=5 \
    tests/test_cuda_backward.py > "$OUT/pytest_bwd.log" 2>&1
  echo "rc=$?"; grep -E "seed|kernel .* recipe|passed|failed|Error|error" "$OUT/pytest_bwd.log" | tail -70
fi
if has fwdtest; then
  log "pytest tests/test_cuda_forward.py tests/test_api.py"
  timeout ${FWD_TIMEOUT:-200} $PY -m pytest -q --no-header -p no:cacheprovider tests/test_cuda_forward.py tests/test_api.py \
    > "$OUT/pytest_fwd.log" 2>&1
  echo "rc=$?"; grep -E "FAILED|passed|failed" "$OUT/pytest_fwd.log" | tail -15
fi
if has bench; then
  log "forward+backward benchmark"
  timeout ${BENCH_TIMEOUT:-150} $PY benchmarks/bench_backward_gpu.py "$OUT/bench_bwd.json" ${BENCH_ARGS:---quick} 2>&1 | tee -a "$OUT/summary.txt"
fi
if has peak; then
  for m in fa4 cudnn_bf16; do timeout 90 $PY benchmarks/bench_backward_gpu.py /dev/null --peak $m 2>&1 | tail -1 | tee -a "$OUT/summary.txt"; done
fi
if has sanitize; then
  cat > /tmp/fa4_bwd_tiny.py <<'PY'
import numpy as np, jax, jax.numpy as jnp
from jax_fa4 import _cuda_ops as co, mx
rng = np.random.default_rng(0)
for H in (64, 128, 256):
  q = jnp.asarray(rng.standard_normal((2, 130, 2, H)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((2, 200, 1, H)), jnp.float32)
  ql, kl = jnp.array([130, 7], jnp.int32), jnp.array([200, 0], jnp.int32)
  qm, km = mx.quantize(q, 3), mx.quantize(k, 3)
  o, lse = co.forward_mx(qm, km, mx.quantize(k, 1), ql, kl, scale=0.1, is_causal=True, window=(40, None), out_dtype=jnp.float32)
  for det in (False, True):
    g = co.backward(qm, km, km, qm, lse, jnp.sum(o * q, -1), ql, kl, scale=0.1, is_causal=True, window=(40, None), deterministic=det)
    jax.block_until_ready(g)
print("tiny ok")
PY
  for tool in memcheck racecheck; do
    log "compute-sanitizer --tool $tool (backward)"
    timeout ${SAN_TIMEOUT:-100} compute-sanitizer --tool $tool --kernel-name kns=bwd_sm90 --print-limit 20 $PY /tmp/fa4_bwd_tiny.py \
      > "$OUT/sanitize_bwd_$tool.log" 2>&1
    echo "rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|tiny ok|Error|error" "$OUT/sanitize_bwd_$tool.log" | head -8
  done
fi
log "done"
