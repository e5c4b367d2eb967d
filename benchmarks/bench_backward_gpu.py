"""Forward+backward attention timings and peak memory on one GPU, in one process.

  fa4        jax.grad through jax_fa4.dot_product_attention from bf16 inputs (quantization, the
             sm_90a forward and backward kernels included), non-deterministic dQ adds
  fa4_det    the same with deterministic=True (ordered dQ adds)
  cudnn_bf16 jax.grad through jax.nn.dot_product_attention(implementation='cudnn'), bf16
  cudnn_fp8  the vjp of jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(use_fp8=True),
             e4m3 inputs and dO, unit scales (cuDNN's per-tensor FP8 forward+backward)
  mgpu_fp16  jax.grad through jax.experimental.pallas.ops.gpu.attention_mgpu.attention, fp16
             (Pallas Mosaic-GPU; non-causal only, as the issue asks)
  fa4_bwd    the sm_90a backward kernel alone (_cuda_ops.backward on prepared MX operands, lse and
             delta): 2.5 x the forward's FLOPs; its ratio column is against nothing (see fa4)
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
from jax_fa4 import _cuda_ops as co
from jax_fa4 import mx


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
    f = jax.jit(jax.grad(lambda q, k, v, w: jnp.sum(attn(q, k, v).astype(jnp.float32) * w), (0, 1, 2)))
    jax.block_until_ready(f(q, k, v, w))
    st = jax.devices()[0].memory_stats()
    inputs = 4 * B * T * N * H * 2
    print(f"peak {a.peak} ({jax.devices()[0].device_kind}): {st['peak_bytes_in_use'] / 2**30:.3f} GiB "
          f"(inputs q, k, v, w: {inputs / 2**30:.3f} GiB)")
    return
  card = jax.devices()[0].device_kind
  print(f"device: {card}; jax {jax.__version__}")
  shapes = [(2, 8192, 16, 128)] if a.quick else [(2, 8192, 16, 128), (4, 4096, 16, 64), (2, 4096, 16, 256)]
  rows = []
  names = ("fa4", "fa4_det", "fa4_bwd", "cudnn_bf16", "cudnn_fp8", "mgpu_fp16")
  print(f"{'shape':>28} {'causal':>6} | " + " | ".join(f"{n + ' us / TF/s':>20}" for n in names)
        + " | fa4/cudnn_bf16 | fa4/cudnn_fp8")
  for B, T, N, H in shapes:
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v, w = (jax.random.normal(kk, (B, T, N, H), jnp.float32).astype(jnp.bfloat16) for kk in ks)
    scale = H ** -0.5
    for causal in (False, True):
      flops = 3.5 * 4.0 * B * T * T * N * H * (0.5 if causal else 1.0)
      res = dict(B=B, T=T, N=N, H=H, causal=causal, card=card, us={})

      # The upstream gradient w is an argument, not a closed-over constant: XLA would otherwise fold
      # dO's MX quantization into the executable at compile time (seen: "constant folding ...
      # _quantize"), and fa4's step would skip that pass.
      def grad_of(attn):
        return jax.jit(jax.grad(lambda q, k, v, w: jnp.sum(attn(q, k, v).astype(jnp.float32) * w), (0, 1, 2)))

      def fa4_bwd_alone():
        # The kernel's operands as the custom_vjp's backward makes them, then the kernel alone.
        L = jnp.full((B,), T, jnp.int32)
        qm, km, vm, dom = (mx.quantize(x, 3) for x in (q, k, v, w))
        o, lse = co.forward_mx(qm, km, mx.quantize(v, 1), L, L, scale=scale, is_causal=causal)
        delta = jnp.sum(o.astype(jnp.float32) * w.astype(jnp.float32), -1)
        f = jax.jit(lambda *a: co.backward(*a, scale=scale, is_causal=causal, dkv_dtype=jnp.bfloat16))
        return f, (qm, km, vm, dom, lse, delta, L, L)

      def cudnn_fp8():
        from jax._src.cudnn import fused_attention_stablehlo as fas
        params = {name: jnp.ones((1, 1, 1, 1), jnp.float32) for name in fas.fp8_params_keys}
        mask = fas.MaskType.CAUSAL if causal else fas.MaskType.NO_MASK
        attn = lambda q, k, v: fas.dot_product_attention(q, k, v, fp8_params=params, scale=scale,
                                                         mask_type=mask, use_fp8=True)

        def step(q8, k8, v8, do8):
          out, vjp = jax.vjp(attn, q8, k8, v8)
          leaves, tree = jax.tree_util.tree_flatten(out)
          cts = [do8.astype(leaves[0].dtype)] + [jnp.zeros_like(x) for x in leaves[1:]]
          return vjp(jax.tree_util.tree_unflatten(tree, cts))
        f8 = tuple(x.astype(jnp.float8_e4m3fn) for x in (q, k, v, w))
        return jax.jit(step), f8

      def mgpu_fp16():
        if causal:
          raise NotImplementedError("run non-causal only")
        from jax.experimental.pallas.ops.gpu import attention_mgpu as am
        f16 = tuple(x.astype(jnp.float16) for x in (q, k, v)) + (w.astype(jnp.float32),)
        last = None
        for blk in (128, 64):
          cfg = am.TuningConfig(block_q=64, block_kv=blk, max_concurrent_steps=2, block_q_dkv=64,
                                block_kv_dkv=blk, block_q_dq=64, block_kv_dq=blk)
          f = jax.jit(jax.grad(lambda q, k, v, w: jnp.sum(am.attention(q, k, v, cfg).astype(jnp.float32) * w),
                               (0, 1, 2)))
          try:
            jax.block_until_ready(f(*f16))
            return f, f16
          except Exception as e:  # noqa: BLE001
            last = e
        raise last

      makers = {
          "fa4": lambda: (grad_of(lambda q, k, v: jax_fa4.dot_product_attention(q, k, v, is_causal=causal)),
                          (q, k, v, w)),
          "fa4_det": lambda: (grad_of(lambda q, k, v: jax_fa4.dot_product_attention(
              q, k, v, is_causal=causal, deterministic=True)), (q, k, v, w)),
          "fa4_bwd": fa4_bwd_alone,
          "cudnn_bf16": lambda: (grad_of(lambda q, k, v: jax.nn.dot_product_attention(
              q, k, v, is_causal=causal, implementation="cudnn")), (q, k, v, w)),
          "cudnn_fp8": cudnn_fp8,
          "mgpu_fp16": mgpu_fp16,
      }
      for name in names:
        try:
          f, args = makers[name]()
          res["us"][name] = time_fn(f, args) * 1e6
        except Exception as e:  # noqa: BLE001  (a baseline that cannot run is reported, not fatal)
          res["us"][name] = None
          print(f"  {name} failed: {type(e).__name__}: {str(e)[:200]}")
      fl = lambda n: flops * (2.5 / 3.5 if n == "fa4_bwd" else 1.0)
      cell = lambda n: (f"{res['us'][n]:.0f} / {fl(n) / res['us'][n] / 1e6:.0f}" if res["us"].get(n) else "n/a")
      ratio = lambda base: (res["us"][base] / res["us"]["fa4"]) if res["us"].get("fa4") and res["us"].get(base) \
          else float("nan")
      print(f"{f'B{B} T=S={T} N{N} H{H}':>28} {str(causal):>6} | " + " | ".join(f"{cell(n):>20}" for n in names)
            + f" | {ratio('cudnn_bf16'):.2f}x | {ratio('cudnn_fp8'):.2f}x", flush=True)
      rows.append(res)
  with open(a.out, "w") as f:
    json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
