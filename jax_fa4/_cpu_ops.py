"""The CPU XLA FFI kernels (csrc/cpu): MXFP8 attention forward and backward, platform "cpu".

``forward`` and ``backward`` take :class:`jax_fa4.mx.MXArray` operands blocked along the
contraction axis of the product that consumes them (the same arguments as
``jax_fa4.reference.mx_forward`` / ``mx_backward``) and call the targets ``jax_fa4_mx_fwd`` /
``jax_fa4_mx_bwd`` through ``jax.ffi.ffi_call``. Every leading dim before the last three
(``[..., T, N, H]``) is one flattened batch for the kernels, so the calls work with any number
of batch dims and under ``jax.vmap`` (``vmap_method="broadcast_all"``); ``q_seqlen`` and
``kv_seqlen`` have the batch shape ``q.shape[:-3]``.

Masks: ``is_causal`` keeps key j <= query i (top-left aligned); ``window_left/right`` keep
``i - left <= j <= i + right`` (-1 = unbounded on that side); keys ``j >= kv_seqlen[b]`` and
query rows ``i >= q_seqlen[b]`` are masked (lengths are clamped to [0, T] / [0, S]). Fully
masked rows give o = 0 and lse = -inf.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_fa4 import mx

try:
  from jax_fa4 import _jax_fa4_cpu as _ext  # the nanobind extension module
  _IMPORT_ERROR: Optional[BaseException] = None
except ImportError as e:  # not built (e.g. a source checkout without the extension)
  _ext = None
  _IMPORT_ERROR = e

FWD_TARGET = "jax_fa4_mx_fwd"
BWD_TARGET = "jax_fa4_mx_bwd"
_registered = False


def _register() -> bool:
  global _registered
  if _registered:
    return True
  if _ext is None:
    return False
  for name, capsule in _ext.registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform="cpu")
  _registered = True
  return True


def available() -> bool:
  """True when the extension is built and its targets are registered for platform "cpu"."""
  try:
    return _register()
  except Exception:  # pragma: no cover - a broken build must not break import
    return False


def import_error() -> Optional[BaseException]:
  """Why the extension could not be imported (None if it was)."""
  return _IMPORT_ERROR


def _require():
  if not available():
    raise RuntimeError(f"the jax_fa4 CPU extension _jax_fa4_cpu is not available: {_IMPORT_ERROR}")


def _scale_bytes(x: mx.MXArray, name: str) -> jax.Array:
  s = x.scale
  if s.dtype == mx.E8M0:
    return mx.e8m0_to_bytes(s)
  if s.dtype == jnp.uint8:
    return s
  raise TypeError(f"{name}.scale.dtype={s.dtype} must be float8_e8m0fnu (or uint8 bytes)")


def _operand(x, name: str, axis_from_end: int, shape=None):
  """(data, scale bytes) of an MXArray blocked along axis ndim - axis_from_end."""
  if not isinstance(x, mx.MXArray):
    raise TypeError(f"{name} must be a jax_fa4.mx.MXArray, got {type(x).__name__}")
  if x.data.dtype != mx.E4M3:
    raise TypeError(f"{name}.data.dtype={x.data.dtype} must be float8_e4m3fn")
  if x.ndim < 3:
    raise ValueError(f"{name}.shape={tuple(x.shape)} must be [..., L, heads, H]")
  want_axis = x.ndim - axis_from_end
  if x.axis != want_axis:
    raise ValueError(f"{name}.axis={x.axis} must be {want_axis} for this product")
  if shape is not None and tuple(x.shape) != tuple(shape):
    raise ValueError(f"{name}.shape={tuple(x.shape)} must be {tuple(shape)}")
  sb = _scale_bytes(x, name)
  want = mx.scale_shape(x.shape, x.axis)
  if tuple(sb.shape) != want:
    raise ValueError(f"{name}.scale.shape={tuple(sb.shape)} must be {want}")
  return x.data, sb


def _lengths(x, name: str, batch, limit: int):
  if x is None:
    return jnp.full(batch, limit, jnp.int32)
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name}.dtype={x.dtype} must be an integer dtype")
  if tuple(x.shape) != tuple(batch):
    raise ValueError(f"{name}.shape={tuple(x.shape)} must be the batch shape {tuple(batch)}")
  return x.astype(jnp.int32)


def _dims(q: mx.MXArray, k: mx.MXArray, qname: str, kname: str):
  *batch, T, N, H = q.shape
  if k.ndim != q.ndim or tuple(k.shape[:-3]) != tuple(batch):
    raise ValueError(f"{kname}.shape={tuple(k.shape)} must share the batch dims of "
                     f"{qname}.shape={tuple(q.shape)}")
  S, K, Hk = k.shape[-3:]
  if Hk != H:
    raise ValueError(f"{kname}.shape={tuple(k.shape)}: head dim {Hk} must equal H={H}")
  if H % 32 or not 32 <= H <= 256:
    raise ValueError(f"head dim H={H} must be a multiple of 32 in [32, 256]")
  if K < 1 or N % K:
    raise ValueError(f"num_heads N={N} must be a multiple of num_kv_heads K={K}")
  return tuple(batch), T, N, H, S, K


def _attrs(scale, is_causal, window_left, window_right):
  wl, wr = int(window_left), int(window_right)
  if wl < -1 or wr < -1:
    raise ValueError(f"window_left={wl}, window_right={wr} must be >= -1 (-1 = unbounded)")
  return dict(scale=np.float32(scale), is_causal=bool(is_causal), window_left=np.int64(wl),
              window_right=np.int64(wr))


def forward(q: mx.MXArray, k: mx.MXArray, v: mx.MXArray, q_seqlen=None, kv_seqlen=None, *,
            scale: float, is_causal: bool = False, window_left: int = -1,
            window_right: int = -1):
  """MXFP8 attention forward on the CPU kernel.

  q [..., T, N, H] and k [..., S, K, H] blocked along H; v [..., S, K, H] blocked along S.
  Returns ``(o, lse)``: o float32 [..., T, N, H], lse float32 [..., T, N] (natural log).
  """
  _require()
  batch, T, N, H, S, K = _dims(q, k, "q", "k")
  qd, qs = _operand(q, "q", 1)
  kd, ks = _operand(k, "k", 1)
  vd, vs = _operand(v, "v", 3, shape=k.shape)
  ql = _lengths(q_seqlen, "q_seqlen", batch, T)
  kl = _lengths(kv_seqlen, "kv_seqlen", batch, S)
  out = (jax.ShapeDtypeStruct(batch + (T, N, H), jnp.float32),
         jax.ShapeDtypeStruct(batch + (T, N), jnp.float32))
  call = jax.ffi.ffi_call(FWD_TARGET, out, vmap_method="broadcast_all")
  o, lse = call(qd, qs, kd, ks, vd, vs, ql, kl,
                **_attrs(scale, is_causal, window_left, window_right))
  return o, lse


def backward(q_h: mx.MXArray, q_t: mx.MXArray, k_h: mx.MXArray, k_s: mx.MXArray,
             v_h: mx.MXArray, do_h: mx.MXArray, do_t: mx.MXArray, lse, delta, q_seqlen=None,
             kv_seqlen=None, *, scale: float, is_causal: bool = False, window_left: int = -1,
             window_right: int = -1):
  """MXFP8 attention backward on the CPU kernel (NUMERICS.md section 3).

  q_h, k_h, v_h, do_h blocked along H; q_t, do_t along T; k_s along S. lse and
  delta = rowsum(o * dO) are float32 [..., T, N]. Returns float32 (dq, dk, dv).
  """
  _require()
  batch, T, N, H, S, K = _dims(q_h, k_h, "q_h", "k_h")
  args = []
  for x, name, ax, shp in ((q_h, "q_h", 1, None), (q_t, "q_t", 3, q_h.shape),
                           (k_h, "k_h", 1, None), (k_s, "k_s", 3, k_h.shape),
                           (v_h, "v_h", 1, k_h.shape), (do_h, "do_h", 1, q_h.shape),
                           (do_t, "do_t", 3, q_h.shape)):
    args.extend(_operand(x, name, ax, shape=shp))
  for x, name in ((lse, "lse"), (delta, "delta")):
    if tuple(jnp.shape(x)) != batch + (T, N):
      raise ValueError(f"{name}.shape={tuple(jnp.shape(x))} must be {batch + (T, N)}")
  args += [jnp.asarray(lse, jnp.float32), jnp.asarray(delta, jnp.float32),
           _lengths(q_seqlen, "q_seqlen", batch, T), _lengths(kv_seqlen, "kv_seqlen", batch, S)]
  out = (jax.ShapeDtypeStruct(batch + (T, N, H), jnp.float32),
         jax.ShapeDtypeStruct(batch + (S, K, H), jnp.float32),
         jax.ShapeDtypeStruct(batch + (S, K, H), jnp.float32))
  call = jax.ffi.ffi_call(BWD_TARGET, out, vmap_method="broadcast_all")
  dq, dk, dv = call(*args, **_attrs(scale, is_causal, window_left, window_right))
  return dq, dk, dv


# Register at import when the extension is present (idempotent; a failure shows in available()).
available()
