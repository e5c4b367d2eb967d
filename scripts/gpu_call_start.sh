# Sourced by the one-call GPU scripts (gpu_session7.sh, ...): the repository root, $OUT, the
# environment, the card's name, then the backward kernel's GPU tests (scripts/gpu_backward.sh test,
# log in $OUT/pytest_bwd.log), so that each call starts with the correctness of what it measures.
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name --format=csv,noheader
TEST_TIMEOUT=${TEST_TIMEOUT:-120} bash scripts/gpu_backward.sh test 2>&1 | tail -3
