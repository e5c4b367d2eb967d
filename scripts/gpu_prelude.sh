# Sourced by the one-call GPU scripts (gpu_bwd_dqwg.sh, gpu_fwd_cons4.sh; gpu_call_start.sh for the others):
# the repository root, $OUT, the environment, $PY, the card's name, and the CUDA module: the one
# carried in jax_fa4/ as it is (built on the CPU machine: scripts/gpu_do_barrier.sh's header says
# how), else built here (scripts/gpu_forward.sh build).
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name --format=csv,noheader
ls jax_fa4/_jax_fa4_cuda*.so >/dev/null 2>&1 || bash scripts/gpu_forward.sh build || exit 1
