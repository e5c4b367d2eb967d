"""Python side of the Hopper (sm_90a) CUDA kernels: FFI registration and the jnp-facing calls.

The forward pass is a few FFI calls (so XLA owns every intermediate buffer). Two score paths:
  ``scores="exact"`` (the default; the accuracy contract's path): Q and K are dequantized to bf16,
    which holds every MX value exactly, and Q K^T runs on bf16 wgmma with fp32 sums.
  ``scores="fp8"`` (opt-in; faster at H >= 128 on an H200, slower at H = 64): ``prep_rows`` on Q and on K re-expresses each row of H elements on ONE
    power-of-two scale (the largest of its block scales; exact unless an element underflows), row
    scales as fp32, and Q K^T runs on FP8 wgmma, whose sums keep fewer bits than fp32
    (docs/HOPPER_FORWARD.md, "Accuracy").
Both: ``prep_v`` transposes V to [B, K, H, S_pad] (S contiguous, keys permuted inside 16-key groups
to match the kernel's P registers) on one scale per head-dim column over the valid keys, and ``fwd``
is the FA3-style warp-specialised kernel, P V on FP8 wgmma.
From float inputs, Q and K are quantized inside ``prep_rows`` (fp8) or ``exact_rows`` (exact), V by
the GPU MX quantizer; the result is bit-identical to ``forward_mx`` on
``jax_fa4.mx.quantize``'d inputs.

Every call works under ``jax.jit`` and ``jax.vmap``: the handlers fold any leading dims into the batch
and the ffi_calls use ``vmap_method="broadcast_all"``.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_fa4 import mx

HEAD_DIMS = (64, 128, 256)
SEQ_PAD = 128  # V^T rows and the key scales are padded to this (csrc/cuda/tile_config.cuh kSeqPad)
OUT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
_MAX_GRID_YZ = 65535  # gridDim.y/z limit: the backward and prep_v grids put (kv) heads in y, the batch in z

_T_QUANTIZE = "jax_fa4_cuda_quantize"
_T_PREP_ROWS_MX = "jax_fa4_cuda_prep_rows_mx"
_T_PREP_ROWS_FLOAT = "jax_fa4_cuda_prep_rows_float"
_T_PREP_V = "jax_fa4_cuda_prep_v"
_T_EXACT_ROWS_MX = "jax_fa4_cuda_exact_rows_mx"
_T_EXACT_ROWS_FLOAT = "jax_fa4_cuda_exact_rows_float"
_T_FWD = "jax_fa4_cuda_fwd"
_T_BWD = "jax_fa4_cuda_bwd"
_BWD_BLOCK_M = 64  # the backward's query tile: lse2 / delta rows are padded to it (launch.h kBwdBlockM)
_LOG2E = 1.4426950408889634
# dQ of a bf16 / f16 gradient is accumulated in fp32 a chunk of (batches, kv heads) at a time and
# written over the bf16 copy of q (csrc/cuda/bwd_dq_epilogue.cuh): a quarter of the accumulator is
# live instead of all of it, once it is large enough to matter next to the step's other tensors.
_DQ_CHUNKS = 4
_DQ_CHUNK_MIN_BYTES = 32 << 20


def _dq_chunking(B, T, N, K, H, deterministic=False):
  """(batches, kv heads) per dQ chunk of a bf16 / f16 dQ: about 1 / _DQ_CHUNKS of the accumulator.

  Each chunk's launch drains the GPU before the next starts. With CTAs of equal work that costs
  little (H100, B=2, T=S=8192, N=16, H=128, co.backward alone: 7096 us in four chunks vs 6955 in
  one). A causal mask's CTAs shrink with their key tile: in key-tile-fastest order four chunks cost
  +14% of forward+backward (5862 vs 5144 us); the launcher's key-tile-slowest order for causal
  masks brought that to +1% (3750 vs 3713 us) and made the causal backward 5% faster in one chunk
  (3716 vs 3926 us). The deterministic dQ order chains the CTAs (+10% for four chunks: 7896 vs
  7171 us): those run in one chunk (docs/HOPPER_BACKWARD.md, "Grid order under a causal mask").
  """
  if 4 * B * T * N * H <= _DQ_CHUNK_MIN_BYTES or deterministic:
    return B, K
  if B >= _DQ_CHUNKS:
    return -(-B // _DQ_CHUNKS), K
  return 1, -(-K // -(-_DQ_CHUNKS // B))


def _ext():
  from jax_fa4 import _jax_fa4_cuda  # built only with JAX_FA4_CUDA (CMake)
  return _jax_fa4_cuda


@functools.lru_cache(maxsize=None)
def _register() -> bool:
  for name, capsule in _ext().registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
  return True


@functools.lru_cache(maxsize=None)
def available() -> bool:
  """True if the extension imports and jax's default backend is a compute-capability-9.0 GPU."""
  try:
    _ext()
  except ImportError:
    return False
  try:
    if jax.default_backend() != "gpu":
      return False
    dev = jax.devices()[0]
  except RuntimeError:
    return False
  if str(getattr(dev, "compute_capability", "")) != "9.0":
    return False
  _register()
  return True


