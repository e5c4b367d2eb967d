// dQ epilogue of the backward: the fp32 accumulator of one dQ chunk (the kernel's unscaled dS K
// over the chunk's batches and heads) -> dQ * scale in the gradient's dtype, written into the
// chunk's slice of the [B, T, N, H] output. One rounding from fp32 (round to nearest even), the
// rounding XLA's `(dq * scale).astype(dtype)` did when this ran in Python: the same bits.
//
// Why chunks: the accumulator of all of dQ is 4 bytes per element, as large as the bf16 copies of
// q and dO together, and it was the largest transient of a training step. Accumulating a quarter
// of the heads at a time, with the bf16 output written over the bf16 copy of q (which only this
// chunk's CTAs read, and they are done), keeps one chunk's accumulator live instead.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace jax_fa4::sm90 {

template <typename Out>
__device__ __forceinline__ uint32_t pack_out2(float a, float b);
template <>
__device__ __forceinline__ uint32_t pack_out2<__nv_bfloat16>(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack_out2<__half>(float a, float b) {
  const __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// acc: rows of acc_row fp32 values, the first row_len (a multiple of 8) of each live (rows = the
// chunk's batches x T, row_len = its heads x H); out row r starts at out + (r / T) * out_batch +
// (r % T) * out_row (elements of Out). Each thread converts 8 consecutive values: two 16-byte loads,
// one 16-byte store (two for fp32).
template <typename Out>
__global__ void __launch_bounds__(256) dq_epilogue_kernel(const float* acc, int acc_row,
                                                         Out* out, int64_t rows, int row_len, int T,
                                                         int64_t out_row, int64_t out_batch, float scale) {
  const int per_row = row_len / 8;
  const int64_t n = rows * per_row;
  for (int64_t g = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; g < n; g += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = g / per_row;
    const int c = (int)(g - r * per_row) * 8;
    const float4 a = *reinterpret_cast<const float4*>(acc + r * acc_row + c);
    const float4 b = *reinterpret_cast<const float4*>(acc + r * acc_row + c + 4);
    Out* dst = out + (r / T) * out_batch + (r % T) * out_row + c;
    if constexpr (sizeof(Out) == 4) {
      // fp32 dQ: the accumulator IS the output (acc == out, same offsets: no __restrict__), scaled
      // in place.
      *reinterpret_cast<float4*>(dst) = make_float4(a.x * scale, a.y * scale, a.z * scale, a.w * scale);
      *reinterpret_cast<float4*>(dst + 4) = make_float4(b.x * scale, b.y * scale, b.z * scale, b.w * scale);
    } else {
      uint4 w;
      w.x = pack_out2<Out>(a.x * scale, a.y * scale);
      w.y = pack_out2<Out>(a.z * scale, a.w * scale);
      w.z = pack_out2<Out>(b.x * scale, b.y * scale);
      w.w = pack_out2<Out>(b.z * scale, b.w * scale);
      *reinterpret_cast<uint4*>(dst) = w;
    }
  }
}

}  // namespace jax_fa4::sm90
