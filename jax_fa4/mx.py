"""The MX format: MXFP8-E4M3 tensors (OCP Microscaling v1.0), as NUMERICS.md section 1 specifies.

An :class:`MXArray` holds e4m3 elements and one e8m0 power-of-two scale per 32 consecutive
elements along one axis (the *block axis*). Scales are kept in logical row-major order, the
layout ``jax.nn.scaled_matmul`` uses: the scale array has the data's shape with the block axis
divided by 32 (rounded up).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32
E4M3_MAX = 448.0
E4M3 = jnp.float8_e4m3fn
E8M0 = jnp.float8_e8m0fnu

# fp32(1/448): the scale rule multiplies by this rounded constant, it does not divide by 448.
_INV_E4M3_MAX = np.float32(1.0) / np.float32(E4M3_MAX)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MXArray:
  """An MXFP8 tensor: ``value = data * 2**(scale_byte - 127)`` blockwise along ``axis``.

  Attributes:
    data: ``float8_e4m3fn`` elements, the logical shape of the tensor.
    scale: ``float8_e8m0fnu`` scales, ``data.shape`` with ``axis`` divided by 32, rounded up.
    axis: the (non-negative) block axis; static metadata of the pytree.
  """

  data: jax.Array
  scale: jax.Array
  axis: int = dataclasses.field(metadata=dict(static=True))

  @property
  def shape(self):
    return self.data.shape

  @property
  def ndim(self):
    return self.data.ndim

  @property
  def dtype(self):
    return self.data.dtype

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    return dequantize(self, dtype)

  def validate(self, name: str = "x") -> None:
    """Raises ``TypeError``/``ValueError`` naming ``name`` if this is not a well-formed MXArray."""
    data, scale = self.data, self.scale
    if data.dtype != E4M3:
      raise TypeError(f"{name}.data.dtype={data.dtype} must be float8_e4m3fn")
    if scale.dtype != E8M0:
      raise TypeError(f"{name}.scale.dtype={scale.dtype} must be float8_e8m0fnu")
    if not 0 <= self.axis < data.ndim:
      raise ValueError(f"{name}.axis={self.axis} must be in [0, {data.ndim})")
    want = scale_shape(data.shape, self.axis)
    if tuple(scale.shape) != want:
      raise ValueError(
          f"{name}.scale.shape={tuple(scale.shape)} does not match {name}.data.shape="
          f"{tuple(data.shape)} blocked along axis {self.axis}: expected {want}")


def scale_shape(shape, axis: int) -> tuple[int, ...]:
  shape = list(shape)
  shape[axis] = -(-shape[axis] // BLOCK)
  return tuple(shape)


def _normalize_axis(axis: int, ndim: int, name: str = "axis") -> int:
  if not -ndim <= axis < ndim:
    raise ValueError(f"{name}={axis} is out of range for an array of rank {ndim}")
  return axis % ndim


def _pad_to_blocks(x: jax.Array, axis: int) -> jax.Array:
  n = x.shape[axis]
  pad = (-n) % BLOCK
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths)


def _blocked(x: jax.Array, axis: int) -> jax.Array:
  """[..., L, ...] -> [..., L/32, 32, ...] (zero-padded), blocks split along ``axis``."""
  x = _pad_to_blocks(x, axis)
  shape = list(x.shape)
  shape[axis:axis + 1] = [shape[axis] // BLOCK, BLOCK]
  return x.reshape(shape)


def scale_bytes_from_amax(amax: jax.Array) -> jax.Array:
  """The e8m0 scale byte (uint8) of a block with absolute maximum ``amax`` (float32).

  ``v = amax * fp32(1/448)``; the byte is v's biased exponent, plus one when v's mantissa is
  non-zero (the scale rounds up, so no element saturates). 0 -> 0x00, inf -> 0xFE, NaN -> 0xFF.
  """
  amax = amax.astype(jnp.float32)
  v = amax * _INV_E4M3_MAX
  bits = jax.lax.bitcast_convert_type(v, jnp.uint32)
  exp = (bits >> 23) & 0xFF
  mant = bits & 0x7FFFFF
  byte = exp + (mant != 0).astype(jnp.uint32)
  byte = jnp.minimum(byte, 254)  # inf (and rounding up out of range) clamp to the largest scale
  byte = jnp.where(jnp.isnan(amax), 255, byte)
  return byte.astype(jnp.uint8)


def _pow2_factors(e: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Two normal fp32 powers of two whose product is 2**e, for e in [-127, 127].

  XLA flushes fp32 subnormals to zero, and 2**-127 is one; multiplying by two normal factors
  keeps x * 2**e exact wherever the result itself is a normal number.
  """
  e1 = e // 2
  e2 = e - e1
  one = jnp.float32(1.0)
  return jnp.ldexp(one, e1), jnp.ldexp(one, e2)


