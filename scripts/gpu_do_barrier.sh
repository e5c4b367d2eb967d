#!/usr/bin/env bash
# On the GPU machine, one call (~6 min): what the backward's barrier (the bf16 copies of q and dO
# wait for the lse, jax_fa4/_cuda_ops.py backward) does to one training step. Builds the CUDA module,
# runs the backward tests (gpu_call_start.sh), then gpu_ab_backward.sh against ab_old/pkg (this tree
# with the barrier line deleted): the step's peak with and without it and cuDNN bf16's, one A/B round
# of forward+backward time; last, XLA's memory report of the step. $OUT keeps at most 8 files.
# A CUDA module carried in jax_fa4/ is used as it is (no build on the device): built on the CPU
# machine with `JAX_FA4_CUDA=ON python3.12 -m pip wheel --no-deps -w /tmp/whl .` (build isolation
# pins jaxlib 0.10.2's FFI headers) and unzipped from the wheel into jax_fa4/.
source "$(dirname "$0")/gpu_call_start.sh"  # root, env, card, the CUDA module, the backward tests
rm -rf ab_old/pkg && mkdir -p ab_old/pkg && cp -r jax_fa4 ab_old/pkg/
sed -i '/optimization_barrier((q, do, lse))/d' ab_old/pkg/jax_fa4/_cuda_ops.py
echo "barrier lines (new, old): $(grep -c 'optimization_barrier((q, do, lse))' jax_fa4/_cuda_ops.py)," \
     "$(grep -c 'optimization_barrier((q, do, lse))' ab_old/pkg/jax_fa4/_cuda_ops.py)"
bash scripts/gpu_ab_backward.sh 1 2>&1 | grep -v "^  mgpu"
bash scripts/gpu_memreport.sh fa4 > /tmp/memreport.log 2>&1
grep -v "^$" /tmp/memreport.log | head -30
rm -f "$OUT"/buffers_fa4.txt.gz "$OUT"/hlo_fa4.txt.gz
ls "$OUT"
