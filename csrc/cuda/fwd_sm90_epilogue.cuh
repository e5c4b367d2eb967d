// Epilogue of one consumer thread: O = acc * v_scale[d] / l, lse = ln(2) * m*rf + ln(l / 256).
// Rows past q_len and fully masked rows (l == 0) give O = 0 and lse = -inf, never NaN.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include "cuda/fwd_sm90_params.cuh"

namespace jax_fa4::sm90 {

template <int H>
__device__ __forceinline__ void store_o_pair(const FwdParams& p, int64_t off, float a, float b) {
  if (p.out_dtype == OutDtype::kBF16) {
    *reinterpret_cast<__nv_bfloat162*>(reinterpret_cast<__nv_bfloat16*>(p.o) + off) = __floats2bfloat162_rn(a, b);
  } else if (p.out_dtype == OutDtype::kF16) {
    *reinterpret_cast<__half2*>(reinterpret_cast<__half*>(p.o) + off) = __floats2half2_rn(a, b);
  } else {
    *reinterpret_cast<float2*>(reinterpret_cast<float*>(p.o) + off) = make_float2(a, b);
  }
}

// o: the thread's accumulator (layout of RowSoftmax); rows: the two global query rows.
template <int H, int BN>
__device__ __forceinline__ void epilogue(const FwdParams& p, const float* o, const float* m, const double* l,
                                         const float* rf, const int* rows, int b, int n, int kh, int q_len,
                                         int tq) {
  const float* vs = p.vs + ((int64_t)b * p.Kh + kh) * H;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int t = rows[r];
    if (t >= p.T) continue;
    // `!(l == 0)` rather than `l > 0`: a NaN row sum (NaN input) must give NaN output, not zeros.
    const bool live = (t < q_len) && !(l[r] == 0.f);
    const float inv = live ? (float)(1.0 / l[r]) : 0.f;
    const int64_t row_off = (((int64_t)b * p.T + t) * p.N + n);
#pragma unroll
    for (int j = 0; j < H / 8; ++j) {
      const int d = j * 8 + tq * 2;
      const float2 sv = *reinterpret_cast<const float2*>(vs + d);
      float a = live ? o[j * 4 + 2 * r + 0] * (sv.x * inv) : 0.f;
      float c = live ? o[j * 4 + 2 * r + 1] * (sv.y * inv) : 0.f;
      store_o_pair<H>(p, row_off * H + d, a, c);
    }
    if (tq == 0) {
      // In fp64, rounded once: m*rf*ln2 + ln(l/256). (An fp32 ln2*(m*rf - 8 + log2 l) rounds at
      // the ulp of log2(256 * sum P), several times coarser than the result's.) Once per row.
      p.lse[row_off] = live ? (float)fma((double)(m[r] * rf[r]), 0.6931471805599453, log(l[r] * 0.00390625))
                            : -INFINITY;
    }
  }
}

}  // namespace jax_fa4::sm90
