"""The main job: MXFP8 attention on the default device, its error and its time.

Runs jax_fa4.dot_product_attention on jax's default device (GPU if present, else CPU), prints
which backend ran, its error against float64 attention next to bf16 attention's, and its time
next to jax.nn.dot_product_attention's.
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_fa4
from jax_fa4 import backends, reference


def timeit(fn, *args, reps=5):
  jax.block_until_ready(fn(*args))  # compile and warm up
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts))


def rel_err(x, truth):
  x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  return float(np.linalg.norm(x - truth) / np.linalg.norm(truth))


def main():
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--seq", type=int, default=2048)
  ap.add_argument("--heads", type=int, default=8)
  ap.add_argument("--kv-heads", type=int, default=8)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--causal", action="store_true")
  args = ap.parse_args()
  B, T, N, K, H = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim

  dev = jax.devices()[0]
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
             for s in ((B, T, N, H), (B, T, K, H), (B, T, K, H)))
  impl = backends.resolve(None, q_shape=(B, T, N, H), k_shape=(B, T, K, H), head_dim=H, num_heads=N, num_kv_heads=K, has_bias=False,
                          has_mask=False, window=None, is_causal=args.causal,
                          out_dtype="bfloat16")
  print(f"device: {dev.device_kind} ({dev.platform}); jax {jax.__version__}; "
        f"jax_fa4 backend: {impl!r} (available: {jax_fa4.available_backends()})")
  print(f"shape: B={B} T=S={T} N={N} K={K} H={H} causal={args.causal}")

  ours = jax.jit(lambda q, k, v: jax_fa4.dot_product_attention(q, k, v, is_causal=args.causal))
  base = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=args.causal))
  o, o_bf16 = ours(q, k, v), base(q, k, v)

  # float64 truth on the bf16 inputs themselves (one batch element keeps the host work small).
  truth, _ = reference.truth_forward(q[:1], k[:1], v[:1], scale=H ** -0.5, is_causal=args.causal)
  print(f"rel. error vs float64: jax_fa4 MXFP8 {rel_err(o[:1], truth):.3e}   "
        f"jax.nn bf16 {rel_err(o_bf16[:1], truth):.3e}")

  flops = 4 * B * T * T * N * H * (0.5 if args.causal else 1.0)
  t_ours, t_base = timeit(ours, q, k, v), timeit(base, q, k, v)
  print(f"time: jax_fa4[{impl}] {t_ours * 1e3:.2f} ms ({flops / t_ours / 1e12:.3f} TFLOP/s)   "
        f"jax.nn.dot_product_attention bf16 {t_base * 1e3:.2f} ms "
        f"({flops / t_base / 1e12:.3f} TFLOP/s)   ratio {t_base / t_ours:.2f}x")
  if impl == "cuda" and jax_fa4.available_backends()["cuda_fp8"]:
    # The FP8-score variant is opt-in (it misses the accuracy contract on some inputs): show it too.
    fp8 = jax.jit(lambda q, k, v: jax_fa4.dot_product_attention(
        q, k, v, is_causal=args.causal, implementation="cuda_fp8"))
    o_fp8 = fp8(q, k, v)
    t_fp8 = timeit(fp8, q, k, v)
    print(f"opt-in jax_fa4[cuda_fp8]: rel. error vs float64 {rel_err(o_fp8[:1], truth):.3e}, "
          f"{t_fp8 * 1e3:.3f} ms ({flops / t_fp8 / 1e12:.1f} TFLOP/s), "
          f"{t_base / t_fp8:.2f}x jax.nn")

if __name__ == "__main__":
  main()
