"""Which attention products tolerate Hopper's FP8 wgmma accumulation? A CPU simulation.

Model of an FP8 wgmma k32 step (an assumption, calibrated below against the H200 forward): the 32
exact products and the running accumulator are aligned to the largest exponent among them and
truncated toward zero to `bits` bits below it, then summed; the accumulator is fp32.

1. Calibration: the FP8-score forward (Q K^T through the model, the rest as the recipe) against
   the H200 measurements of docs/HOPPER_FORWARD.md (lse rel. error 2.6e-4 and O error 2.84x the
   recipe's on channel outliers, T=S=1024 H=128 causal; O 1.19x on token outliers).
2. Backward: the recipe of NUMERICS.md section 3 with S and/or dP through the model, against the
   float64 gradients, next to the recipe itself: the ratio the contract caps at 1.05.
3. The backward's other products on FP8 (S exact, dP on FP8 as 2. allows): dV, dK, dQ summed by the
   model along their long contractions (T or S), promoted to fp32 every `--promote` elements (the
   forward's two-level accumulation: one tile); and dS quantized with one scale per row per tile
   (`--tile` elements along the contraction) instead of MX's 32, as a kernel holding dS in
   registers would do.
4. (--lse-variants) Can FP8 Q K^T meet the lse contract with more fp32 work? The lse error of the
   FP8-score forward against its bound (1.05 x the recipe's + 1e-3 x bf16's, NUMERICS.md section 4)
   with the model's accumulator as the wgmma chains it, with a fresh accumulator per k32 (or k64)
   step summed in fp32, and with that plus the head-dim channels sorted by |q| |k| so that each
   k32 step holds channels of one size.

  python3 scripts/sim_fp8_accumulation.py [--bits 13] [--T 256] [--S 2048] [--lse-variants]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

from contract import make_do, make_qkv  # noqa: E402
from jax_fa4 import mx  # noqa: E402


def fp8_acc_dot(a, b, bits, k=32):
  """a [T, H] @ b [S, H]^T with the model's accumulation (float64 in, fp32 out)."""
  prods = a[:, None, :] * b[None, :, :]
  acc = np.zeros(prods.shape[:2])
  for g in range(0, a.shape[1], k):
    vals = np.concatenate([acc[..., None], prods[..., g:g + k]], axis=-1)
    mag = np.max(np.abs(vals), axis=-1, keepdims=True)
    e = np.floor(np.log2(np.where(mag > 0, mag, 1.0)))
    ulp = np.exp2(e - bits)
    acc = np.trunc(vals / ulp).sum(-1) * ulp[..., 0]
    acc = acc.astype(np.float32).astype(np.float64)
  return acc


def fp8_acc_mm(a, b, bits, promote):
  """a [M, K] @ b [K, N] with the model's sums, promoted into an fp32 total every `promote` of K."""
  total = np.zeros((a.shape[0], b.shape[1]))
  for c in range(0, a.shape[1], promote):
    part = fp8_acc_dot(a[:, c:c + promote], b[c:c + promote].T, bits)
    total = (total + part).astype(np.float32).astype(np.float64)
  return total


def quant_tiles(x, axis, block):
  """MX rounding of x along `axis` with `block`-element blocks (block=32: the MX format)."""
  x = np.moveaxis(np.asarray(x, np.float64), axis, -1)
  n = x.shape[-1]
  pad = (-n) % block
  xb = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]).reshape(*x.shape[:-1], -1, block)
  amax = np.abs(xb).max(-1, keepdims=True)
  e = np.ceil(np.log2(np.where(amax > 0, amax / 448.0, 1.0)))
  sc = np.exp2(np.where(amax > 0, e, -127))
  q = e4m3(xb / sc) * sc
  q = q.reshape(*x.shape[:-1], -1)[..., :n]
  return np.moveaxis(q, -1, axis)


def exact_dot(a, b):
  return (a.astype(np.float64) @ b.astype(np.float64).T).astype(np.float32).astype(np.float64)


def e4m3(x):
  """Round to e4m3, saturating like the kernels' cvt.rn.satfinite (a recomputed P can exceed 1)."""
  x = np.clip(np.asarray(x, np.float32), -448.0, 448.0)
  return x.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def deq(x, axis):
  return np.asarray(mx.quantize(jnp.asarray(x, jnp.float32), axis).dequantize(), np.float64)


def rel(x, t):
  return float(np.linalg.norm(x - t) / np.linalg.norm(t))


def causal_keep(T, S):
  return np.tril(np.ones((T, S), bool), S - T)


def forward(qd, kd, vd, scale, keep, sdot):
  s = np.where(keep, sdot(qd, kd) * scale, -np.inf)
  m = s.max(-1, keepdims=True)
  p = np.exp(s - m)
  l = p.sum(-1, keepdims=True)
  o = (e4m3(p * 256) / 256) @ vd / l
  return o, (m + np.log(l))[:, 0]


