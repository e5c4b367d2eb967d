"""``jax_fa4.dot_product_attention``: MXFP8 attention with jax.nn's signature and conventions.

Float inputs are quantized to MXFP8 inside (Q, K blocked along H, V along S); ``MXArray``
inputs are taken as they are. A ``custom_vjp`` links the forward kernel to the explicit
backward recipe of NUMERICS.md section 3; gradients come back in the primal dtype.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Literal, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_fa4 import backends, mx, partitioning

Implementation = Optional[Literal["xla", "cpu", "cuda", "cuda_fp8"]]
IMPLEMENTATIONS = ("xla", "cpu", "cuda", "cuda_fp8")
_FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Static configuration of one attention call (hashable: it is a custom_vjp nondiff arg)."""

  scale: float
  is_causal: bool
  window: Optional[Tuple[int, int]]  # (left, right), both >= 0; None = unbounded
  implementation: str  # the resolved backend: one of IMPLEMENTATIONS
  out_dtype: str  # dtype name of O (and of the float gradients' primal dtypes)
  grad_dtypes: Tuple[Optional[str], Optional[str], Optional[str]]  # q, k, v; None for MXArray
  # Bitwise run-to-run identical gradients (the CUDA backward orders its dQ adds when asked; the
  # CPU backward always adds dQ in key-tile order, and the XLA recipe has no cross-tile adds).
  deterministic: bool = False

  @property
  def window_lr(self) -> Tuple[int, int]:
    """(left, right) with -1 for unbounded: the kernels' encoding."""
    return (-1, -1) if self.window is None else self.window


# ----------------------------------------------------------------------------------------------
# Validation: every bad input raises before anything runs, naming the argument and its value.

def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def resolve_scale(scale, head_dim: int) -> float:
  """The softmax scale: 1/sqrt(head_dim) for None, else ``scale`` if it is a finite number."""
  if scale is None:
    scale = 1.0 / float(np.sqrt(head_dim))
  if not isinstance(scale, (int, float, np.floating)) or not np.isfinite(scale):
    raise ValueError(f"scale={scale!r} must be a finite Python float")
  return scale


def _check_operand(x, name: str, block_axis: int):
  """Returns (shape, dtype-or-None) of a float array or an MXArray operand."""
  if isinstance(x, mx.MXArray):
    x.validate(name)
    if x.ndim not in (3, 4):
      raise ValueError(f"{name}.shape={tuple(x.shape)} must be BTNH or TNH (rank 4 or 3)")
    want = block_axis % x.ndim
    if x.axis != want:
      what = "H (the last axis)" if block_axis == -1 else "the sequence axis"
      raise ValueError(f"{name}.axis={x.axis}: an MXArray {name} must be blocked along {what}, "
                       f"axis {want}; re-block it with jax_fa4.mx.requantize({name}, {want})")
    return tuple(x.shape), None
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be an array or a jax_fa4.MXArray, got {type(x).__name__}")
  if jnp.dtype(x.dtype) not in _FLOAT_DTYPES:
    raise TypeError(f"{name}.dtype={jnp.dtype(x.dtype)} must be one of "
                    f"(bfloat16, float16, float32) or a jax_fa4.MXArray")
  if x.ndim not in (3, 4):
    raise ValueError(f"{name}.shape={tuple(x.shape)} must be BTNH or TNH (rank 4 or 3)")
  return tuple(x.shape), jnp.dtype(x.dtype).name


def _check_lengths(x, name: str, batch: int, limit: int):
  if x is None:
    return None
  x = jnp.asarray(x)
  if x.dtype != jnp.int32:
    raise TypeError(f"{name}.dtype={x.dtype} must be int32")
  if x.shape != (batch,):
    raise ValueError(f"{name}.shape={x.shape} must be ({batch},), one length per batch element")
  if _is_concrete(x):
    vals = np.asarray(x)
    bad = vals[(vals < 0) | (vals > limit)]
    if bad.size:
      raise ValueError(f"{name}={vals.tolist()} must lie in [0, {limit}]; got {bad.tolist()}")
  return x