def _ensure():
  if not available():
    raise RuntimeError("jax_fa4 CUDA kernels are not available: they need the _jax_fa4_cuda extension "
                       "(JAX_FA4_CUDA=ON build) and a compute-capability 9.0 (Hopper) GPU backend")


# ---------------------------------------------------------------------------------------------
# Validation

def _norm_window(window):
  """(left, right) with -1 for unbounded, or raises ValueError naming `window`."""
  if window is None:
    return -1, -1
  try:
    left, right = window
  except (TypeError, ValueError):
    raise ValueError(f"window={window!r} must be None or a pair (left, right)") from None
  out = []
  for side, w in (("left", left), ("right", right)):
    if w is None:
      out.append(-1)
      continue
    if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 0:
      raise ValueError(f"window={window!r}: {side} bound {w!r} must be None or an int >= 0")
    out.append(int(w))
  return tuple(out)


def unsupported_reason(q_shape, k_shape, dtype=None, head_dim=None, window=None, *, v_shape=None,
                       out_dtype=None, has_bias=False, has_mask=False) -> Optional[str]:
  """None if the kernels serve this call, else a sentence saying what they can't do.

  q_shape [B, T, N, H], k_shape [B, S, K, H]; dtype: the input dtype (float8_e4m3fn for MX inputs,
  or bfloat16/float16/float32 for forward_float); head_dim defaults to q_shape[-1].
  """
  if has_bias:
    return "a dense bias is not supported by the CUDA kernels"
  if has_mask:
    return "a dense mask is not supported by the CUDA kernels"
  q_shape, k_shape = tuple(q_shape), tuple(k_shape)
  if len(q_shape) != 4 or len(k_shape) != 4:
    return f"q_shape={q_shape} and k_shape={k_shape} must both be rank 4 ([B, T, N, H], [B, S, K, H])"
  B, T, N, H = q_shape
  Bk, S, K, Hk = k_shape
  if head_dim is not None and head_dim != H:
    return f"head_dim={head_dim} does not match q_shape[-1]={H}"
  if H not in HEAD_DIMS:
    return f"head_dim={H} is not supported (the sm_90a kernel supports {HEAD_DIMS})"
  if Hk != H or Bk != B:
    return f"k_shape={k_shape} does not match q_shape={q_shape} in batch or head dim"
  if v_shape is not None and tuple(v_shape) != k_shape:
    return f"v_shape={tuple(v_shape)} must equal k_shape={k_shape}"
  if K <= 0 or N % K != 0:
    return f"query heads N={N} must be a positive multiple of kv heads K={K}"
  if N > _MAX_GRID_YZ or B > _MAX_GRID_YZ:
    return f"N={N} and B={B} must be <= {_MAX_GRID_YZ} (grid limits)"
  if K * (H // 64) > _MAX_GRID_YZ:  # prep_v: (kv head, 64-column block) per grid row; the backward needs fewer
    return f"kv heads K={K} times head_dim/64={H // 64} must be <= {_MAX_GRID_YZ} (grid limits)"
  if T >= 2**31 or S >= 2**31 - SEQ_PAD:
    return f"T={T} and S={S} must fit int32"
  if dtype is not None:
    dt = jnp.dtype(dtype)
    if dt != jnp.dtype(mx.E4M3) and dt not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
      return f"dtype={dt} must be float8_e4m3fn (MX) or one of bfloat16, float16, float32"
  if out_dtype is not None and jnp.dtype(out_dtype) not in [jnp.dtype(d) for d in OUT_DTYPES]:
    return f"out_dtype={jnp.dtype(out_dtype)} must be bfloat16, float16 or float32"
  try:
    _norm_window(window)
  except ValueError as e:
    return str(e)
  return None


def _check_lengths(name, x, B):
  x = jnp.asarray(x)
  if x.shape != (B,):
    raise ValueError(f"{name}.shape={x.shape} must be ({B},)")
  if x.dtype != jnp.int32:
    raise ValueError(f"{name}.dtype={x.dtype} must be int32")
  return x


def _check_common(q_shape, k_shape, v_shape, dtype, window, out_dtype, scale):
  reason = unsupported_reason(q_shape, k_shape, dtype, None, window, v_shape=v_shape, out_dtype=out_dtype)
  if reason is not None:
    if "not supported" in reason:
      raise NotImplementedError(reason)
    raise ValueError(reason)
  if not isinstance(scale, (float, int, np.floating, np.integer)) or not math.isfinite(float(scale)):
    raise ValueError(f"scale={scale!r} must be a finite Python float")


# ---------------------------------------------------------------------------------------------
# FFI calls

def _s_pad(S):
  return max(SEQ_PAD, -(-S // SEQ_PAD) * SEQ_PAD)


def _prep_rows_mx(x: mx.MXArray, l_pad: int):
  B, L, NH, HD = x.data.shape
  out = (jax.ShapeDtypeStruct((B, L, NH, HD), mx.E4M3), jax.ShapeDtypeStruct((B, NH, l_pad), jnp.float32))
  return jax.ffi.ffi_call(_T_PREP_ROWS_MX, out, vmap_method="broadcast_all")(x.data, mx.e8m0_to_bytes(x.scale))


def _prep_rows_float(x, l_pad: int):
  B, L, NH, HD = x.shape
  out = (jax.ShapeDtypeStruct((B, L, NH, HD), mx.E4M3), jax.ShapeDtypeStruct((B, NH, l_pad), jnp.float32))
  return jax.ffi.ffi_call(_T_PREP_ROWS_FLOAT, out, vmap_method="broadcast_all")(x)


def _prep_v(v: mx.MXArray, kv_len, s_pad: int):
  B, S, K, H = v.data.shape
  out = (jax.ShapeDtypeStruct((B, K, H, s_pad), mx.E4M3), jax.ShapeDtypeStruct((B, K, H), jnp.float32))
  return jax.ffi.ffi_call(_T_PREP_V, out, vmap_method="broadcast_all")(v.data, mx.e8m0_to_bytes(v.scale), kv_len)


SCORES = ("exact", "fp8")


def _check_scores(scores):
  if scores not in SCORES:
    raise ValueError(f"scores={scores!r} must be one of {SCORES}")


def _check_mx(name, x, axis):
  """x must be a rank-4 MXArray blocked along ``axis`` (3 = H, 1 = S), with valid data."""
  if not isinstance(x, mx.MXArray):
    raise ValueError(f"{name} must be a jax_fa4.mx.MXArray, got {type(x).__name__}")
  if x.ndim != 4:
    raise ValueError(f"{name}.shape={tuple(x.shape)} must be rank 4")
  if x.axis != axis:
    raise ValueError(f"{name}.axis={x.axis} must be {axis} ({name} is blocked along "
                     f"{'H' if axis == 3 else 'S'})")
  x.validate(name)


def _exact_rows(x: mx.MXArray):
  """The exact-score path's Q/K operand: the dequantized MX values in bf16 (a CUDA kernel, bit for
  bit ``x.dequantize(jnp.bfloat16)``).

  Exact: an e4m3 value (4 significant bits) times a power of two is a bf16 value with the same
  exponent range as fp32, except below 2^-130, where bf16's subnormals run out of bits before
  fp32's do (block scales under 2^-124: inputs of magnitude ~1e-35). The row scales are unused,
  so they are passed empty.
  """
  out = jax.ShapeDtypeStruct(x.data.shape, jnp.bfloat16)
  q = jax.ffi.ffi_call(_T_EXACT_ROWS_MX, out, vmap_method="broadcast_all")(x.data, mx.e8m0_to_bytes(x.scale))
  return q, jnp.zeros((0,), jnp.float32)


def _exact_rows_float(x):
  """As :func:`_exact_rows` of ``mx.quantize(x, -1)``, from floats in one pass."""
  out = jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
  return jax.ffi.ffi_call(_T_EXACT_ROWS_FLOAT, out, vmap_method="broadcast_all")(x), jnp.zeros((0,), jnp.float32)


def _fwd(q8, qs, k8, ks, vt, vs, q_len, kv_len, *, scale, is_causal, window, out_dtype):
  B, T, N, H = q8.shape
  left, right = _norm_window(window)
  out = (jax.ShapeDtypeStruct((B, T, N, H), out_dtype), jax.ShapeDtypeStruct((B, T, N), jnp.float32))
  return jax.ffi.ffi_call(_T_FWD, out, vmap_method="broadcast_all")(
      q8, qs, k8, ks, vt, vs, q_len, kv_len, scale=np.float32(scale), causal=np.int64(bool(is_causal)),
      window_left=np.int64(left), window_right=np.int64(right))


def _empty_result(B, T, N, H, out_dtype):
  return jnp.zeros((B, T, N, H), out_dtype), jnp.full((B, T, N), -jnp.inf, jnp.float32)


# ---------------------------------------------------------------------------------------------
# Public entry points

def quantize(x, axis: int = -1) -> mx.MXArray:
  """Float -> MXFP8 along ``axis`` on the GPU; bit-exact with :func:`jax_fa4.mx.quantize`."""
  x = jnp.asarray(x)
  if x.dtype not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
    raise ValueError(f"x.dtype={x.dtype} must be bfloat16, float16 or float32")
  if x.ndim == 0:
    raise ValueError(f"x.shape={x.shape} must have at least one axis to block along")
  if not -x.ndim <= axis < x.ndim:
    raise ValueError(f"axis={axis} is out of range for an array of rank {x.ndim}")
  axis = axis % x.ndim
  _ensure()
  shape = x.shape
  if x.size == 0:
    return mx.quantize(x, axis)
  outer = int(np.prod(shape[:axis], dtype=np.int64))
  L = shape[axis]
  inner = int(np.prod(shape[axis + 1:], dtype=np.int64))
  nblk = -(-L // mx.BLOCK)
  out = (jax.ShapeDtypeStruct((outer, L, inner), mx.E4M3), jax.ShapeDtypeStruct((outer, nblk, inner), jnp.uint8))
  data, sb = jax.ffi.ffi_call(_T_QUANTIZE, out, vmap_method="broadcast_all")(x.reshape(outer, L, inner))
  return mx.MXArray(data=data.reshape(shape), scale=mx.e8m0_from_bytes(sb.reshape(mx.scale_shape(shape, axis))),
                    axis=axis)


def forward_mx(q: mx.MXArray, k: mx.MXArray, v: mx.MXArray, q_seqlen, kv_seqlen, *, scale: float,
               is_causal: bool = False, window=None, out_dtype=jnp.bfloat16, scores: str = "exact"):
  """MXFP8 attention forward on Hopper: ``(o [B,T,N,H] out_dtype, lse [B,T,N] float32)``.

  q, k: MXArray blocked along H (axis 3); v: MXArray blocked along S (axis 1); q_seqlen,
  kv_seqlen: int32 [B]. window: None or (left, right), each None (unbounded) or an int >= 0.
  scores: "exact" (Q K^T on bf16 wgmma from the exact dequantized values) or "fp8" (FP8 wgmma).
  """
  _check_scores(scores)
  for name, x, ax in (("q", q, 3), ("k", k, 3), ("v", v, 1)):
    _check_mx(name, x, ax)
  _check_common(q.shape, k.shape, v.shape, mx.E4M3, window, out_dtype, scale)
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  q_len = _check_lengths("q_seqlen", q_seqlen, B)
  kv_len = _check_lengths("kv_seqlen", kv_seqlen, B)
  _ensure()
  if T == 0 or S == 0 or B == 0:
    return _empty_result(B, T, N, H, out_dtype)
  s_pad = _s_pad(S)
  if scores == "exact":
    (q8, qs), (k8, ks) = _exact_rows(q), _exact_rows(k)
  else:
    q8, qs = _prep_rows_mx(q, T)
    k8, ks = _prep_rows_mx(k, s_pad)
  vt, vs = _prep_v(v, kv_len, s_pad)
  return _fwd(q8, qs, k8, ks, vt, vs, q_len, kv_len, scale=scale, is_causal=is_causal, window=window,
              out_dtype=out_dtype)


def forward_float(q, k, v, q_seqlen, kv_seqlen, *, scale: float, is_causal: bool = False, window=None,
                  out_dtype=jnp.bfloat16, scores: str = "exact"):
  """As :func:`forward_mx` from bf16/f16/f32 inputs q [B,T,N,H], k, v [B,S,K,H].

  Bit-identical to ``forward_mx(mx.quantize(q, 3), mx.quantize(k, 3), mx.quantize(v, 1), ...)``:
  Q and K are quantized inside the row-prep kernels (``exact_rows`` or ``prep_rows``), V by the GPU
  MX quantizer.
  """
  _check_scores(scores)
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4:
      raise ValueError(f"{name}.shape={x.shape} must be rank 4")
    if x.dtype not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
      raise ValueError(f"{name}.dtype={x.dtype} must be bfloat16, float16 or float32")
  _check_common(q.shape, k.shape, v.shape, q.dtype, window, out_dtype, scale)
  B, T, N, H = q.shape
  S = k.shape[1]
  q_len = _check_lengths("q_seqlen", q_seqlen, B)
  kv_len = _check_lengths("kv_seqlen", kv_seqlen, B)
  _ensure()
  if T == 0 or S == 0 or B == 0:
    return _empty_result(B, T, N, H, out_dtype)
  s_pad = _s_pad(S)
  if scores == "exact":
    (q8, qs), (k8, ks) = _exact_rows_float(q), _exact_rows_float(k)
  else:
    q8, qs = _prep_rows_float(q, T)
    k8, ks = _prep_rows_float(k, s_pad)
  vt, vs = _prep_v(quantize(v, 1), kv_len, s_pad)
  return _fwd(q8, qs, k8, ks, vt, vs, q_len, kv_len, scale=scale, is_causal=is_causal, window=window,
              out_dtype=out_dtype)


def _grad_dtype(name, dtype):
  """A gradient dtype argument as a jnp.dtype: float32, bfloat16 or float16, else ValueError naming it."""
  ok = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
  try:
    dt = jnp.dtype(dtype)
  except TypeError:
    dt = None
  if dt not in ok:
    raise ValueError(f"{name}={dtype!r} must be one of float32, bfloat16, float16")
  return dt


def backward(q: mx.MXArray, k: mx.MXArray, v: mx.MXArray, do: mx.MXArray, lse, delta, q_seqlen,
             kv_seqlen, *, scale: float, is_causal: bool = False, window=None,
             deterministic: bool = False, dkv_dtype=jnp.float32, dq_dtype=jnp.float32,
             _dq_chunk=None):
  """MX attention backward on Hopper: ``(dq [B,T,N,H] in dq_dtype, dk, dv [B,S,K,H] in dkv_dtype)``.

  q, k, v: MXArray blocked along H (axis 3): the forward's q and k, and v blocked along H.
  do: dO as an MXArray blocked along H, or the cotangent itself ([B,T,N,H] float), which is used
  as ``mx.quantize(do, 3)`` (bit for bit).
  lse: the forward's float32 [B,T,N] (natural log, -inf for rows without keys); delta =
  rowsum(O * dO), float32 [B,T,N]. Every product runs on bf16 wgmma over the exact dequantized
  values (csrc/cuda/bwd_sm90_kernel.cuh): q and do as bf16 copies (``_exact_rows``), k and v as MX
  (e4m3 data + scale bytes), dequantized by the kernel into shared memory to the same bf16 bits.
  dS is rounded to MX e4m3 as the recipe rounds it (along S for dQ, along T for dK), online in
  registers. ``deterministic``: dQ's cross-tile adds in a fixed order (bitwise reproducible)
  instead of unordered ones.
  ``dkv_dtype``: float32, bfloat16 or float16; dK and dV are accumulated in fp32 and rounded once,
  in the kernel, so no fp32 copy of them is made for a lower-precision caller.
  ``dq_dtype``: float32, bfloat16 or float16; dQ is accumulated in fp32 across the key tiles and
  rounded once. For bfloat16 / float16 the accumulator covers one chunk of (batches, kv heads) at a
  time (``_dq_chunking``: non-deterministic calls only; ``_dq_chunk=(batches, kv_heads)``
  overrides it, for tests) and a bfloat16 dQ is written over the kernel's bf16 copy of q: one
  chunk's fp32 accumulator is live instead of all of dQ's.
  """
  for name, x in (("q", q), ("k", k), ("v", v)):
    _check_mx(name, x, 3)
  if isinstance(do, mx.MXArray):
    _check_mx("do", do, 3)
  else:
    do = jnp.asarray(do)
    if do.dtype not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
      raise ValueError(f"do.dtype={do.dtype} must be bfloat16, float16 or float32 (or do an MXArray)")
    if do.shape != q.shape:
      raise ValueError(f"do.shape={do.shape} must equal q.shape={q.shape}")
  _check_common(q.shape, k.shape, v.shape, mx.E4M3, window, jnp.float32, scale)
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  if tuple(do.shape) != tuple(q.shape):
    raise ValueError(f"do.shape={tuple(do.shape)} must equal q.shape={tuple(q.shape)}")
  for name, x in (("lse", lse), ("delta", delta)):
    x = jnp.asarray(x)
    if x.shape != (B, T, N) or x.dtype != jnp.float32:
      raise ValueError(f"{name}.shape={x.shape} ({x.dtype}) must be {(B, T, N)} float32")
  if not isinstance(deterministic, (bool, np.bool_)):
    raise ValueError(f"deterministic={deterministic!r} must be a bool")
  dkv_dtype = _grad_dtype("dkv_dtype", dkv_dtype)
  dq_dtype = _grad_dtype("dq_dtype", dq_dtype)
  q_len = _check_lengths("q_seqlen", q_seqlen, B)
  kv_len = _check_lengths("kv_seqlen", kv_seqlen, B)
  _ensure()
  if dq_dtype == jnp.dtype(jnp.float32):
    chunk_b, chunk_kh = B, K  # dQ is its own accumulator
  else:
    chunk_b, chunk_kh = (_dq_chunking(B, T, N, K, H, bool(deterministic)) if _dq_chunk is None
                         else _dq_chunk)
    if not (1 <= chunk_b <= max(B, 1) and 1 <= chunk_kh <= K):
      raise ValueError(f"_dq_chunk={_dq_chunk!r} must be (batches in [1, {B}], kv heads in [1, {K}])")
  if T == 0 or S == 0 or B == 0 or N == 0:
    return (jnp.zeros((B, T, N, H), dq_dtype), jnp.zeros((B, S, K, H), dkv_dtype),
            jnp.zeros((B, S, K, H), dkv_dtype))
  # q and dO: bf16 copies for the kernel's TMA ring. K and V go in as MX (data + scale bytes): each
  # CTA dequantizes its key tile into shared memory (the same bf16 bits as _exact_rows), which
  # saves two transient bf16 tensors (2 x B*S*K*H*2 bytes) and their memory passes.
  # dO given as the cotangent itself: its bf16 copy straight from the floats in one pass (the
  # values of mx.quantize(do, 3), bit for bit), with no MX dO in between.
  # Both copies wait for the lse: q's MX residual and dO (a jit argument when the loss is a weighted
  # sum) are ready at the step's start, so XLA may otherwise make them before the forward kernel
  # and keep their 2 x 64 MiB live through it, where the step's peak is (docs/HOPPER_BACKWARD.md,
  # "Peak memory: the schedule").
  q, do, lse = jax.lax.optimization_barrier((q, do, lse))
  qe = _exact_rows(q)[0]
  doe = (_exact_rows(do) if isinstance(do, mx.MXArray) else _exact_rows_float(do))[0]
  t_pad = -(-T // _BWD_BLOCK_M) * _BWD_BLOCK_M
  # P = exp2(S scale log2e - lse2): rows past q_len and rows without keys get lse2 = +inf (P = 0).
  lse = jnp.asarray(lse)
  live = (jnp.arange(T)[None, :, None] < q_len[:, None, None]) & (lse != -jnp.inf)
  lse2 = jnp.where(live, lse * np.float32(_LOG2E), jnp.inf).transpose(0, 2, 1)
  lse2 = jnp.pad(lse2, ((0, 0), (0, 0), (0, t_pad - T)), constant_values=np.inf)
  delta_t = jnp.pad(jnp.asarray(delta).transpose(0, 2, 1), ((0, 0), (0, 0), (0, t_pad - T)))
  left, right = _norm_window(window)
  chunks = H // 128 if H > 128 else 1  # CTAs per key tile along H (launch.h bwd_column_chunks)
  # dq_acc: the fp32 accumulator of one dQ chunk (none for a float32 dQ, its own accumulator).
  acc_shape = (0,) if dq_dtype == jnp.dtype(jnp.float32) else (chunk_b, T, chunk_kh * (N // K), H)
  out = (jax.ShapeDtypeStruct((B, T, N, H), dq_dtype), jax.ShapeDtypeStruct((B, S, K, H), dkv_dtype),
         jax.ShapeDtypeStruct((B, S, K, H), dkv_dtype),
         jax.ShapeDtypeStruct((B, N, chunks, t_pad // _BWD_BLOCK_M), jnp.int32),
         jax.ShapeDtypeStruct(acc_shape, jnp.float32))
  # A bf16 dQ is written over qe, the kernel's bf16 copy of q, chunk by chunk after the CTAs that
  # read that chunk's q are done: its 2 bytes per element are not another live tensor.
  aliases = {0: 0} if dq_dtype == jnp.dtype(jnp.bfloat16) else None
  dq, dk, dv, _, _ = jax.ffi.ffi_call(_T_BWD, out, vmap_method="broadcast_all",
                                      input_output_aliases=aliases)(
      qe, k.data, mx.e8m0_to_bytes(k.scale), v.data, mx.e8m0_to_bytes(v.scale), doe, lse2, delta_t, q_len,
      kv_len, scale=np.float32(scale),
      causal=np.int64(bool(is_causal)), window_left=np.int64(left), window_right=np.int64(right),
      deterministic=np.int64(bool(deterministic)), dq_chunk_kh=np.int64(chunk_kh))
  # The kernel accumulates dS K; its dQ epilogue applies the softmax scale with the one rounding.
  return dq, dk, dv


__all__ = ["available", "unsupported_reason", "forward_mx", "forward_float", "backward", "quantize",
           "SCORES"]
