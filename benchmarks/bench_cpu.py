"""CPU benchmark: the jax_fa4 MXFP8 FFI kernels vs XLA's own f32 attention, in one process.

Forward: ``_cpu_ops.forward`` (MX inputs prepared outside the timed region) vs jitted
``jax.nn.dot_product_attention(..., implementation='xla')`` in float32. Backward:
``_cpu_ops.backward`` vs the jitted VJP of the same XLA attention (gradients of q, k, v).
Prints median microseconds, GFLOP/s (4*B*T*S*N*H flops forward, 2.5x that backward, halved
when causal) and the ratio kernel / XLA.

  python benchmarks/bench_cpu.py [--B 1 --T 2048 --S 2048 --N 8 --K 8 --H 128 --causal]
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_fa4 import _cpu_ops, mx, reference


def bench(fn, *args, warmup=2, reps=7):
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts) * 1e6


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--B", type=int, default=1)
  ap.add_argument("--T", type=int, default=2048)
  ap.add_argument("--S", type=int, default=2048)
  ap.add_argument("--N", type=int, default=8)
  ap.add_argument("--K", type=int, default=8)
  ap.add_argument("--H", type=int, default=128)
  ap.add_argument("--causal", action="store_true")
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--no-backward", action="store_true")
  args = ap.parse_args()
  B, T, S, N, K, H = args.B, args.T, args.S, args.N, args.K, args.H
  if not _cpu_ops.available():
    raise SystemExit(f"the CPU extension is not built: {_cpu_ops.import_error()}")
  print(f"jax {jax.__version__}, devices {jax.devices()}, kernel threads "
        f"{_cpu_ops._ext.num_threads()}")
  print(f"B={B} T={T} S={S} N={N} K={K} H={H} causal={args.causal}")

  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32)
  do = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
  scale = 1.0 / np.sqrt(H)
  causal = args.causal
  flops_fwd = 4.0 * B * T * S * N * H * (0.5 if causal else 1.0)

  # ---- forward ----
  q_h, k_h, v_s = mx.quantize(q, 3), mx.quantize(k, 3), mx.quantize(v, 1)
  jax.block_until_ready((q_h, k_h, v_s))
  kern_fwd = jax.jit(lambda q_, k_, v_: _cpu_ops.forward(q_, k_, v_, scale=scale,
                                                         is_causal=causal))
  xla_fwd = jax.jit(lambda q_, k_, v_: jax.nn.dot_product_attention(
      q_, k_, v_, scale=scale, is_causal=causal, implementation="xla"))
  t_k = bench(kern_fwd, q_h, k_h, v_s, reps=args.reps)
  t_x = bench(xla_fwd, q, k, v, reps=args.reps)
  print(f"forward  kernel {t_k:12.0f} us {flops_fwd / t_k / 1e3:8.1f} GFLOP/s | "
        f"xla f32 {t_x:12.0f} us {flops_fwd / t_x / 1e3:8.1f} GFLOP/s | ratio kernel/xla "
        f"{t_k / t_x:.3f}")

  if args.no_backward:
    return
  # ---- backward ----
  o, lse = kern_fwd(q_h, k_h, v_s)
  delta = jnp.sum(o * do, axis=-1)
  ops = (mx.quantize(q, 3), mx.quantize(q, 1), k_h, mx.quantize(k, 1), mx.quantize(v, 3),
         mx.quantize(do, 3), mx.quantize(do, 1), lse, delta)
  jax.block_until_ready(ops)
  kern_bwd = jax.jit(lambda *a: _cpu_ops.backward(*a, scale=scale, is_causal=causal))

  def xla_loss_vjp(q_, k_, v_, do_):
    _, vjp = jax.vjp(lambda a, b, c: jax.nn.dot_product_attention(
        a, b, c, scale=scale, is_causal=causal, implementation="xla"), q_, k_, v_)
    return vjp(do_)

  xla_bwd = jax.jit(xla_loss_vjp)  # includes XLA's forward recomputation of P
  flops_bwd = 2.5 * flops_fwd
  t_kb = bench(kern_bwd, *ops, reps=args.reps)
  t_xb = bench(xla_bwd, q, k, v, do, reps=args.reps)
  print(f"backward kernel {t_kb:12.0f} us {flops_bwd / t_kb / 1e3:8.1f} GFLOP/s | "
        f"xla f32 {t_xb:12.0f} us {flops_bwd / t_xb / 1e3:8.1f} GFLOP/s | ratio kernel/xla "
        f"{t_kb / t_xb:.3f}   (xla: fwd+bwd of jax.vjp)")
  _ = reference


if __name__ == "__main__":
  main()
