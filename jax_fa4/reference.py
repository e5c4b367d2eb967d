"""The recipe in plain jnp (NUMERICS.md sections 2 and 3): the specification every kernel meets.

``mx_forward`` and ``mx_backward`` are straightforward, untiled implementations of the MXFP8
recipe: every product takes MX operands blocked along its own contraction axis, P is rounded to
e4m3 with the fixed scale 256, dS is quantized to MX twice. The backward pass is written out
explicitly (it is not autodiff of the quantized forward). ``truth_forward``/``truth_backward``
are exact float64 attention (numpy) on given inputs, the yardstick of the accuracy contract.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_fa4 import mx
from jax_fa4.masks import broadcast_bnts, positional_mask

P_SCALE = 256.0  # the fixed power-of-two scale of P (cuDNN's choice for P <= 1)
_HI = jax.lax.Precision.HIGHEST


def _combined_mask(B, N, T, S, *, is_causal, window, q_seqlen, kv_seqlen, mask, xp):
  keep = positional_mask(T, S, is_causal=is_causal, window=window, q_seqlen=q_seqlen,
                         kv_seqlen=kv_seqlen, xp=xp)
  keep = xp.broadcast_to(keep, (B, N, T, S))
  if mask is not None:
    keep = keep & broadcast_bnts(xp.asarray(mask, dtype=bool), B, N, T, S, xp=xp)
  return keep


def _logits(qd, kd, scale, bias, keep):
  """fp32 S = (Q K^T) * scale (+ bias), masked positions -inf: [B, N, T, S]."""
  B, T, N, H = qd.shape
  _, S, K, _ = kd.shape
  G = N // K
  s = jnp.einsum("btkgh,bskh->bkgts", qd.reshape(B, T, K, G, H), kd, precision=_HI,
                 preferred_element_type=jnp.float32)
  s = s.reshape(B, N, T, S) * jnp.float32(scale)
  if bias is not None:
    s = s + broadcast_bnts(jnp.asarray(bias, jnp.float32), B, N, T, S)
  return jnp.where(keep, s, -jnp.inf)


def _pv(p, vd):
  """[B, N, T, S] x [B, S, K, H] -> [B, T, N, H] (query heads grouped onto their kv head)."""
  B, N, T, S = p.shape
  K, H = vd.shape[2], vd.shape[3]
  out = jnp.einsum("bkgts,bskh->btkgh", p.reshape(B, K, N // K, T, S), vd, precision=_HI,
                   preferred_element_type=jnp.float32)
  return out.reshape(B, T, N, H)


_STATIC = ("scale", "is_causal", "window", "round_p")


@functools.partial(jax.jit, static_argnames=_STATIC)
def mx_forward(q: mx.MXArray, k: mx.MXArray, v: mx.MXArray, *, scale: float, is_causal=False,
               q_seqlen=None, kv_seqlen=None, window=None, bias=None, mask=None,
               round_p=True):
  """Forward recipe. q, k blocked along H (axis 3), v along S (axis 1).

  ``round_p=False`` (a testing aid) skips the rounding of P, leaving exact products.

  Returns ``(o, lse)``: o float32 [B, T, N, H], lse float32 [B, T, N] (natural log; -inf and
  o = 0 for fully masked rows).
  """
  qd, kd, vd = q.dequantize(), k.dequantize(), v.dequantize()
  B, T, N, _ = qd.shape
  S = kd.shape[1]
  keep = _combined_mask(B, N, T, S, is_causal=is_causal, window=window, q_seqlen=q_seqlen,
                        kv_seqlen=kv_seqlen, mask=mask, xp=jnp)
  s = _logits(qd, kd, scale, bias, keep)
  m = jnp.max(s, axis=-1, keepdims=True)
  m_safe = jnp.where(jnp.isneginf(m), 0.0, m)  # a fully masked row has no maximum
  p = jnp.exp(s - m_safe)
  l = jnp.sum(p, axis=-1)  # from the unquantized P
  p8 = mx.quantize_fixed(p, P_SCALE) if round_p else p
  o = _pv(p8, vd)
  l_btn = jnp.transpose(l, (0, 2, 1))
  o = jnp.where(l_btn[..., None] > 0, o / jnp.where(l_btn > 0, l_btn, 1.0)[..., None], 0.0)
  lse = jnp.where(l > 0, m_safe[..., 0] + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
  return o, jnp.transpose(lse, (0, 2, 1))


@functools.partial(jax.jit, static_argnames=_STATIC)
def mx_backward(q_h, q_t, k_h, k_s, v_h, do_h, do_t, lse, delta, *, scale: float, is_causal=False,
                q_seqlen=None, kv_seqlen=None, window=None, bias=None, mask=None,
                round_p=True):
  """Backward recipe (NUMERICS.md section 3), written out explicitly.

  Operands are MX tensors blocked along the contraction axis of the product that consumes them:
  q_h, k_h, v_h, do_h along H; q_t, do_t along T (axis 1); k_s along S (axis 1). lse and
  delta = rowsum(o * dO) are float32 [B, T, N]. Returns float32 (dq, dk, dv, dbias) where dbias
  is the unquantized fp32 dS [B, N, T, S] (None without a bias). ``round_p=False`` (a testing
  aid) skips the rounding of P and dS, leaving exact products.
  """
  qd, kd = q_h.dequantize(), k_h.dequantize()
  B, T, N, _ = qd.shape
  S, K = kd.shape[1], kd.shape[2]
  G = N // K
  keep = _combined_mask(B, N, T, S, is_causal=is_causal, window=window, q_seqlen=q_seqlen,
                        kv_seqlen=kv_seqlen, mask=mask, xp=jnp)
  s = _logits(qd, kd, scale, bias, keep)
  lse_bnt = jnp.transpose(lse, (0, 2, 1))[..., None]
  p = jnp.where(jnp.isneginf(lse_bnt), 0.0, jnp.exp(s - jnp.where(jnp.isneginf(lse_bnt), 0.0, lse_bnt)))
  p8 = mx.quantize_fixed(p, P_SCALE) if round_p else p
  # dV = P8^T dO, dO blocked along T.
  dv = jnp.einsum("bkgts,btkgh->bskh", p8.reshape(B, K, G, T, S),
                  do_t.dequantize().reshape(B, T, K, G, -1), precision=_HI,
                  preferred_element_type=jnp.float32)
  # dP = dO V^T, both blocked along H.
  dp = jnp.einsum("btkgh,bskh->bkgts", do_h.dequantize().reshape(B, T, K, G, -1), v_h.dequantize(),
                  precision=_HI, preferred_element_type=jnp.float32).reshape(B, N, T, S)
  ds = p * (dp - jnp.transpose(delta, (0, 2, 1))[..., None])
  # dS quantized twice: along S for dQ = dS K, along T for dK = dS^T Q.
  ds_s = mx.quantize(ds, axis=3).dequantize() if round_p else ds
  ds_t = mx.quantize(ds, axis=2).dequantize() if round_p else ds
  dq = _pv(ds_s, k_s.dequantize()) * jnp.float32(scale)
  dk = jnp.einsum("bkgts,btkgh->bskh", ds_t.reshape(B, K, G, T, S),
                  q_t.dequantize().reshape(B, T, K, G, -1), precision=_HI,
                  preferred_element_type=jnp.float32) * jnp.float32(scale)
  return dq, dk, dv, (ds if bias is not None else None)


# ----------------------------------------------------------------------------------------------
# float64 truth (numpy): exact softmax attention and its exact gradients.

def _np64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), dtype=np.float64)


def _truth_parts(q, k, v, scale, is_causal, q_seqlen, kv_seqlen, window, bias, mask):
  q, k, v = _np64(q), _np64(k), _np64(v)
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  kk = np.repeat(k, G, axis=2)
  vv = np.repeat(v, G, axis=2)
  keep = _combined_mask(B, N, T, S, is_causal=is_causal, window=window,
                        q_seqlen=None if q_seqlen is None else np.asarray(q_seqlen),
                        kv_seqlen=None if kv_seqlen is None else np.asarray(kv_seqlen),
                        mask=None if mask is None else np.asarray(mask), xp=np)
  s = np.einsum("btnh,bsnh->bnts", q, kk) * scale
  if bias is not None:
    s = s + np.broadcast_to(_np64(bias), s.shape)
  s = np.where(keep, s, -np.inf)
  m = s.max(axis=-1, keepdims=True)
  m = np.where(np.isneginf(m), 0.0, m)
  e = np.exp(s - m)
  l = e.sum(-1, keepdims=True)
  p = np.where(l > 0, e / np.where(l > 0, l, 1.0), 0.0)
  lse = np.where(l[..., 0] > 0, m[..., 0] + np.log(np.where(l[..., 0] > 0, l[..., 0], 1.0)), -np.inf)
  return q, kk, vv, p, lse, G


def truth_forward(q, k, v, *, scale, is_causal=False, q_seqlen=None, kv_seqlen=None, window=None,
                  bias=None, mask=None):
  """Exact float64 attention: (o [B,T,N,H], lse [B,T,N]) as numpy float64."""
  _, _, vv, p, lse, _ = _truth_parts(q, k, v, scale, is_causal, q_seqlen, kv_seqlen, window,
                                     bias, mask)
  o = np.einsum("bnts,bsnh->btnh", p, vv)
  return o, np.transpose(lse, (0, 2, 1))


def truth_backward(q, k, v, do, *, scale, is_causal=False, q_seqlen=None, kv_seqlen=None,
                   window=None, bias=None, mask=None):
  """Exact float64 gradients (dq, dk, dv) of attention for upstream gradient ``do``."""
  q64, kk, vv, p, _, G = _truth_parts(q, k, v, scale, is_causal, q_seqlen, kv_seqlen, window,
                                      bias, mask)
  do = _np64(do)
  B, T, N, H = q64.shape
  S = kk.shape[1]
  K = N // G
  o = np.einsum("bnts,bsnh->btnh", p, vv)
  delta = np.einsum("btnh,btnh->bnt", o, do)
  dp = np.einsum("btnh,bsnh->bnts", do, vv)
  ds = p * (dp - delta[..., None])
  dq = np.einsum("bnts,bsnh->btnh", ds, kk) * scale
  dk = (np.einsum("bnts,btnh->bsnh", ds, q64) * scale).reshape(B, S, K, G, H).sum(3)
  dv = np.einsum("bnts,btnh->bsnh", p, do).reshape(B, S, K, G, H).sum(3)
  return dq, dk, dv