def _scale_by_bytes(x: jax.Array, byte: jax.Array, sign: int) -> jax.Array:
  """x * 2**(sign * (byte - 127)) in float32; NaN where byte is 0xFF (the NaN scale)."""
  b = byte.astype(jnp.int32)
  f1, f2 = _pow2_factors(sign * (b - 127))
  y = (x * f1) * f2
  return jnp.where(b == 255, jnp.float32(jnp.nan), y)


def e8m0_from_bytes(byte: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(byte.astype(jnp.uint8), E8M0)


def e8m0_to_bytes(scale: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(scale, jnp.uint8)


def quantize(x: jax.Array, axis: int = -1) -> MXArray:
  """Quantizes ``x`` to MXFP8-E4M3 with 32-element blocks along ``axis`` (NUMERICS.md section 1).

  Bit-exact with the TransformerEngine/cuDNN rule: the scale rounds up, elements are
  ``e4m3(clamp(x * 2**(127 - scale_byte), -448, 448))`` with round-to-nearest-even.
  A block axis that is not a multiple of 32 is zero-padded for the scale only.
  """
  return _quantize(*_quantize_args(x, axis))


def _quantize_args(x, axis: int) -> tuple[jax.Array, int]:
  """(x as an array, the block axis normalised), or raises naming the bad argument."""
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"x.dtype={x.dtype} must be a floating dtype to quantize")
  if x.ndim == 0:
    raise ValueError(f"x.shape={x.shape} must have at least one axis to block along")
  return x, _normalize_axis(axis, x.ndim)


@functools.partial(jax.jit, static_argnums=1)
def _quantize(x: jax.Array, axis: int) -> MXArray:
  n = x.shape[axis]
  xf = x.astype(jnp.float32)
  xb = _blocked(xf, axis)
  amax = jnp.max(jnp.abs(xb), axis=axis + 1)
  # jnp.max drops NaN-ness only if abs() does; make it explicit so a NaN anywhere marks the block.
  amax = jnp.where(jnp.any(jnp.isnan(xb), axis=axis + 1), jnp.float32(jnp.nan), amax)
  byte = scale_bytes_from_amax(amax)
  scaled = _scale_by_bytes(xb, jnp.expand_dims(byte, axis + 1), -1)
  scaled = jnp.clip(scaled, -E4M3_MAX, E4M3_MAX)
  data = _rounded_e4m3(scaled)
  shape = list(data.shape)
  shape[axis:axis + 2] = [shape[axis] * BLOCK]
  data = data.reshape(shape)
  data = jax.lax.slice_in_dim(data, 0, n, axis=axis)
  return MXArray(data=data, scale=e8m0_from_bytes(byte), axis=axis)


def _cuda_quantizer_available() -> bool:
  """True where the jax_fa4 CUDA extension is built and jax's default backend is a Hopper GPU."""
  from jax_fa4 import _cuda_ops  # imported lazily: _cuda_ops imports this module (not the extension)
  return _cuda_ops.available()


def quantize_auto(x: jax.Array, axis: int = -1) -> MXArray:
  """:func:`quantize` on the fastest quantizer at hand; the same bits everywhere.

  This is ``jax_fa4.quantize``. Where the jax_fa4 CUDA kernels are available (extension built,
  jax's default backend a compute-capability 9.0 GPU) and ``x`` is float32, bfloat16 or float16,
  the computation runs the CUDA quantizer when it is compiled for the GPU (one coalesced pass,
  bit-exact with :func:`quantize`); compiled for another platform (``jax.default_device(cpu)``),
  and everywhere else, it is :func:`quantize` itself. The choice between the two happens at
  lowering (``jax.lax.platform_dependent``), so jit, vmap and grad behave as for
  :func:`quantize`; the derivative is :func:`quantize`'s (its JVP, evaluated by jnp).

  The CUDA quantizer is one opaque custom call: under ``jax.jit`` with sharded inputs XLA gathers
  its operand. The library's own quantizations (``dot_product_attention``) therefore keep using
  :func:`quantize`, which XLA fuses and partitions.
  """
  x, axis = _quantize_args(x, axis)
  from jax_fa4 import _cuda_ops  # imported lazily: _cuda_ops imports this module
  if x.dtype not in [jnp.dtype(d) for d in _cuda_ops.FLOAT_DTYPES] or x.size == 0 \
      or not _cuda_quantizer_available():
    return _quantize(x, axis)
  return _quantize_dispatch_jit(x, axis)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _quantize_dispatch(x: jax.Array, axis: int) -> MXArray:
  from jax_fa4 import _cuda_ops
  return jax.lax.platform_dependent(x, cuda=lambda a: _cuda_ops.quantize(a, axis),
                                    default=lambda a: _quantize(a, axis))


# Through jit even when called eagerly or under vmap alone: platform_dependent then picks its branch
# when the computation is lowered, for the platform of the device it is compiled for. Evaluated
# outside jit it picks by the default backend: an array committed to the CPU of a GPU machine ran
# the CUDA branch on the host (no such FFI handler there; seen on an H100, 2026-12-05).
_quantize_dispatch_jit = jax.jit(_quantize_dispatch, static_argnums=1)


@_quantize_dispatch.defjvp
def _quantize_dispatch_jvp(axis, primals, tangents):
  # The tangent of the jnp quantizer (what quantize_auto's derivative is everywhere else); the
  # primal stays the CUDA kernel's (the same bits).
  (x,), (x_dot,) = primals, tangents
  _, out_dot = jax.jvp(lambda a: _quantize(a, axis), (x,), (x_dot,))
  return _quantize_dispatch(x, axis), out_dot


def expand_scale_bytes(scale: jax.Array, axis: int, length: int) -> jax.Array:
  """The scale bytes repeated 32x along ``axis`` and trimmed to ``length``."""
  b = jnp.repeat(e8m0_to_bytes(scale), BLOCK, axis=axis)
  return jax.lax.slice_in_dim(b, 0, length, axis=axis)


@functools.partial(jax.jit, static_argnums=1)
def dequantize(x: MXArray, dtype=jnp.float32) -> jax.Array:
  """``data * 2**(scale - 127)`` in float32 (exact for normal results), then cast to ``dtype``."""
  b = expand_scale_bytes(x.scale, x.axis, x.data.shape[x.axis])
  return _scale_by_bytes(x.data.astype(jnp.float32), b, +1).astype(dtype)


def requantize(x: MXArray, axis: int) -> MXArray:
  """The same values blocked along another axis (dequantize, then quantize again)."""
  axis = _normalize_axis(axis, x.ndim)
  if axis == x.axis:
    return x
  return quantize(dequantize(x), axis)


def _rounded_e4m3(x: jax.Array) -> jax.Array:
  """fp32 -> e4m3 that XLA cannot optimise away.

  XLA:GPU's default --xla_allow_excess_precision folds convert(convert(x, f8), f32) back to x,
  which would silently skip the rounding the recipe specifies (seen on an H200: the recipe's
  error fell from 2e-2 to 4e-7). The optimization barrier keeps the e4m3 value materialised.
  """
  return jax.lax.optimization_barrier(x.astype(E4M3))


def quantize_fixed(p: jax.Array, scale: float) -> jax.Array:
  """``e4m3(p * scale) / scale`` in float32: the fixed-scale rounding the recipe applies to P."""
  p = p.astype(jnp.float32)
  r = _rounded_e4m3(jnp.clip(p * scale, -E4M3_MAX, E4M3_MAX))
  return r.astype(jnp.float32) / scale
