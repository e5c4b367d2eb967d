"""Forward+backward attention timings and peak memory on one GPU, in one process.

  fa4        jax.grad through jax_fa4.dot_product_attention from bf16 inputs (quantization, the
             sm_90a forward and backward kernels included), non-deterministic dQ adds
  fa4_det    the same with deterministic=True (ordered dQ adds)
  cudnn_bf16 jax.grad through jax.nn.dot_product_attention(implementation='cudnn'), bf16
FLOPs of forward+backward = 3.5 x the forward's 4*B*T*S*N*H (2 + 5 GEMMs of 2HTS), halved for causal.
Peak memory (--peak METHOD, one fresh process per method): the device's peak_bytes_in_use after one
jitted step (inputs included; XLA_PYTHON_CLIENT_PREALLOCATE=false so the peak is what XLA used).

  python benchmarks/bench_backward_gpu.py OUT.json [--quick]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

import jax_fa4


def time_fn(fn, args, warmup=2, burst=5, repeats=5):
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(burst):
      out = fn(*args)
    jax.block_until_ready(out)
    ts.append((time.perf_counter() - t0) / burst)
  return statistics.median(ts)


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("out")
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--peak", choices=("fa4", "cudnn_bf16"),
                  help="only run one step of this method (B=2, T=S=8192, N=16, H=128, non-causal) and "
                       "print the process's peak bytes in use: run once per method, each in a fresh process")
  a = ap.parse_args(argv)
  if a.peak:
    B, T, N, H = 2, 8192, 16, 128
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v, w = (jax.random.normal(kk, (B, T, N, H), jnp.float32).astype(jnp.bfloat16) for kk in ks)
    attn = (lambda q, k, v: jax_fa4.dot_product_attention(q, k, v)) if a.peak == "fa4" else (
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))
    f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32) * w), (0, 1, 2)))
    jax.block_until_ready(f(q, k, v))
    st = jax.devices()[0].memory_stats()
    inputs = 4 * B * T * N * H * 2
    print(f"peak {a.peak} ({jax.devices()[0].device_kind}): {st['peak_bytes_in_use'] / 2**30:.3f} GiB "
          f"(inputs q, k, v, w: {inputs / 2**30:.3f} GiB)")
    return
  card = jax.devices()[0].device_kind
  print(f"device: {card}; jax {jax.__version__}")
  shapes = [(2, 8192, 16, 128)] if a.quick else [(2, 8192, 16, 128), (4, 4096, 16, 64), (2, 4096, 16, 256)]
  rows = []
  print(f"{'shape':>28} {'causal':>6} | {'fa4 us / TF/s':>18} | {'fa4_det us / TF/s':>18} | {'cudnn_bf16 us / TF/s':>20} | fa4/cudnn")
  for B, T, N, H in shapes:
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v, w = (jax.random.normal(kk, (B, T, N, H), jnp.float32).astype(jnp.bfloat16) for kk in ks)
    for causal in (False, True):
      flops = 3.5 * 4.0 * B * T * T * N * H * (0.5 if causal else 1.0)
      res = dict(B=B, T=T, N=N, H=H, causal=causal, card=card, us={})

      def grad_of(attn):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32) * w), (0, 1, 2)))

      fns = {
          "fa4": grad_of(lambda q, k, v: jax_fa4.dot_product_attention(q, k, v, is_causal=causal)),
          "fa4_det": grad_of(lambda q, k, v: jax_fa4.dot_product_attention(q, k, v, is_causal=causal,
                                                                           deterministic=True)),
          "cudnn_bf16": grad_of(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                                             implementation="cudnn")),
      }
      for name, f in fns.items():
        try:
          res["us"][name] = time_fn(f, (q, k, v)) * 1e6
        except Exception as e:  # noqa: BLE001  (a baseline that cannot run is reported, not fatal)
          res["us"][name] = None
          print(f"  {name} failed: {type(e).__name__}: {str(e)[:200]}")
      cell = lambda n: (f"{res['us'][n]:.0f} / {flops / res['us'][n] / 1e6:.0f}" if res["us"].get(n) else "n/a")
      ratio = (res["us"]["cudnn_bf16"] / res["us"]["fa4"]) if res["us"].get("fa4") and res["us"].get("cudnn_bf16") else float("nan")
      print(f"{f'B{B} T=S={T} N{N} H{H}':>28} {str(causal):>6} | {cell('fa4'):>18} | {cell('fa4_det'):>18} | "
            f"{cell('cudnn_bf16'):>20} | {ratio:.2f}x", flush=True)
      rows.append(res)
  with open(a.out, "w") as f:
    json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
