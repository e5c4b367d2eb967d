"""On the GPU: the backward kernel alone (co.backward) with a bf16 dQ in each dQ chunking, beside the
fp32 dQ, at B=2, T=S=8192, N=16, H=128 (causal and not), to place the cost of the chunk boundaries
(each chunk's kernel drains the GPU before the next starts).

  python scripts/probe_dq_chunks.py
"""
import jax
import jax.numpy as jnp

from jax_fa4 import _cuda_ops as co
from jax_fa4 import mx
import sys
sys.path.insert(0, "benchmarks")
from bench_backward_gpu import time_fn  # noqa: E402

B, T, N, H = 2, 8192, 16, 128
ks = jax.random.split(jax.random.key(0), 4)
q, k, v, w = (jax.random.normal(kk, (B, T, N, H), jnp.float32).astype(jnp.bfloat16) for kk in ks)
L = jnp.full((B,), T, jnp.int32)
qm, km, vm = (mx.quantize(x, 3) for x in (q, k, v))
print(f"device: {jax.devices()[0].device_kind}")
for causal in (False, True):
  o, lse = co.forward_mx(qm, km, mx.quantize(v, 1), L, L, scale=H ** -0.5, is_causal=causal)
  delta = jnp.sum(o.astype(jnp.float32) * w.astype(jnp.float32), -1)
  for det in (False, True):
    for dq_dtype, chunk in ((jnp.float32, None), (jnp.bfloat16, (2, 16)), (jnp.bfloat16, (1, 16)),
                            (jnp.bfloat16, (1, 8)), (jnp.bfloat16, (1, 4))):
      f = jax.jit(lambda *a, dq_dtype=dq_dtype, chunk=chunk: co.backward(
          *a, scale=H ** -0.5, is_causal=causal, deterministic=det, dkv_dtype=jnp.bfloat16, dq_dtype=dq_dtype,
          _dq_chunk=chunk))
      us = time_fn(f, (qm, km, vm, w, lse, delta, L, L)) * 1e6
      print(f"causal={causal!s:5} det={det!s:5} dq={jnp.dtype(dq_dtype).name:8} chunk={chunk}: {us:7.0f} us", flush=True)
