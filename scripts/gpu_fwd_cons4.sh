#!/usr/bin/env bash
# On the GPU machine, one call (~6 min): the four-consumer forward kernel at H = 64
# (JAX_FA4_SM90_CONSUMERS=4, exact scores; csrc/cuda/tile_config.cuh, docs/HOPPER_FORWARD.md "Four
# consumer warpgroups at H = 64"), compiled and read in SASS but never run. In order:
#   1. its GPU tests (tests/test_cuda_forward.py -k four_consumers: the contract for O and lse on
#      every H = 64 case, the row rules, the persistent grid bitwise its own) and the loop-variant
#      test (the other kernels' variants, unchanged, as a control);
#   2. compute-sanitizer racecheck and memcheck on tiny H = 64 forwards with the switch on;
#   3. scripts/probe_fwd_loops.py --consumers: two, three and four consumers at H = 64 (and two,
#      three at H = 128) beside cuDNN bf16 in one process, B=2, T=S=8192, N=16, causal and not.
# A CUDA module carried in jax_fa4/ is used as it is (scripts/gpu_prelude.sh).
source "$(dirname "$0")/gpu_prelude.sh"
echo "== $(date +%T) 1. pytest -k 'four_consumers or loop_variants'"
timeout 200 $PY -m pytest -q -rA -s --no-header -p no:cacheprovider tests/test_cuda_forward.py \
  -k "four_consumers or loop_variants" > "$OUT/pytest_cons4.log" 2>&1
echo "rc=$?"; grep -E "seed|4 consumers|passed|failed|Error" "$OUT/pytest_cons4.log" | tail -12
echo "== $(date +%T) 2. compute-sanitizer, H = 64, four consumers"
cat > /tmp/fa4_fwd_cons4_tiny.py <<'PY'
import numpy as np, jax, jax.numpy as jnp
from jax_fa4 import _cuda_ops as co, mx
rng = np.random.default_rng(0)
for (B, T, S, causal, window, ql, kl) in [(2, 300, 700, True, (90, None), [300, 17], [700, 650]),
                                         (1, 100, 700, False, None, [100], [700])]:
  q = jnp.asarray(rng.standard_normal((B, T, 2, 64)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((B, S, 1, 64)), jnp.float32)
  o = co.forward_mx(mx.quantize(q, 3), mx.quantize(k, 3), mx.quantize(k, 1), jnp.array(ql, jnp.int32),
                    jnp.array(kl, jnp.int32), scale=0.125, is_causal=causal, window=window)
  jax.block_until_ready(o)
print("tiny ok")
PY
for tool in racecheck memcheck; do
  JAX_FA4_SM90_CONSUMERS=4 timeout 90 compute-sanitizer --tool $tool --kernel-name kns=fwd_sm90 --print-limit 20 \
    $PY /tmp/fa4_fwd_cons4_tiny.py > "$OUT/sanitize_cons4_$tool.log" 2>&1
  echo "$tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|tiny ok|Error" "$OUT/sanitize_cons4_$tool.log" | head -4
done
echo "== $(date +%T) 3. probe_fwd_loops.py --consumers"
timeout 240 $PY scripts/probe_fwd_loops.py --consumers --json "$OUT/consumers_probe_cons4.json" 2>&1 | tail -30
ls "$OUT"
