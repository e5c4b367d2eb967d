# Sourced by the GPU-machine scripts (gpu_train.sh, ncu_fwd_source.sh): the repository root as the
# working directory, $OUT for logs (default ./gpu_out), $PY, the environment every run needs
# (this checkout's jax_fa4 first on the path, no XLA preallocation) and log().
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
log() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }
