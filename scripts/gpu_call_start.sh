# Sourced by the one-call GPU scripts (gpu_session7.sh, ...): the prelude (gpu_prelude.sh: the
# repository root, $OUT, the environment, the card's name, the CUDA module), then the backward
# kernel's GPU tests (scripts/gpu_backward.sh test, log in $OUT/pytest_bwd.log), so that each call
# starts with the correctness of what it measures.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_prelude.sh"
TEST_TIMEOUT=${TEST_TIMEOUT:-120} bash scripts/gpu_backward.sh test 2>&1 | tail -3
