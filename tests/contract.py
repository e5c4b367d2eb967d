"""The accuracy contract of NUMERICS.md section 4, and the input distributions it is tested on.

  rel_err(impl) <= 1.05 * rel_err(recipe) + 1e-3 * rel_err(bf16)   (each vs a float64 truth)

The truth is float64 attention on the dequantized MX inputs; ``bf16`` is exact-softmax
(float64) attention on bf16-rounded copies of the ORIGINAL inputs (and of dO), measured against
that same truth. So rel_err(bf16) is about the MX quantization error of the inputs, a few
percent, and its 1e-3 share is the small floor the formula intends: summation-order noise of
fp32 (which the contract allows) stays under it. (Rounding the dequantized MX values to bf16
instead would be a no-op, since every e4m3 value times a power of two is exact in bf16, and
the floor would collapse to fp32 noise.)
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_fa4 import mx, reference

KINDS = ("normal", "channel_outliers", "token_outliers", "tiny")


def rel_err(x, truth) -> float:
  """||x - truth|| / ||truth|| over the finite entries of truth.

  Where the truth is -inf (the lse of a fully masked row) x must be -inf too; NaN in x fails.
  """
  x = np.asarray(jnp.asarray(x, jnp.float32), dtype=np.float64)
  truth = np.asarray(truth, dtype=np.float64)
  assert x.shape == truth.shape, (x.shape, truth.shape)
  if np.isnan(x).any():
    return float("inf")
  finite = np.isfinite(truth)
  if not np.array_equal(np.isneginf(x) & ~finite, ~finite):
    return float("inf")  # a -inf where the truth is finite, or a finite value where it is -inf
  if not np.isfinite(x[finite]).all():
    return float("inf")
  num = np.linalg.norm(x[finite] - truth[finite])
  den = np.linalg.norm(truth[finite])
  if den == 0:
    return float(num)
  return float(num / den)


def contract_bound(recipe_err: float, bf16_err: float) -> float:
  return 1.05 * recipe_err + 1e-3 * bf16_err


def assert_contract(name: str, impl, recipe, bf16, truth, seed=None):
  """Asserts the contract for one tensor; returns (impl_err, recipe_err, bf16_err). `seed`: the
  inputs' seed, named in the failure message so that the case can be replayed."""
  e_impl, e_rec, e_bf16 = rel_err(impl, truth), rel_err(recipe, truth), rel_err(bf16, truth)
  bound = contract_bound(e_rec, e_bf16)
  assert e_impl <= bound, (f"{name}: rel_err(impl)={e_impl:.4g} > 1.05*rel_err(recipe)="
                           f"{e_rec:.4g} + 1e-3*rel_err(bf16)={e_bf16:.4g} (bound {bound:.4g})"
                           + ("" if seed is None else f" [inputs' seed {seed}]"))
  return e_impl, e_rec, e_bf16


def make_qkv(kind: str, B: int, T: int, S: int, N: int, K: int, H: int, seed: int = 0):
  """float32 numpy q [B,T,N,H], k, v [B,S,K,H] drawn from one of KINDS."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, T, N, H)).astype(np.float32)
  k = rng.standard_normal((B, S, K, H)).astype(np.float32)
  v = rng.standard_normal((B, S, K, H)).astype(np.float32)
  if kind == "normal":
    pass
  elif kind == "channel_outliers":  # a few channels of q and k 20x larger
    ch = rng.choice(H, size=max(1, H // 32), replace=False)
    q[..., ch] *= 20.0
    k[..., ch] *= 20.0
  elif kind == "token_outliers":  # a few tokens 30-100x larger in q, k, v (attention sinks)
    for x, L in ((q, T), (k, S), (v, S)):
      toks = rng.choice(L, size=max(1, L // 16), replace=False)
      x[:, toks] *= rng.uniform(30.0, 100.0, size=(len(toks), 1, 1)).astype(np.float32)
  elif kind == "tiny":
    q *= 1e-3
    k *= 1e-3
    v *= 1e-3
  else:
    raise ValueError(f"{kind=} must be one of {KINDS}")
  return q, k, v


def make_do(kind: str, B: int, T: int, N: int, H: int, seed: int = 1):
  """Upstream gradient [B,T,N,H]: 'normal', or 'varying' (magnitude spans 1e4 across tokens)."""
  rng = np.random.default_rng(seed)
  do = rng.standard_normal((B, T, N, H)).astype(np.float32)
  if kind == "varying":
    do *= (10.0 ** rng.uniform(-2, 2, size=(B, T, 1, 1))).astype(np.float32)
  elif kind != "normal":
    raise ValueError(f"{kind=} must be 'normal' or 'varying'")
  return do


def mx_inputs(q, k, v):
  """The forward's MX operands: q, k blocked along H (last axis), v along S (third from last)."""
  return (mx.quantize(jnp.asarray(q), -1), mx.quantize(jnp.asarray(k), -1),
          mx.quantize(jnp.asarray(v), -3))


def dequantized_inputs(q, k, v):
  """The values the MX recipe actually computes with."""
  return tuple(x.dequantize() for x in mx_inputs(q, k, v))


def _bf16(x):
  return jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)


def truth_and_bf16(q, k, v, do=None, **mask_kw):
  """float64 truth on the dequantized MX inputs, and bf16 attention on the original inputs.

  Returns dict(truth=(o, lse[, dq, dk, dv]), bf16=(...)); mask_kw are the reference.truth_*
  keywords (scale, is_causal, q_seqlen, kv_seqlen, window, bias, mask).
  """
  qd, kd, vd = dequantized_inputs(q, k, v)
  out = {}
  for name, (a, b, c, g) in {
      "truth": (qd, kd, vd, do),
      "bf16": (_bf16(q), _bf16(k), _bf16(v), None if do is None else _bf16(do)),
  }.items():
    res = reference.truth_forward(a, b, c, **mask_kw)
    if do is not None:
      res = res + reference.truth_backward(a, b, c, g, **mask_kw)
    out[name] = res
  return out
