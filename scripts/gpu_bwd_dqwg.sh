#!/usr/bin/env bash
# On the GPU machine, one call (~7 min): the dQ-warpgroup backward kernel (JAX_FA4_SM90_BWD_DQWG=1,
# H <= 128; csrc/cuda/tile_config.cuh, docs/HOPPER_BACKWARD.md "The dQ warpgroup"), which had
# been compiled and read in SASS but never run. In order, so that a call cut at its limit still
# returns the most telling part:
#   1. its GPU tests (tests/test_cuda_backward.py -k dq_warpgroup: the contract on every H = 64
#      and H = 128 case, dK / dV bitwise the default kernel's, deterministic mode bitwise, jit + vmap);
#   2. compute-sanitizer racecheck and memcheck on tiny H = 64 and 128 backwards with the switch on (its
#      synchronisation is new: dS^T buffers handed over by mbarriers instead of a named barrier);
#   3. digests of both settings (H = 256 must not move; at H = 64 and 128 dK / dV must not, dQ may)
#      and the backward's time at H = 64 and 128, in alternating processes, two rounds;
#   4. the whole backward test file with the switch on (every H <= 128 test, H = 256 unchanged).
# A CUDA module carried in jax_fa4/ is used as it is (scripts/gpu_prelude.sh).
source "$(dirname "$0")/gpu_prelude.sh"
echo "== $(date +%T) 1. pytest -k dq_warpgroup"
timeout 150 $PY -m pytest -q -rA -s --no-header -p no:cacheprovider tests/test_cuda_backward.py -k dq_warpgroup \
  > "$OUT/pytest_dqwg.log" 2>&1
echo "rc=$?"; grep -E "seed|dQ warpgroup|passed|failed|Error" "$OUT/pytest_dqwg.log" | tail -20
echo "== $(date +%T) 2. compute-sanitizer, H = 64 and 128, switch on"
JAX_FA4_SM90_BWD_DQWG=1 SAN_H="64 128" SAN_FWD=0 SAN_TOOLS="racecheck memcheck" SAN_TIMEOUT=90 \
  bash scripts/gpu_backward.sh sanitize 2>&1 | grep -v "^==.*compute-sanitizer" | tail -8
echo "== $(date +%T) 3. digests and backward time, default (0) and dQ warpgroup (1), alternating"
for r in 1 2; do
  for v in 0 1; do
    JAX_FA4_SM90_BWD_DQWG=$v timeout 120 $PY scripts/bwd_ab_digest.py "$OUT/ab_dqwg${v}_$r.json" --time 64 128 2>&1 \
      | grep "backward (co.backward"
  done
done
$PY scripts/bwd_ab_digest.py --compare "$OUT/ab_dqwg0_1.json" "$OUT/ab_dqwg1_1.json"
$PY scripts/bwd_ab_digest.py --compare "$OUT/ab_dqwg1_1.json" "$OUT/ab_dqwg1_2.json" | tail -1
echo "== $(date +%T) 4. pytest tests/test_cuda_backward.py, switch on"
JAX_FA4_SM90_BWD_DQWG=1 timeout 200 $PY -m pytest -q --no-header -p no:cacheprovider tests/test_cuda_backward.py \
  > "$OUT/pytest_bwd_dqwg_on.log" 2>&1
echo "rc=$?"; grep -E "FAILED|passed|failed" "$OUT/pytest_bwd_dqwg_on.log" | tail -8
ls "$OUT"
