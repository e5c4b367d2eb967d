#!/usr/bin/env bash
# One device call: install the package as a newcomer would on the GPU machine (no network:
# --no-build-isolation), run the demo, the GPU-side test suite and the quick benchmark.
# Logs under $OUT. Usage: OUT=... bash scripts/gpu_session.sh [pytest targets...]
set -u -o pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
log() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }
log "$(nvidia-smi -L | head -1); $(python3 --version)"
log "pip install --no-build-isolation --no-deps ."
( cd "$REPO" && JAX_FA4_CUDA=ON python3 -m pip install --no-build-isolation --no-deps -v . ) \
  > "$OUT/install.log" 2>&1 || { tail -40 "$OUT/install.log"; log "INSTALL FAILED"; exit 1; }
grep -E "jax_fa4: building|XLA FFI headers" "$OUT/install.log" | tee -a "$OUT/summary.txt"
cd /tmp   # away from the source tree: everything below imports the installed package
python3 -c "import jax, jax_fa4; print('jax', jax.__version__, jax.devices(), jax_fa4.available_backends())" \
  2>&1 | tee -a "$OUT/summary.txt"
log "demo"
timeout 150 python3 "$REPO/examples/demo.py" 2>&1 | tee -a "$OUT/summary.txt"
TESTS=${*:-"$REPO/tests/test_mx.py $REPO/tests/test_reference.py $REPO/tests/test_api.py $REPO/tests/test_cuda_forward.py"}
log "pytest $TESTS"
timeout ${TEST_TIMEOUT:-260} python3 -P -m pytest -q -rfE --no-header -p no:cacheprovider $TESTS \
  > "$OUT/pytest.log" 2>&1
log "pytest rc=$?: $(tail -1 "$OUT/pytest.log")"
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | cut -c1-220 | tee -a "$OUT/summary.txt"
log "benchmark (quick)"
timeout ${BENCH_TIMEOUT:-170} python3 "$REPO/benchmarks/bench_forward_gpu.py" "$OUT/bench_quick.json" --quick \
  2>&1 | tee "$OUT/bench.txt" | tail -30
log "done"