def truth(qd, kd, vd, do, scale, keep):
  s = np.where(keep, qd @ kd.T * scale, -np.inf)
  m = s.max(-1, keepdims=True)
  p = np.exp(s - m)
  l = p.sum(-1, keepdims=True)
  p = p / l
  o = p @ vd
  dp = do @ vd.T
  ds = p * (dp - (o * do).sum(-1, keepdims=True))
  return o, (m + np.log(l))[:, 0], ds @ kd * scale, ds.T @ qd * scale, p.T @ do


def backward(q, k, v, do, o_bf16, lse, scale, keep, sdot, pdot):
  """The recipe of NUMERICS.md section 3 for one head; sdot/pdot compute S and dP."""
  q_h, k_h, v_h, do_h = deq(q, -1), deq(k, -1), deq(v, -1), deq(do, -1)
  q_t, k_s, do_t = deq(q, 0), deq(k, 0), deq(do, 0)
  delta = (o_bf16 * np.asarray(jnp.asarray(do, jnp.bfloat16), np.float64)).sum(-1, keepdims=True)
  s = np.where(keep, sdot(q_h, k_h) * scale, -np.inf)
  p = np.exp(s - lse[:, None])
  dv = (e4m3(p * 256) / 256).T @ do_t
  dp = pdot(do_h, v_h)
  ds = p * (dp - delta)
  ds_s = deq(ds, 1)  # blocked along S (dQ's contraction)
  ds_t = deq(ds, 0)  # blocked along T (dK's)
  return ds_s @ k_s * scale, ds_t.T @ q_t * scale, dv


def backward_case(kind, do_kind, T, S, H, scale):
  """Inputs of one head, the float64 gradients and the recipe's (exact dots)."""
  q, k, v = (x[0, :, 0] for x in make_qkv(kind, 1, T, S, 1, 1, H, seed=5))
  do = make_do(do_kind, 1, T, 1, H, seed=6)[0, :, 0]
  keep = causal_keep(T, S)
  qd, kd, vd = deq(q, -1), deq(k, -1), deq(v, 0)
  _, _, *g_t = truth(qd, kd, vd, do.astype(np.float64), scale, keep)
  o_r, lse = forward(qd, kd, vd, scale, keep, exact_dot)
  o_bf16 = np.asarray(jnp.asarray(o_r, jnp.float32).astype(jnp.bfloat16), np.float64)
  g_r = backward(q, k, v, do, o_bf16, lse, scale, keep, exact_dot, exact_dot)
  return q, k, v, do, keep, o_bf16, lse, g_t, g_r