def _check_window(w):
  if w is None:
    return None
  if isinstance(w, (int, np.integer)) and not isinstance(w, bool):
    w = (int(w), int(w))
  if (not isinstance(w, (tuple, list)) or len(w) != 2
      or not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in w)):
    raise ValueError(f"local_window_size={w!r} must be an int or a (left, right) pair of ints")
  left, right = int(w[0]), int(w[1])
  if left < 0 or right < 0:
    raise ValueError(f"local_window_size={tuple(w)} must have left >= 0 and right >= 0")
  return (left, right)


def _check_bnts(x, name: str, B: int, N: int, T: int, S: int, boolean: bool):
  if x is None:
    return None
  x = jnp.asarray(x)
  if boolean and x.dtype != jnp.bool_:
    raise TypeError(f"{name}.dtype={x.dtype} must be bool (True = keep); pass an additive mask "
                    f"as bias")
  if not boolean and not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name}.dtype={x.dtype} must be a floating dtype")
  if x.ndim != 4:
    raise ValueError(f"{name}.shape={x.shape} must be 4D, broadcastable to (B, N, T, S)="
                     f"{(B, N, T, S)}")
  for have, want in zip(x.shape, (B, N, T, S)):
    if have not in (1, want):
      raise ValueError(f"{name}.shape={x.shape} is not broadcastable to (B, N, T, S)="
                       f"{(B, N, T, S)}")
  return x


# ----------------------------------------------------------------------------------------------
# The custom_vjp core. Operands are 4D; q, k, v float arrays or MXArrays.

def _as_mx(x, axis: int) -> mx.MXArray:
  """x blocked along ``axis``: quantized from a float array, or re-blocked from an MXArray."""
  if isinstance(x, mx.MXArray):
    return mx.requantize(x, axis)
  return mx.quantize(x, axis)


def _forward_impl(cfg: AttentionConfig, q, k, v, bias, mask, q_seqlen, kv_seqlen, q_h=None,
                  k_h=None):
  """O (caller's dtype) and lse. ``q_h``/``k_h``: q and k already blocked along H, if at hand."""
  impl = backends.get(cfg.implementation)
  out_dtype = jnp.dtype(cfg.out_dtype)
  if impl.forward_float is not None and all(not isinstance(t, mx.MXArray) for t in (q, k, v)) \
      and bias is None and mask is None:
    # The backend prepares float inputs itself (fused quantization on the GPU).
    o, lse = partitioning.forward_float(impl, q, k, v, q_seqlen, kv_seqlen, cfg)
  else:
    # partitioning.* wrap the backend call in custom_partitioning: batch/head-sharded inputs
    # run shard-local under jit (docs/SHARDING.md).
    q_h = _as_mx(q, 3) if q_h is None else q_h
    k_h = _as_mx(k, 3) if k_h is None else k_h
    o, lse = partitioning.forward_mx(impl, q_h, k_h, _as_mx(v, 1), bias, mask, q_seqlen,
                                     kv_seqlen, cfg)
  # The barrier keeps O materialised in the caller's dtype: the backward's delta = rowsum(O dO)
  # must see the rounded O (NUMERICS.md section 3), and XLA:GPU would otherwise fold the
  # f32 -> bf16 -> f32 round trip away.
  return jax.lax.optimization_barrier(o.astype(out_dtype)), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg, q, k, v, bias, mask, q_seqlen, kv_seqlen):
  return _forward_impl(cfg, q, k, v, bias, mask, q_seqlen, kv_seqlen)


def _attention_fwd(cfg, q, k, v, bias, mask, q_seqlen, kv_seqlen):
  # q and k blocked along H serve both the forward and the backward: quantize them once.
  q_h, k_h = _as_mx(q, 3), _as_mx(k, 3)
  o, lse = _forward_impl(cfg, q, k, v, bias, mask, q_seqlen, kv_seqlen, q_h=q_h, k_h=k_h)
  # Residuals are MX data (every orientation the backend's backward reads), O and lse: no
  # high-precision copy of q, k or v is kept for the backward pass.
  transposed = backends.get(cfg.implementation).transposed_residuals
  res = dict(q_h=q_h, q_t=_as_mx(q, 1) if transposed else None, k_h=k_h,
             k_s=_as_mx(k, 1) if transposed else None,
             v_h=_as_mx(v, 3), o=o, lse=lse, bias=bias, mask=mask, q_seqlen=q_seqlen,
             kv_seqlen=kv_seqlen, q_mx=_mx_template(q), k_mx=_mx_template(k),
             v_mx=_mx_template(v))
  return (o, lse), res


