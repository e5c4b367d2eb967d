"""Forward-attention timings on one GPU, all in one process.

Times (median over repeats; each repeat runs a burst of calls over rotating input buffers, after
warm-up) jax_fa4's sm_90a kernels against jax's cuDNN bf16 and cuDNN per-tensor FP8 attention and the
Pallas Mosaic-GPU attention (fp16):
  fa4_mx      jax_fa4 forward_mx from MX inputs, exact scores (the default; preparation included)
  fa4_float   jax_fa4 forward_float from bf16 inputs, exact scores (quantization + preparation included)
  fa4_kernel  the exact-score attention kernel alone on prepared inputs
  fp8_mx      forward_mx with scores="fp8" (the opt-in path; preparation included)
  fp8_kernel  the FP8-score attention kernel alone on prepared inputs
  cudnn_bf16  jax.nn.dot_product_attention(implementation='cudnn'), bf16
  cudnn_fp8   jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(use_fp8=True), e4m3
  mgpu_fp16   jax.experimental.pallas.ops.gpu.attention_mgpu.attention, fp16
FLOPs = 4*B*T*S*N*H, halved for causal. Also times the preparation kernels against an elementwise
device-to-device pass over the same number of bytes.

  python benchmarks/bench_forward_gpu.py OUT.json [--quick | --heads 64,128,256] [--no-prep]
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jax_fa4 import _cuda_ops as co
from jax_fa4 import mx

N_BUFFERS = 3


def _block(x):
  jax.tree_util.tree_map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, x)


def time_fn(fn, inputs, warmup=2, burst=6, repeats=5):
  """Median seconds per call: bursts of calls over rotating buffers, blocked at the end of each."""
  for i in range(warmup):
    _block(fn(*inputs[i % len(inputs)]))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = None
    for i in range(burst):
      out = fn(*inputs[i % len(inputs)])
    _block(out)
    times.append((time.perf_counter() - t0) / burst)
  return statistics.median(times)


def _rand(key, shape, dtype):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def make_inputs(B, T, S, N, K, H, n=N_BUFFERS, seed=0):
  sets = []
  key = jax.random.key(seed)
  for _ in range(n):
    key, a, b, c = jax.random.split(key, 4)
    sets.append((_rand(a, (B, T, N, H), jnp.bfloat16), _rand(b, (B, S, K, H), jnp.bfloat16),
                 _rand(c, (B, S, K, H), jnp.bfloat16)))
  return sets


def bench_shape(B, T, S, N, H, causal, results):
  K = N
  flops = 4.0 * B * T * S * N * H * (0.5 if causal else 1.0)
  scale = 1.0 / math.sqrt(H)
  row = dict(B=B, T=T, S=S, N=N, H=H, causal=causal, flops=flops, us={}, na={})
  sets = make_inputs(B, T, S, N, K, H)
  ql = jnp.full((B,), T, jnp.int32)
  kl = jnp.full((B,), S, jnp.int32)

  def run(name, make):
    try:
      fn, inputs = make()
      row["us"][name] = time_fn(fn, inputs) * 1e6
    except Exception as e:  # noqa: BLE001 - every baseline may fail on some shape/stack
      row["na"][name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"

  kw = dict(scale=scale, is_causal=causal, window=None, out_dtype=jnp.bfloat16)

  def m_mx(scores):
    def make():
      mx_sets = [(mx.quantize(q, 3), mx.quantize(k, 3), mx.quantize(v, 1)) for q, k, v in sets]
      f = jax.jit(lambda q, k, v: co.forward_mx(q, k, v, ql, kl, scores=scores, **kw))
      return f, mx_sets
    return make

  def m_kernel(scores):
    def make():
      s_pad = co._s_pad(S)
      prepped = []
      for q, k, v in sets:
        qm, km, vm = mx.quantize(q, 3), mx.quantize(k, 3), mx.quantize(v, 1)
        if scores == "exact":
          (q8, qs), (k8, ks) = co._exact_rows(qm), co._exact_rows(km)
        else:
          q8, qs = co._prep_rows_mx(qm, T)
          k8, ks = co._prep_rows_mx(km, s_pad)
        vt, vs = co._prep_v(vm, kl, s_pad)
        prepped.append((q8, qs, k8, ks, vt, vs))
      f = jax.jit(lambda *a: co._fwd(*a, ql, kl, scale=scale, is_causal=causal, window=None,
                                     out_dtype=jnp.bfloat16))
      return f, prepped
    return make

  def m_fa4_float():
    f = jax.jit(lambda q, k, v: co.forward_float(q, k, v, ql, kl, **kw))
    return f, sets

  def m_cudnn_bf16():
    f = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                                             implementation="cudnn"))
    return f, sets

  def m_cudnn_fp8():
    from jax._src.cudnn import fused_attention_stablehlo as fas
    params = {name: jnp.ones((1, 1, 1, 1), jnp.float32) for name in fas.fp8_params_keys}
    f8 = [(q.astype(jnp.float8_e4m3fn), k.astype(jnp.float8_e4m3fn), v.astype(jnp.float8_e4m3fn))
          for q, k, v in sets]
    mask = fas.MaskType.CAUSAL if causal else fas.MaskType.NO_MASK
    f = jax.jit(lambda q, k, v: fas.dot_product_attention(q, k, v, fp8_params=params, scale=scale,
                                                          mask_type=mask, use_fp8=True)[0])
    return f, f8

  def m_mgpu_fp16():
    from jax.experimental.pallas.ops.gpu import attention_mgpu as am
    f16 = [tuple(x.astype(jnp.float16) for x in s) for s in sets]
    last = None
    for block_kv in (128, 64):  # the first whose shared memory fits
      cfg = am.TuningConfig(block_q=64, block_kv=block_kv, max_concurrent_steps=2, causal=causal)
      f = jax.jit(functools.partial(am.attention, config=cfg))
      try:
        _block(f(*f16[0]))
        return f, f16
      except Exception as e:  # noqa: BLE001
        last = e
    raise last

  for name, make in (("fa4_mx", m_mx("exact")), ("fa4_float", m_fa4_float), ("fa4_kernel", m_kernel("exact")),
                     ("fp8_mx", m_mx("fp8")), ("fp8_kernel", m_kernel("fp8")),
                     ("cudnn_bf16", m_cudnn_bf16), ("cudnn_fp8", m_cudnn_fp8), ("mgpu_fp16", m_mgpu_fp16)):
    run(name, make)
  del sets
  results.append(row)
  _print_row(row)
  return row


COLS = ("fa4_mx", "fa4_float", "fa4_kernel", "fp8_mx", "fp8_kernel", "cudnn_bf16", "cudnn_fp8", "mgpu_fp16")
# (numerator, denominator) of the printed speed-ups: baseline time / jax_fa4 time.
RATIOS = (("fa4_mx", "cudnn_bf16"), ("fa4_mx", "cudnn_fp8"), ("fa4_float", "cudnn_bf16"), ("fp8_mx", "cudnn_fp8"))


def _print_header():
  print(f"{'B':>3} {'T=S':>6} {'H':>4} {'causal':>6} | " +
        " | ".join(f"{c:>18}" for c in COLS) + " | " +
        " | ".join(f"{a} x {b}" for a, b in RATIOS), flush=True)
  print(f"{'':>23} | " + " | ".join(f"{'us  TFLOP/s':>18}" for _ in COLS), flush=True)


def _print_row(r):
  cells = []
  for c in COLS:
    if c in r["us"]:
      us = r["us"][c]
      cells.append(f"{us:9.1f} {r['flops'] / us / 1e6:7.1f}")
    else:
      cells.append(f"{'n/a':>18}")
  def ratio(a, b):
    return f"{r['us'][b] / r['us'][a]:.3f}" if a in r["us"] and b in r["us"] else "n/a"
  print(f"{r['B']:>3} {r['T']:>6} {r['H']:>4} {str(r['causal']):>6} | " + " | ".join(cells) +
        " | " + " | ".join(f"{ratio(a, b):>{len(a) + len(b) + 3}}" for a, b in RATIOS), flush=True)
  for c, why in r["na"].items():
    print(f"      n/a {c}: {why}", flush=True)


def bench_prep(B, T, N, H, results):
  """Preparation kernels vs an elementwise pass over the same bytes (read + write)."""
  S, K = T, N
  key = jax.random.key(1)
  out = {}
  x = _rand(key, (B, T, N, H), jnp.bfloat16)
  xm = mx.quantize(x, 3)
  vm = mx.quantize(x, 1)
  kl = jnp.full((B,), S, jnp.int32)
  s_pad = co._s_pad(S)
  R = B * T * N
  cases = {
      # name: (fn, args, bytes read + written)
      "prep_rows_mx": (jax.jit(lambda d, s: co._prep_rows_mx(mx.MXArray(d, s, 3), s_pad)), (xm.data, xm.scale),
                       R * H * 2 + R * H // 32 + R * 4),
      "prep_rows_bf16": (jax.jit(lambda a: co._prep_rows_float(a, s_pad)), (x,), R * H * 2 + R * H + R * 4),
      "prep_v_mx": (jax.jit(lambda d, s: co._prep_v(mx.MXArray(d, s, 1), kl, s_pad)), (vm.data, vm.scale),
                    R * H * 2 + 2 * (R * H // 32) + B * K * H * 4),
      "quantize_bf16": (jax.jit(lambda a: co.quantize(a, 1).data), (x,), R * H * 2 + R * H + R * H // 32),
      # The same quantizer along the last axis (jax_fa4.quantize(q, -1): the rows kernel).
      "quantize_rows_bf16": (jax.jit(lambda a: co.quantize(a, 3).data), (x,), R * H * 2 + R * H + R * H // 32),
      # The exact-score path's Q/K operand: MX -> bf16, and bf16 -> MX -> bf16 in one pass.
      "exact_rows_mx": (jax.jit(lambda d, s: co._exact_rows(mx.MXArray(d, s, 3))[0]), (xm.data, xm.scale),
                        R * H + R * H // 32 + R * H * 2),
      "exact_rows_bf16": (jax.jit(lambda a: co._exact_rows_float(a)[0]), (x,), R * H * 2 * 2),
  }
  for name, (fn, args, nbytes) in cases.items():
    try:
      t = time_fn(fn, [args])
      # Reference: an elementwise pass over 32-bit words (vectorised loads/stores) reading and
      # writing nbytes in total. (A uint8 elementwise op is not a fair ceiling: it ran at ~1.2 TB/s.)
      buf = jnp.zeros((nbytes // 8,), jnp.uint32) + 1
      tc = time_fn(jax.jit(lambda b: b ^ jnp.uint32(3)), [(buf,)])
      out[name] = dict(us=t * 1e6, gbps=nbytes / t / 1e9, copy_gbps=nbytes / tc / 1e9,
                       frac_of_copy=tc / t)
      print(f"{name:>15}: {t * 1e6:8.1f} us  {nbytes / t / 1e9:7.1f} GB/s  (elementwise copy of the same bytes "
            f"{nbytes / tc / 1e9:7.1f} GB/s: {100 * tc / t:5.1f}%)", flush=True)
    except Exception as e:  # noqa: BLE001
      out[name] = dict(na=f"{type(e).__name__}: {e}")
      print(f"{name:>15}: n/a {type(e).__name__}: {e}", flush=True)
  results["prep"] = dict(B=B, T=T, N=N, H=H, kernels=out)


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("out", help="JSON output path (a PNG is written beside it if matplotlib is there)")
  ap.add_argument("--quick", action="store_true", help="only B=2, T=S=8192, N=16, H=128")
  ap.add_argument("--heads", default="64,128,256", help="head dims of the full table (comma-separated)")
  ap.add_argument("--no-prep", action="store_true", help="skip the preparation-kernel bandwidth table")
  args = ap.parse_args(argv)
  if not co.available():
    print("jax_fa4 CUDA kernels unavailable", file=sys.stderr)
    return 1
  dev = jax.devices()[0]
  print(f"device: {dev.device_kind}; jax {jax.__version__}", flush=True)
  rows = []
  meta = dict(device=dev.device_kind, jax=jax.__version__, rows=rows)
  _print_header()
  if args.quick:
    shapes = [(2, 8192, 8192, 16, 128, c) for c in (False, True)]
  else:
    heads = tuple(int(h) for h in args.heads.split(","))
    shapes = [(16384 // T, T, T, 16, H, c) for H in heads for c in (False, True)
              for T in (1024, 4096, 8192, 16384)]
  for B, T, S, N, H, c in shapes:
    try:
      bench_shape(B, T, S, N, H, c, rows)
    except Exception:  # noqa: BLE001
      traceback.print_exc()
  # B=8: each prep call moves ~0.3-0.5 GB, so host dispatch (~20 us a call) does not set the time.
  if not args.no_prep:
    bench_prep(8, 8192, 16, 128, meta)
  with open(args.out, "w") as f:
    json.dump(meta, f, indent=1)
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(12, 5))
    labels = [f"H{r['H']} T{r['T']}{' c' if r['causal'] else ''}" for r in rows]
    x = np.arange(len(rows))
    w = 0.8 / len(COLS)
    for i, c in enumerate(COLS):
      ax.bar(x + i * w, [r["flops"] / r["us"][c] / 1e6 if c in r["us"] else 0 for r in rows], w, label=c)
    ax.set_xticks(x + 0.4, labels, rotation=60, fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"attention forward, {dev.device_kind}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out.rsplit(".", 1)[0] + ".png", dpi=120)
  except ImportError:
    pass
  return 0


if __name__ == "__main__":
  sys.exit(main())
