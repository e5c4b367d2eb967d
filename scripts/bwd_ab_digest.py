"""Digests of the Hopper backward's outputs, to compare two builds bit for bit (GPU only).

The branch bwd-kv-dequant reads K and V as MX and dequantizes them in the kernel instead of
TMA-loading bf16 copies; its outputs must be bitwise those of main. Run this script on each build
(same GPU), then compare the two JSON files:
  python scripts/bwd_ab_digest.py /tmp/main.json      # on a build of main
  python scripts/bwd_ab_digest.py /tmp/branch.json    # on a build of bwd-kv-dequant
  python scripts/bwd_ab_digest.py --compare /tmp/main.json /tmp/branch.json
deterministic=True, so dQ's cross-tile adds are ordered and every output is reproducible. Only
APIs present on both sides are used (_cuda_ops.forward_mx / backward, mx.quantize).
With --time [H ...], the JSON also gets the backward kernel's time (co.backward alone, default
non-deterministic dQ) at B=2, T=S=8192, N=16, H=128 (or the head dims named), causal and not, so
that two builds (or two settings of a kernel switch) run in alternating processes give an A/B of
their speed.
"""
import hashlib
import json
import sys
import zlib

import numpy as np


def _compare(a_path, b_path):
  a, b = json.load(open(a_path)), json.load(open(b_path))
  keys = sorted(k for k in set(a) | set(b) if "/" in k)  # digests only (not the timings)
  bad = [k for k in keys if a.get(k) != b.get(k)]
  for k in sorted(set(a) - set(keys)):
    print(f"{k}: {a.get(k)} vs {b.get(k)}")
  for k in bad:
    print(f"DIFFER {k}: {a.get(k)} vs {b.get(k)}")
  print(f"{len(keys)} digests, {len(bad)} differ")
  return 1 if bad else 0


def main(out_path):
  import jax
  import jax.numpy as jnp
  from jax_fa4 import _cuda_ops as co, mx

  cases = [
      # (name, B, T, S, N, K, H, causal, window, q_len, kv_len, dkv dtype, input magnitude)
      ("h64_gqa", 2, 200, 300, 4, 2, 64, True, (40, None), [200, 77], [300, 0], jnp.float32, 1.0),
      ("h128", 2, 256, 256, 2, 2, 128, False, None, [256, 130], [256, 129], jnp.bfloat16, 1.0),
      ("h128_tail", 1, 130, 200, 4, 1, 128, True, None, [130], [200], jnp.float32, 1.0),
      ("h256", 2, 130, 200, 2, 1, 256, True, (None, 17), [130, 64], [200, 150], jnp.float32, 1.0),
      ("h256_gqa_f16", 1, 64, 129, 4, 2, 256, False, None, [64], [129], jnp.float16, 1.0),
      # K / V on tiny and large block scales: the small elements of the 1e-37 blocks dequantize to
      # bf16 subnormals (and some below bf16's range), the 1e25 blocks to big exponents.
      ("h128_tiny", 1, 128, 160, 2, 1, 128, False, None, [128], [160], jnp.float32, 1e-37),
      ("h64_large", 1, 96, 140, 2, 2, 64, True, None, [96], [140], jnp.float32, 1e25),
  ]
  out = {}
  for name, B, T, S, N, K, H, causal, window, ql, kl, dkv, mag in cases:
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    q, do = f(B, T, N, H), f(B, T, N, H)
    k, v = f(B, S, K, H) * np.float32(mag), f(B, S, K, H) * np.float32(mag)
    q_len, kv_len = jnp.array(ql, jnp.int32), jnp.array(kl, jnp.int32)
    scale = float(H) ** -0.5 / (mag if mag > 1 else 1.0)
    qm, km, vm, dom = mx.quantize(q, 3), mx.quantize(k, 3), mx.quantize(v, 3), mx.quantize(do, 3)
    o, lse = co.forward_mx(qm, km, mx.quantize(v, 1), q_len, kv_len, scale=scale, is_causal=causal,
                           window=window, out_dtype=jnp.float32)
    delta = jnp.sum(o * do, -1)
    grads = co.backward(qm, km, vm, dom, lse, delta, q_len, kv_len, scale=scale, is_causal=causal,
                        window=window, deterministic=True, dkv_dtype=dkv)
    for gname, g in zip(("dq", "dk", "dv"), jax.block_until_ready(grads)):
      a = np.asarray(g)
      out[f"{name}/{gname}"] = hashlib.sha256(a.tobytes()).hexdigest()[:24] + f" finite={np.isfinite(a).mean():.4f}"
    print(name, {k.split("/")[1]: v for k, v in out.items() if k.startswith(name + "/")}, flush=True)
  json.dump(out, open(out_path, "w"), indent=1, sort_keys=True)


def timings(out_path, H=128):
  import pathlib
  import jax
  import jax.numpy as jnp
  from jax_fa4 import _cuda_ops as co, mx
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
  from bench_backward_gpu import time_fn

  B, T, N = 2, 8192, 16
  ks = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(kk, (B, T, N, H), jnp.float32).astype(jnp.bfloat16) for kk in ks)
  L = jnp.full((B,), T, jnp.int32)
  qm, km, vm, dom = mx.quantize(q, 3), mx.quantize(k, 3), mx.quantize(v, 3), mx.quantize(do, 3)
  res = {"device": jax.devices()[0].device_kind}
  for causal in (False, True):
    o, lse = co.forward_mx(qm, km, mx.quantize(v, 1), L, L, scale=H ** -0.5, is_causal=causal)
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), -1)
    f = jax.jit(lambda a, b, c, d, l, dl: co.backward(a, b, c, d, l, dl, L, L, scale=H ** -0.5, is_causal=causal,
                                                      dkv_dtype=jnp.bfloat16))
    us = time_fn(f, (qm, km, vm, dom, lse, delta)) * 1e6
    fl = 2.5 * 4 * B * T * T * N * H * (0.5 if causal else 1)
    res[f"bwd_us_h{H}_causal{int(causal)}" if H != 128 else f"bwd_us_causal{int(causal)}"] = us
    print(f"backward (co.backward, MX operands) B{B} T=S={T} N{N} H{H} causal={causal}: {us:.1f} us, "
          f"{fl / us / 1e6:.0f} TFLOP/s", flush=True)
  d = json.load(open(out_path))
  d.update(res)
  json.dump(d, open(out_path, "w"), indent=1, sort_keys=True)


if __name__ == "__main__":
  if sys.argv[1] == "--compare":
    sys.exit(_compare(sys.argv[2], sys.argv[3]))
  main(sys.argv[1])
  if "--time" in sys.argv[2:]:
    # --time [H ...]: head dims to time (default 128)
    heads = [int(a) for a in sys.argv[sys.argv.index("--time") + 1:] if a.isdigit()] or [128]
    for h in heads:
      timings(sys.argv[1], h)
