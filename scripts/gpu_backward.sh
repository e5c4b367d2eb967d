#!/usr/bin/env bash
# On the GPU machine: build the CUDA module (scripts/gpu_forward.sh's build stage), then the backward
# kernel's GPU tests, the forward tests, the forward+backward benchmark and peak memory, and
# compute-sanitizer on a tiny backward. Logs go to $OUT.
#   scripts/gpu_backward.sh [stages]   stages: any of build,test,fwdtest,bench,peak,sanitize,ncu
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
  # Tiny shapes with more query tiles than stages (the ring wraps), both dQ modes; then a forward
  # with more key tiles than stages, both score paths, so racecheck sees the forward's ring wrap too.
  cat > /tmp/fa4_bwd_tiny.py <<'PY'
import os, numpy as np, jax, jax.numpy as jnp
from jax_fa4 import _cuda_ops as co, mx
rng = np.random.default_rng(0)
for H in [int(h) for h in os.environ.get("SAN_H", "64 128 256").split()]:
  q = jnp.asarray(rng.standard_normal((2, 130, 2, H)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((2, 200, 1, H)), jnp.float32)
  ql, kl = jnp.array([130, 7], jnp.int32), jnp.array([200, 0], jnp.int32)
  qm, km = mx.quantize(q, 3), mx.quantize(k, 3)
  o, lse = co.forward_mx(qm, km, mx.quantize(k, 1), ql, kl, scale=0.1, is_causal=True, window=(40, None), out_dtype=jnp.float32)
  for det in (False, True):
    g = co.backward(qm, km, km, qm, lse, jnp.sum(o * q, -1), ql, kl, scale=0.1, is_causal=True, window=(40, None), deterministic=det)
    jax.block_until_ready(g)
    # bf16 dQ in chunks of one batch x one kv head, written over q's bf16 copy (two chunks here)
    g = co.backward(qm, km, km, qm, lse, jnp.sum(o * q, -1), ql, kl, scale=0.1, is_causal=True, window=(40, None),
                    deterministic=det, dq_dtype=jnp.bfloat16, _dq_chunk=(1, 1))
    jax.block_until_ready(g)
  if os.environ.get("SAN_FWD", "1") == "1":
    kf = jnp.asarray(rng.standard_normal((1, 700, 1, H)), jnp.float32)
    qf = q[:1, :100]
    for sc in co.SCORES:
      jax.block_until_ready(co.forward_mx(mx.quantize(qf, 3), mx.quantize(kf, 3), mx.quantize(kf, 1), jnp.array([100], jnp.int32),
                                          jnp.array([700], jnp.int32), scale=0.1, scores=sc))
print("tiny ok")
PY
  for tool in ${SAN_TOOLS:-memcheck racecheck}; do
    log "compute-sanitizer --tool $tool (sm90 kernels, H in ${SAN_H:-64 128 256})"
    timeout ${SAN_TIMEOUT:-100} compute-sanitizer --tool $tool --kernel-name kns=sm90 --print-limit 20 $PY /tmp/fa4_bwd_tiny.py \
      > "$OUT/sanitize_bwd_$tool.log" 2>&1
    echo "rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|tiny ok|Error|error" "$OUT/sanitize_bwd_$tool.log" | head -8
  done
fi
if has ncu; then
  # Hardware counters of one backward launch (B=2, T=S=8192, N=16, H=128): pipes, stalls, memory,
  # and the per-instruction stall samples (source page, SASS) to place the time.
  cat > /tmp/fa4_bwd_prof.py <<'PY'
import jax, jax.numpy as jnp
from jax_fa4 import _cuda_ops as co, mx
B, T, N, H = 2, 8192, 16, 128
ks = jax.random.split(jax.random.key(0), 4)
q, k, v, do = (jax.random.normal(kk, (B, T, N, H), jnp.float32).astype(jnp.bfloat16) for kk in ks)
qm, km, vm, dom = (mx.quantize(x, 3) for x in (q, k, v, do))
L = jnp.full((B,), T, jnp.int32)
o, lse = co.forward_mx(qm, km, mx.quantize(v, 1), L, L, scale=H ** -0.5)
delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), -1)
jax.block_until_ready(co.backward(qm, km, vm, dom, lse, delta, L, L, scale=H ** -0.5))
print("prof ok")
PY
  log "ncu: bwd kernel"
  timeout ${NCU_TIMEOUT:-240} ncu --clock-control none -k regex:bwd_sm90 -c 1 --set full --import-source no \
    -o "$OUT/bwd" $PY /tmp/fa4_bwd_prof.py > "$OUT/ncu_run.txt" 2>&1
  echo "ncu rc=$?"; tail -3 "$OUT/ncu_run.txt"
  ncu -i "$OUT/bwd.ncu-rep" --page details > "$OUT/ncu_bwd.txt" 2>&1
  ncu -i "$OUT/bwd.ncu-rep" --page raw --csv > "$OUT/ncu_bwd_raw.csv" 2>&1
  ncu -i "$OUT/bwd.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_bwd_sass.csv" 2>&1
  ls -la "$OUT"; grep -E "Duration|Throughput|Pipe|Stall|Issue|Warp Cycles|L2|DRAM" "$OUT/ncu_bwd.txt" | head -60
fi
log "done"
