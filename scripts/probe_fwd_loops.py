"""GPU probe of the forward kernel's consumer-loop variants (env JAX_FA4_SM90_PIPELINE, read per launch;
unset: 1 at H = 64, 0 otherwise).

  0  the sequential loop (each consumer: Q K^T, wait, softmax, P V, wait, O update)
  2  the sequential loop with ping-pong of the two consumer warpgroups on named barriers
  1  FA3's intra-warpgroup overlap (softmax of tile j while P V of tile j-1 runs), H <= 128
  3  1 + ping-pong
  19  3 without the exp2 (diagnostic: WRONG results, timing only)
  32, 33  0 and 1 with P*256 computed as exp2(x + 8) (no FMUL per element; not the default's
          numerics: it rounds the exp2 argument at ulp(8)); measures what the multiply costs

Grids (JAX_FA4_SM90_PERSISTENT): 0 (the default: one CTA per work tile), 1 (one CTA per SM looping
over work tiles) or k >= 2 (at most k CTAs: many tiles per CTA on small shapes). Part 1 checks that
every combination gives bit for bit the sequential, non-persistent loop's O and lse on fresh random
inputs (awkward lengths, causal, windows, GQA, ragged and zero lengths, both score paths). Part 2
times the variants at B=2, T=S=8192 (4096 at H = 256), N=16, H = 128, 64 and 256, causal and not,
beside cuDNN bf16 in the same process; forward_mx includes the preparation of Q, K, V (the same for
every variant).

Consumers (JAX_FA4_SM90_CONSUMERS): 3 (192-row query tiles; the default for exact scores at H <= 128)
or 2 (the default otherwise); 4 (256-row query tiles of 64-key tiles, opt-in, exact scores at H = 64
only). The loop variants above are timed with two consumers (ping-pong needs two); --consumers times
two against three (and four at H = 64) instead.

  python scripts/probe_fwd_loops.py [--json OUT] [--quick] [--skip-identity] [--consumers]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_fa4 import _cuda_ops as co
from jax_fa4 import mx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
from bench_backward_gpu import time_fn  # noqa: E402  (median of blocked bursts, as the benchmarks time)

ENV = "JAX_FA4_SM90_PIPELINE"
ENV_PERSISTENT = "JAX_FA4_SM90_PERSISTENT"
ENV_CONSUMERS = "JAX_FA4_SM90_CONSUMERS"


def _set(bits: int, persistent: int = 1, consumers: int = 2) -> None:
  os.environ[ENV] = str(bits)
  os.environ[ENV_PERSISTENT] = str(persistent)
  os.environ[ENV_CONSUMERS] = str(consumers)


def _call(qm, km, vm, ql, kl, *, scale, causal, window, scores, bits, persistent):
  _set(bits, persistent)
  # A fresh jitted function per call: a launch captured into a CUDA graph would keep the variant of
  # its capture.
  f = jax.jit(lambda a, b, c, x, y: co.forward_mx(a, b, c, x, y, scale=scale, is_causal=causal, window=window,
                                                   out_dtype=jnp.float32, scores=scores))
  o, lse = f(qm, km, vm, ql, kl)
  return np.asarray(o), np.asarray(lse)


def check_identity(seed: int) -> bool:
  rng = np.random.default_rng(seed)
  cases = [  # B, T, S, N, K, H, causal, window, q_lens, kv_lens
      (1, 1000, 1300, 4, 2, 128, False, None, [1000], [1211]),
      (2, 777, 777, 4, 4, 128, True, None, [777, 300], [777, 0]),
      (1, 513, 2049, 2, 1, 64, False, (100, 50), [513], [2049]),
      (1, 1, 31, 2, 1, 128, False, None, [1], [31]),
      (2, 128, 128, 2, 2, 64, True, None, [128, 128], [128, 5]),
      (1, 1023, 1023, 2, 1, 128, True, (200, 0), [1023], [1023]),
      (2, 300, 700, 2, 1, 256, True, None, [300, 17], [700, 650]),
  ]
  ok = True
  for (B, T, S, N, K, H, causal, window, qls, kls) in cases:
    scale = float(H) ** -0.5
    q = jnp.asarray(rng.standard_normal((B, T, N, H)) * rng.uniform(0.5, 3), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32)
    qm, km, vm = mx.quantize(q, 3), mx.quantize(k, 3), mx.quantize(v, 1)
    ql, kl = jnp.asarray(qls, jnp.int32), jnp.asarray(kls, jnp.int32)
    for scores in ("exact", "fp8"):
      o0, l0 = _call(qm, km, vm, ql, kl, scale=scale, causal=causal, window=window, scores=scores, bits=0,
                     persistent=0)
      for bits, pers in ((0, 1), (2, 1), (1, 1), (3, 1), (3, 0), (3, 2), (2, 3)):
        o1, l1 = _call(qm, km, vm, ql, kl, scale=scale, causal=causal, window=window, scores=scores, bits=bits,
                       persistent=pers)
        same = np.array_equal(o0.view(np.uint32), o1.view(np.uint32)) and np.array_equal(
            l0.view(np.uint32), l1.view(np.uint32))
        ok &= same
        print(f"identity B{B} T{T} S{S} N{N} K{K} H{H} causal={causal} window={window} {scores} "
              f"variant {bits} persistent {pers}: {'bitwise equal' if same else 'DIFFERENT'}"
              + ("" if same else f" (max |dO| {np.nanmax(np.abs(o0 - o1)):.3e})"), flush=True)
  _set(0)
  return ok


def _time(f, args):
  return time_fn(f, args, warmup=1) * 1e6


def _shapes(results: dict, heads):
  """Yields (H, causal, FLOPs, cuDNN bf16 us, MX q, k, v, lengths) for B=2, T=S=8192 (4096 at
  H = 256), N=16, timing and recording the cuDNN bf16 baseline of each in this process."""
  print(f"device: {jax.devices()[0].device_kind}", flush=True)
  for H in heads:
    B, T, N = 2, 8192 if H <= 128 else 4096, 16
    keys = jax.random.split(jax.random.key(H), 3)
    q, k, v = (jax.random.normal(kk, (B, T, N, H), jnp.float32).astype(jnp.bfloat16) for kk in keys)
    qm, km, vm = mx.quantize(q, 3), mx.quantize(k, 3), mx.quantize(v, 1)
    L = jnp.full((B,), T, jnp.int32)
    for causal in (False, True):
      fl = 4 * B * T * T * N * H * (0.5 if causal else 1)
      cud = jax.jit(lambda a, b, c: jax.nn.dot_product_attention(a, b, c, is_causal=causal, implementation="cudnn"))
      base = _time(cud, (q, k, v))
      print(f"H={H} causal={causal}: cuDNN bf16 {base:.1f} us {fl / base / 1e6:.0f} TF/s", flush=True)
      results[f"H{H}_c{int(causal)}_cudnn_bf16"] = base
      yield H, causal, fl, base, (qm, km, vm), L


def timings(results: dict, quick: bool = False) -> None:
  # (persistent grids were slower than one CTA per work tile in every case on 2026-12-05: timed at 0 only)
  variants = [(sc, bits, 0) for sc in ("exact", "fp8") for bits in (0, 2, 1, 3)]
  variants += [("exact", 19, 0), ("exact", 32, 0), ("exact", 33, 0), ("exact", 0, 1)]
  if quick:
    variants = [("exact", 0, 0), ("exact", 32, 0), ("exact", 1, 0), ("exact", 33, 0), ("fp8", 0, 0), ("fp8", 32, 0)]
  for H, causal, fl, base, mxs, L in _shapes(results, (128,) if quick else (128, 64, 256)):
    for scores, bits, pers in variants:
      if H == 256 and bits & 1:
        continue  # no overlapped loop at H = 256
      _set(bits, pers)
      f = jax.jit(lambda a, b, c: co.forward_mx(a, b, c, L, L, scale=H ** -0.5, is_causal=causal, scores=scores))
      us = _time(f, mxs)
      results[f"H{H}_c{int(causal)}_{scores}_{bits}_p{pers}"] = us
      print(f"   {scores:>5} variant {bits:>2} persistent {pers}: {us:8.1f} us {fl / us / 1e6:5.0f} TF/s ({base / us:.2f}x cuDNN bf16)",
            flush=True)
  _set(0)


def consumer_timings(results: dict) -> None:
  """Two vs three (vs four at H = 64) consumer warpgroups (JAX_FA4_SM90_CONSUMERS; exact scores, H = 64, 128)."""
  for H, causal, fl, base, mxs, L in _shapes(results, (128, 64)):
    for bits, cons in [(0, 2), (1, 2), (0, 3)] + ([(1, 3), (0, 4)] if H == 64 else []):
      _set(bits, 0, cons)
      f = jax.jit(lambda a, b, c: co.forward_mx(a, b, c, L, L, scale=H ** -0.5, is_causal=causal))
      us = _time(f, mxs)
      results[f"H{H}_c{int(causal)}_exact_{bits}_cons{cons}"] = us
      print(f"   exact variant {bits} consumers {cons}: {us:8.1f} us {fl / us / 1e6:5.0f} TF/s "
            f"({base / us:.2f}x cuDNN bf16)", flush=True)
  _set(0)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--json", default=None)
  ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
  ap.add_argument("--quick", action="store_true", help="H = 128 timings of a few variants only")
  ap.add_argument("--skip-identity", action="store_true", help="timings only (the GPU tests check bit-identity)")
  ap.add_argument("--consumers", action="store_true", help="only: two vs three (and four) consumer warpgroups (H 64, 128)")
  args = ap.parse_args()
  if args.consumers:
    results = {"device": jax.devices()[0].device_kind}
    consumer_timings(results)
    if args.json:
      with open(args.json, "w") as fh:
        json.dump(results, fh, indent=1)
    return
  print(f"seed {args.seed}", flush=True)
  # (--quick leaves the identity check to tests/test_cuda_forward.py::test_loop_variants_and_grids_bitwise_equal)
  ok = None if args.quick or args.skip_identity else check_identity(args.seed)
  print(f"identity: {'skipped' if ok is None else 'all bitwise equal' if ok else 'SOME DIFFER'}", flush=True)
  results = {"device": jax.devices()[0].device_kind, "identity_ok": ok}
  timings(results, args.quick)
  if args.json:
    with open(args.json, "w") as fh:
      json.dump(results, fh, indent=1)


if __name__ == "__main__":
  main()