def lse_variants(T, S, H, scale, bits):
  """Section 4: each variant's lse error over its contract bound, two seeds per distribution."""
  bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16), np.float64)
  keep = causal_keep(T, S)
  print(f"FP8 Q K^T ({bits} bits): lse error / contract bound (<= 1 meets it), T={T} S={S} H={H}, causal")
  for kind in ("normal", "channel_outliers", "token_outliers", "tiny"):
    for seed in (0, 1):
      q, k, v = (x[0, :, 0] for x in make_qkv(kind, 1, T, S, 1, 1, H, seed=seed))
      qd, kd, vd = deq(q, -1), deq(k, -1), deq(v, 0)
      _, l_t, *_ = truth(qd, kd, vd, np.zeros_like(qd), scale, keep)
      _, l_r = forward(qd, kd, vd, scale, keep, exact_dot)
      _, l_b, *_ = truth(bf16(q), bf16(k), bf16(v), np.zeros_like(qd), scale, keep)
      bound = 1.05 * rel(l_r, l_t) + 1e-3 * rel(l_b, l_t)
      order = np.argsort(-(np.abs(qd).max(0) * np.abs(kd).max(0)))
      line = f"  {kind:>16} seed {seed}: bound {bound:.1e}"
      for name, a, b, dot in (
          ("chained", qd, kd, lambda x, y: fp8_acc_dot(x, y, bits)),
          ("fp32 per k32", qd, kd, lambda x, y: fp8_acc_mm(x, y.T, bits, 32)),
          ("fp32 per k64", qd, kd, lambda x, y: fp8_acc_mm(x, y.T, bits, 64)),
          ("sorted, fp32 per k32", qd[:, order], kd[:, order], lambda x, y: fp8_acc_mm(x, y.T, bits, 32))):
        _, l_m = forward(a, b, vd, scale, keep, dot)
        line += f" | {name} x{rel(l_m, l_t) / bound:.2f}"
      print(line, flush=True)


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--bits", type=int, nargs="+", default=[12, 13, 14])
  ap.add_argument("--T", type=int, default=256)
  ap.add_argument("--S", type=int, default=None, help="keys (default: T); causal is bottom-right aligned")
  ap.add_argument("--promote", type=int, default=128, help="fp32 promotion interval of the long sums")
  ap.add_argument("--tile", type=int, default=64, help="dS elements per scale in the 'tile dS' variant")
  ap.add_argument("--lse-variants", action="store_true", help="section 4 only")
  args = ap.parse_args(argv)
  jax.config.update("jax_platforms", "cpu")
  H, T = 128, args.T
  S = args.S or T
  scale = H ** -0.5
  if args.lse_variants:
    return lse_variants(T, S, H, scale, args.bits[len(args.bits) // 2])
  print(f"forward calibration, T={T} S={S}, H={H}, causal (H200 measured at T=S=1024: channel outliers "
        f"lse 2.6e-4, O x2.84; token outliers lse 1.1e-4, O x1.19)")
  for kind in ("channel_outliers", "token_outliers", "normal"):
    q, k, v = (x[0, :, 0] for x in make_qkv(kind, 1, T, S, 1, 1, H, seed=3))
    qd, kd, vd = deq(q, -1), deq(k, -1), deq(v, 0)
    keep = causal_keep(T, S)
    o_t, l_t, *_ = truth(qd, kd, vd, np.zeros_like(qd), scale, keep)
    o_r, l_r = forward(qd, kd, vd, scale, keep, exact_dot)
    line = f"  {kind:>16}: recipe O {rel(o_r, o_t):.2e} lse {rel(l_r, l_t):.1e}"
    for bits in args.bits:
      o_m, l_m = forward(qd, kd, vd, scale, keep, lambda a, b: fp8_acc_dot(a, b, bits))
      line += f" | bits={bits}: O x{rel(o_m, o_t) / rel(o_r, o_t):.2f} lse {rel(l_m, l_t):.1e}"
    print(line, flush=True)

  print(f"backward: rel. error vs float64 gradients, model / recipe (the contract allows 1.05)")
  for kind, do_kind in (("normal", "normal"), ("channel_outliers", "varying"),
                        ("token_outliers", "normal"), ("tiny", "varying")):
    q, k, v, do, keep, o_bf16, lse, g_t, g_r = backward_case(kind, do_kind, T, S, H, scale)
    line = f"  {kind:>16}/{do_kind:<7}: recipe dq/dk/dv " + "/".join(f"{rel(a, b):.2e}" for a, b in zip(g_r, g_t))
    for bits in args.bits:
      f8 = lambda a, b: fp8_acc_dot(a, b, bits)
      for name, (sd, pd) in (("S", (f8, exact_dot)), ("dP", (exact_dot, f8)), ("S+dP", (f8, f8))):
        g_m = backward(q, k, v, do, o_bf16, lse, scale, keep, sd, pd)
        line += f" | {bits}b {name}: " + "/".join(f"x{rel(a, t) / rel(r, t):.2f}" for a, r, t in zip(g_m, g_r, g_t))
    print(line, flush=True)

  bits = args.bits[len(args.bits) // 2]
  print(f"backward products on FP8 ({bits} bits, S exact, dP FP8), promotion every {args.promote}; "
        f"dS scale per {args.tile}: error ratio to the recipe")
  for kind, do_kind in (("normal", "normal"), ("channel_outliers", "varying"),
                        ("token_outliers", "normal"), ("tiny", "varying")):
    q, k, v, do, keep, o_bf16, lse, g_t, g_r = backward_case(kind, do_kind, T, S, H, scale)
    # The kernel's version: S exact, dP FP8, the three products on FP8 with promotion.
    q_h, k_h, v_h, do_h = deq(q, -1), deq(k, -1), deq(v, -1), deq(do, -1)
    q_t, k_s, do_t = deq(q, 0), deq(k, 0), deq(do, 0)
    delta = (o_bf16 * np.asarray(jnp.asarray(do, jnp.bfloat16), np.float64)).sum(-1, keepdims=True)
    s_ = np.where(keep, exact_dot(q_h, k_h) * scale, -np.inf)
    p = np.exp(s_ - lse[:, None])
    p8 = e4m3(p * 256) / 256
    dp = fp8_acc_dot(do_h, v_h, bits)
    ds = p * (dp - delta)
    mm = lambda a, b: fp8_acc_mm(a, b, bits, args.promote)
    variants = {
        "sums": (mm(p8.T, do_t), mm(deq(ds, 0).T, q_t) * scale, mm(deq(ds, 1), k_s) * scale),
        "tile dS": (p8.T @ do_t, quant_tiles(ds, 0, args.tile).T @ q_t * scale,
                    quant_tiles(ds, 1, args.tile) @ k_s * scale),
    }
    line = f"  {kind:>16}/{do_kind:<7}:"
    for name, (dv, dk, dq) in variants.items():
      line += f" | {name}: dq/dk/dv " + "/".join(
          f"x{rel(a, t) / rel(r, t):.3f}" for a, r, t in zip((dq, dk, dv), g_r, g_t))
      line += " (vs recipe " + "/".join(f"{rel(a, r):.1e}" for a, r in zip((dq, dk, dv), g_r)) + ")"
    print(line, flush=True)


if __name__ == "__main__":
  main()
