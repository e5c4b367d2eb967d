// Scalar MX (OCP MXFP8, NUMERICS.md section 1) arithmetic on the device, bit-exact with
// jax_fa4/mx.py: the e8m0 scale rule and exact power-of-two scaling. Shared by the preparation
// kernels (mx_prep.cuh) and the backward (bwd_sm90_kernel.cuh: the online dS quantization, and the
// dequantization of K and V into its shared-memory tiles, which must match exact_rows bit for bit).
#pragma once
#include <cuda_bf16.h>
#include <cstdint>
#include "cuda/sm90_ptx.cuh"

namespace jax_fa4::prep {

// e8m0 byte -> fp32 2^(byte-127): 0 -> 2^-127 (an fp32 subnormal), 255 -> NaN.
__device__ __forceinline__ float e8m0_to_float(uint32_t byte) {
  if (byte == 255u) return __int_as_float(0x7fc00000);
  if (byte == 0u) return __int_as_float(0x00400000);
  return __int_as_float(byte << 23);
}

// The scale byte of a block with absolute maximum amax (NUMERICS.md section 1, jax_fa4/mx.py):
// v = amax * fp32(1/448); byte = biased exponent of v, +1 if its mantissa is non-zero, <= 254;
// NaN -> 255. XLA flushes fp32 subnormals, so a subnormal v counts as 0 here too (byte 0).
__device__ __forceinline__ uint32_t scale_byte_from_amax(float amax) {
  if (amax != amax) return 255u;
  const float v = __fmul_rn(amax, 1.0f / 448.0f);
  const uint32_t bits = __float_as_uint(v);
  const uint32_t exp = (bits >> 23) & 0xffu;
  if (exp == 0u) return 0u;
  const uint32_t byte = exp + ((bits & 0x7fffffu) != 0u ? 1u : 0u);
  return byte > 254u ? 254u : byte;
}

// x * 2^(127 - byte) exactly as mx.py does it: two normal power-of-two factors (floor split).
__device__ __forceinline__ float scale_down(float x, uint32_t byte) {
  const int e = 127 - (int)byte;                     // in [-127, 127]
  const int e1 = (e >= 0) ? e / 2 : -((-e + 1) / 2);  // floor(e / 2)
  const int e2 = e - e1;
  return __fmul_rn(__fmul_rn(x, jax_fa4::sm90::pow2i(e1)), jax_fa4::sm90::pow2i(e2));
}

// x * 2^(byte - 127) exactly as mx.dequantize: two normal power-of-two factors; NaN for byte 255.
__device__ __forceinline__ float scale_up(float x, uint32_t byte) {
  if (byte == 255u) return __int_as_float(0x7fc00000);
  const int e = (int)byte - 127;                     // in [-127, 127]
  const int e1 = (e >= 0) ? e / 2 : -((-e + 1) / 2);  // floor(e / 2), as mx._pow2_factors
  return __fmul_rn(__fmul_rn(x, jax_fa4::sm90::pow2i(e1)), jax_fa4::sm90::pow2i(e - e1));
}

// ---- Online MX rounding of fp32 values held in registers (the backward's dS).
// max(|a|, |b|) as a float, one FMNMX with |.| operands (an integer max of |x| bits takes three
// instructions); its bits, being non-negative, order as the floats do, so online_scale_byte takes
// them. A NaN is the one difference from a max of bits, where NaN's bits exceed +inf's: fmaxf
// returns the other operand (NaN only when both are), so a block holding a NaN gets the scale of
// its finite values instead of 253. Every product summed over such a block is NaN either way (the
// NaN element stays NaN through the e4m3 rounding), so the backward's outputs are the same.
__device__ __forceinline__ float abs_max(float a, float b) { return fmaxf(fabsf(a), fabsf(b)); }

// The scale byte of a block from its amax bits, branch-free: v = amax * fp32(1/448); adding 2^23 - 1
// to v's bits carries into the exponent exactly when the mantissa is non-zero (the rule's round-up).
// Clamped to 253 so that both 2^(127 - byte) and 2^(byte - 127) are normal floats. It agrees with
// scale_byte_from_amax except where no finite dS lands: amax == 0 gives 0 (and every element is 0),
// amax < 448 * 2^-126 gives 1 (mx.py: 0; XLA flushes v), inf / NaN give 253 (254 / 255; a NaN
// element still propagates: it is NaN after the rounding, and so is every sum over its block).
__device__ __forceinline__ uint32_t online_scale_byte(uint32_t amax_bits) {
  const uint32_t v = __float_as_uint(__fmul_rn(__uint_as_float(amax_bits), 1.0f / 448.0f));
  return min((v + 0x7fffffu) >> 23, 253u);
}

struct MxScale {
  float down, up;  // 2^(127 - byte), 2^(byte - 127)
};
__device__ __forceinline__ MxScale mx_scale_of_byte(uint32_t byte) {
  return {__uint_as_float((254u - byte) << 23), __uint_as_float(byte << 23)};
}

// Two values of one block quantized to e4m3 (round-to-nearest-even, saturating) and dequantized:
// mx.quantize then dequantize, as exact fp32 (and bf16) values. Byte 0 (amax 0) gives 0.
__device__ __forceinline__ float2 mx_round2(float a, float b, MxScale s) {
  const float2 e = jax_fa4::sm90::e4m3x2_to_float2(jax_fa4::sm90::cvt_e4m3x2(a * s.down, b * s.down));
  return make_float2(e.x * s.up, e.y * s.up);
}

// Lane-wise max of two pairs of 16-bit unsigned integers (scale bytes two at a time).
__device__ __forceinline__ uint32_t max_u16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.u16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// ---- MX -> bf16 (the exact-score operands). One function for exact_rows_kernel (mx_prep.cuh) and
// the backward's K / V tiles (bwd_sm90_kernel.cuh), so that both produce the same bits by
// construction: the backward's tiles must hold exactly what the TMA load of exact_rows' output held.
__device__ __forceinline__ uint32_t bf16x2_bits(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Two words of packed e4m3 (8 elements, element i in byte i) on scale `byte` -> 8 bf16 (16 bytes,
// element i in bf16 i).
__device__ __forceinline__ uint4 dequant8_bf16(uint32_t w0, uint32_t w1, uint32_t byte) {
  uint32_t o[4];
  const uint32_t w[2] = {w0, w1};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float2 a = jax_fa4::sm90::e4m3x2_to_float2((uint16_t)(w[i] & 0xffffu));
    const float2 b = jax_fa4::sm90::e4m3x2_to_float2((uint16_t)(w[i] >> 16));
    o[2 * i + 0] = bf16x2_bits(scale_up(a.x, byte), scale_up(a.y, byte));
    o[2 * i + 1] = bf16x2_bits(scale_up(b.x, byte), scale_up(b.y, byte));
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

}  // namespace jax_fa4::prep