def _mx_template(x):
  """Zero cotangent of an MXArray primal (MX inputs are constants for differentiation)."""
  if isinstance(x, mx.MXArray):
    return jax.tree_util.tree_map(jnp.zeros_like, x)
  return None


def _sum_to_shape(x, shape):
  axes = tuple(i for i, (a, b) in enumerate(zip(x.shape, shape)) if b == 1 and a != 1)
  return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _attention_bwd(cfg, res, cts):
  do, _ = cts  # lse is a residual: like jax.nn, it carries no gradient
  impl = backends.get(cfg.implementation)
  o = res["o"]
  do = jnp.asarray(do).astype(o.dtype)
  delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
  # dO in the orientations the backend wants: the cotangent itself for the CUDA backward (used as
  # mx.quantize(do, 3), bit for bit: Backend.raw_cotangent), else MX along H and along T.
  do_h, do_t = (do, None) if impl.raw_cotangent else (mx.quantize(do, 3), mx.quantize(do, 1))
  dq, dk, dv, dbias = partitioning.backward(
      impl, res["q_h"], res["q_t"], res["k_h"], res["k_s"], res["v_h"], do_h, do_t, res["lse"],
      delta, res["bias"], res["mask"], res["q_seqlen"], res["kv_seqlen"], cfg)
  grads = []
  for g, dt, tmpl in zip((dq, dk, dv), cfg.grad_dtypes, (res["q_mx"], res["k_mx"], res["v_mx"])):
    grads.append(tmpl if dt is None else g.astype(dt))
  bias = res["bias"]
  if bias is not None:
    dbias = _sum_to_shape(dbias, bias.shape).astype(bias.dtype)
  return (*grads, dbias, None, None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


# ----------------------------------------------------------------------------------------------
# The public function.

def _expand4(x):
  if x is None:
    return None
  if isinstance(x, mx.MXArray):
    if x.ndim == 4:
      return x
    return mx.MXArray(x.data[None], x.scale[None], x.axis + 1)
  x = jnp.asarray(x)
  return x if x.ndim == 4 else x[None]


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale: Optional[float] = None,
    is_causal: bool = False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
    implementation: Implementation = None,
    return_residual: bool = False,
    deterministic: bool = False,
):
  """MXFP8 scaled dot-product attention, a drop-in for ``jax.nn.dot_product_attention``.

  Same layouts and meaning as ``jax.nn.dot_product_attention``: query ``BTNH`` (or ``TNH``),
  key/value ``BSKH`` with K dividing N (GQA/MQA), ``mask`` True = keep, ``bias`` added to the
  logits, both broadcastable to ``BNTS``; ``local_window_size`` an int or (left, right) pair.
  Q and K are quantized to MXFP8 along H and V along S (NUMERICS.md); an ``MXArray`` argument
  is used as it is (q, k blocked along H, v along S) and is a constant for differentiation.

  Args:
    implementation: ``None`` picks the fastest backend that serves the call on the default
      device: ``"cuda"`` (Hopper kernels), ``"cpu"`` (C++ FFI kernels), else ``"xla"`` (the
      plain-jnp recipe, which also serves dense ``bias``/``mask``). ``"cuda_fp8"`` (opt-in) is
      the Hopper kernel with Q K^T on FP8 tensor cores too: faster, outside the accuracy
      contract (docs/HOPPER_FORWARD.md). An explicit choice that cannot serve the call raises,
      saying why.
    return_residual: also return the log-sum-exp, float32 ``BTN`` (natural log; ``-inf`` for
      fully masked rows, whose output is 0).
    deterministic: gradients bitwise identical from run to run. The CUDA backward then adds the
      dQ contributions of its key tiles in a fixed order (slower, see docs/HOPPER_BACKWARD.md)
      instead of with unordered fp32 atomics; the CPU backward always adds dQ in key-tile order (any
      thread count gives the same bits), and the XLA recipe is deterministic anyway.

  Returns:
    The output in the query's dtype (bfloat16 for an ``MXArray`` query), shaped like the query;
    with ``return_residual``, the pair ``(output, lse)``.
  """
  q_shape, q_dtype = _check_operand(query, "query", -1)
  k_shape, k_dtype = _check_operand(key, "key", -1)
  v_shape, v_dtype = _check_operand(value, "value", -3)
  if not (len(q_shape) == len(k_shape) == len(v_shape)):
    raise ValueError(f"query.shape={q_shape}, key.shape={k_shape} and value.shape={v_shape} "
                     f"must have the same rank")
  rank3 = len(q_shape) == 3
  q4 = (1,) + q_shape if rank3 else q_shape
  k4 = (1,) + k_shape if rank3 else k_shape
  v4 = (1,) + v_shape if rank3 else v_shape
  B, T, N, H = q4
  if k4 != v4:
    raise ValueError(f"key.shape={k_shape} and value.shape={v_shape} must be equal")
  if k4[0] != B:
    raise ValueError(f"key.shape={k_shape} has batch {k4[0]} but query.shape={q_shape} has {B}")
  S, K = k4[1], k4[2]
  if k4[3] != H:
    raise ValueError(f"key head_dim={k4[3]} must equal query head_dim={H}")
  if K == 0 or N % K != 0:
    raise ValueError(f"the number of query heads N={N} must be a multiple of the number of "
                     f"key/value heads K={K}")
  if q_dtype is not None and k_dtype is not None and v_dtype is not None:
    if not q_dtype == k_dtype == v_dtype:
      raise TypeError(f"query.dtype={q_dtype}, key.dtype={k_dtype} and value.dtype={v_dtype} "
                      f"must be equal")
  if not isinstance(deterministic, (bool, np.bool_)):
    raise TypeError(f"deterministic={deterministic!r} must be a bool")
  if implementation not in (None,) + IMPLEMENTATIONS:
    raise ValueError(f"implementation={implementation!r} must be one of "
                     f"{(None,) + IMPLEMENTATIONS}")
  scale = resolve_scale(scale, H)
  window = _check_window(local_window_size)
  q_seqlen = _check_lengths(query_seq_lengths, "query_seq_lengths", B, T)
  kv_seqlen = _check_lengths(key_value_seq_lengths, "key_value_seq_lengths", B, S)
  bias4 = _check_bnts(bias, "bias", B, N, T, S, boolean=False)
  mask4 = _check_bnts(mask, "mask", B, N, T, S, boolean=True)

  out_dtype = q_dtype or "bfloat16"
  backend = backends.resolve(implementation, q_shape=q4, k_shape=k4, head_dim=H, num_heads=N,
                             num_kv_heads=K,
                             has_bias=bias4 is not None, has_mask=mask4 is not None,
                             window=window, is_causal=is_causal, out_dtype=out_dtype)
  cfg = AttentionConfig(scale=float(scale), is_causal=bool(is_causal), window=window,
                        implementation=backend, out_dtype=out_dtype,
                        grad_dtypes=(q_dtype, k_dtype, v_dtype),
                        deterministic=bool(deterministic))
  # Kernels take lengths always: the full length where none is given.
  q_len = q_seqlen if q_seqlen is not None else jnp.full((B,), T, jnp.int32)
  kv_len = kv_seqlen if kv_seqlen is not None else jnp.full((B,), S, jnp.int32)
  o, lse = _attention(cfg, _expand4(query), _expand4(key), _expand4(value), bias4, mask4,
                      q_len, kv_len)
  if rank3:
    o, lse = o[0], lse[0]
  return (o, lse) if return_residual else o


__all__ = ["dot_product_attention", "AttentionConfig", "IMPLEMENTATIONS"]
