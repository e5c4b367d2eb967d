// Launchers of the preparation kernels (mx_prep.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include "cuda/launch.h"
#include "cuda/mx_prep.cuh"

namespace jax_fa4::cuda {

namespace {
constexpr int kThreadsPerBlock = 256;
inline unsigned blocks_for(int64_t n) { return (unsigned)((n + kThreadsPerBlock - 1) / kThreadsPerBlock); }
}  // namespace

template <typename T>
static cudaError_t quantize_mx_typed(const T* x, uint8_t* data, uint8_t* scale, int64_t outer, int L, int inner,
                                     cudaStream_t stream) {
  constexpr int kPer = 16 / (int)sizeof(T);
  const auto aligned = [](const void* p, unsigned a) { return reinterpret_cast<uintptr_t>(p) % a == 0; };
  // The coalesced column kernel (the V path) wherever a 16-byte chunk of columns is whole and the
  // pointers allow its vector accesses; the rows kernel for whole contiguous blocks (inner == 1);
  // the one-thread-per-block kernel for the rest.
  if (inner % kPer == 0 && aligned(x, 16) && aligned(data, kPer) && aligned(scale, kPer)) {
    const int64_t ctiles = (inner + prep::kQChunks * kPer - 1) / (prep::kQChunks * kPer);
    const int64_t tasks = outer * ((L + 31) / 32) * ctiles;  // one warp each
    const int64_t blocks = (tasks + prep::kQThreads / 32 - 1) / (prep::kQThreads / 32);
    if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
    prep::quantize_mx_cols_kernel<T><<<(unsigned)blocks, prep::kQThreads, 0, stream>>>(x, data, scale, outer, L,
                                                                                         inner, tasks);
    return cudaGetLastError();
  }
  // The last-axis case with whole blocks: 4 lanes per block, contiguous warp accesses.
  if (inner == 1 && L % 32 == 0 && aligned(x, 16) && aligned(data, 8)) {
    const int64_t groups = outer * (int64_t)L / 8;
    const int64_t per_cta = (int64_t)prep::kQThreads * prep::kQRowIter;
    const int64_t blocks = (groups + per_cta - 1) / per_cta;
    if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
    prep::quantize_mx_rows_kernel<T><<<(unsigned)blocks, prep::kQThreads, 0, stream>>>(x, data, scale, groups);
    return cudaGetLastError();
  }
  const int64_t total = outer * ((L + 31) / 32) * (int64_t)inner;
  if (blocks_for(total) > 0x7fffffffu) return cudaErrorInvalidValue;
  prep::quantize_mx_kernel<T><<<blocks_for(total), kThreadsPerBlock, 0, stream>>>(x, data, scale, outer, L, inner);
  return cudaGetLastError();
}

cudaError_t launch_quantize_mx(const void* x, FloatType type, uint8_t* data, uint8_t* scale, int64_t outer, int L,
                               int inner, cudaStream_t stream) {
  if (outer * ((L + 31) / 32) * (int64_t)inner == 0) return cudaSuccess;
  switch (type) {
    case FloatType::kF32:
      return quantize_mx_typed(static_cast<const float*>(x), data, scale, outer, L, inner, stream);
    case FloatType::kBF16:
      return quantize_mx_typed(static_cast<const __nv_bfloat16*>(x), data, scale, outer, L, inner, stream);
    case FloatType::kF16:
      return quantize_mx_typed(static_cast<const __half*>(x), data, scale, outer, L, inner, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

template <int HD>
static cudaError_t prep_rows_hd(const void* x, int float_type, const uint8_t* xs, uint8_t* out, float* rs, int B,
                                int L, int NH, int L_pad, cudaStream_t stream) {
  const int64_t total = (int64_t)B * L_pad * NH * (HD / 32);
  if (total == 0) return cudaSuccess;
  const unsigned grid = blocks_for(total);
  switch (float_type) {
    case -1:
      prep::prep_rows_kernel<HD, uint8_t, false><<<grid, kThreadsPerBlock, 0, stream>>>(
          static_cast<const uint8_t*>(x), xs, out, rs, B, L, NH, L_pad);
      break;
    case (int)FloatType::kF32:
      prep::prep_rows_kernel<HD, float, true><<<grid, kThreadsPerBlock, 0, stream>>>(
          static_cast<const float*>(x), nullptr, out, rs, B, L, NH, L_pad);
      break;
    case (int)FloatType::kBF16:
      prep::prep_rows_kernel<HD, __nv_bfloat16, true><<<grid, kThreadsPerBlock, 0, stream>>>(
          static_cast<const __nv_bfloat16*>(x), nullptr, out, rs, B, L, NH, L_pad);
      break;
    case (int)FloatType::kF16:
      prep::prep_rows_kernel<HD, __half, true><<<grid, kThreadsPerBlock, 0, stream>>>(
          static_cast<const __half*>(x), nullptr, out, rs, B, L, NH, L_pad);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t launch_prep_rows(const void* x, int float_type, const uint8_t* xs, uint8_t* out, float* rs, int B, int L,
                             int NH, int HD, int L_pad, cudaStream_t stream) {
  switch (HD) {
    case 64: return prep_rows_hd<64>(x, float_type, xs, out, rs, B, L, NH, L_pad, stream);
    case 128: return prep_rows_hd<128>(x, float_type, xs, out, rs, B, L, NH, L_pad, stream);
    case 256: return prep_rows_hd<256>(x, float_type, xs, out, rs, B, L, NH, L_pad, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_prep_v(const uint8_t* v, const uint8_t* vscale, const int32_t* kv_len, uint8_t* vt, float* vs,
                          int B, int S, int Kh, int HD, int S_pad, cudaStream_t stream) {
  if (HD % prep::kVtCols != 0 || S_pad % prep::kVtKeys != 0) return cudaErrorInvalidValue;
  if (B == 0 || Kh == 0) return cudaSuccess;
  const dim3 g1(Kh, B);
  switch (HD) {
    case 64: prep::prep_v_colscale_kernel<64><<<g1, prep::kColThreads, 0, stream>>>(vscale, kv_len, vs, S, Kh); break;
    case 128: prep::prep_v_colscale_kernel<128><<<g1, prep::kColThreads, 0, stream>>>(vscale, kv_len, vs, S, Kh); break;
    case 256: prep::prep_v_colscale_kernel<256><<<g1, prep::kColThreads, 0, stream>>>(vscale, kv_len, vs, S, Kh); break;
    default: return cudaErrorInvalidValue;
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  if (S_pad == 0) return cudaSuccess;
  dim3 g2(S_pad / prep::kVtKeys, (HD / prep::kVtCols) * Kh, B);
  prep::prep_v_transpose_kernel<<<g2, prep::kVtThreads, 0, stream>>>(v, vscale, vs, kv_len, vt, S, Kh, HD, S_pad);
  return cudaGetLastError();
}

cudaError_t launch_exact_rows(const void* x, int float_type, const uint8_t* xs, void* out, int64_t n,
                              cudaStream_t stream) {
  if (n % 32 != 0) return cudaErrorInvalidValue;  // whole blocks along the last axis
  const int64_t groups = n / prep::kExactPer;
  if (groups == 0) return cudaSuccess;
  if (blocks_for(groups) > 0x7fffffffu) return cudaErrorInvalidValue;
  uint4* o = static_cast<uint4*>(out);
  switch (float_type) {
    case -1:
      prep::exact_rows_kernel<uint8_t, false><<<blocks_for(groups), kThreadsPerBlock, 0, stream>>>(
          static_cast<const uint8_t*>(x), xs, o, groups);
      break;
    case (int)FloatType::kF32:
      prep::exact_rows_kernel<float, true><<<blocks_for(groups), kThreadsPerBlock, 0, stream>>>(
          static_cast<const float*>(x), nullptr, o, groups);
      break;
    case (int)FloatType::kBF16:
      prep::exact_rows_kernel<__nv_bfloat16, true><<<blocks_for(groups), kThreadsPerBlock, 0, stream>>>(
          static_cast<const __nv_bfloat16*>(x), nullptr, o, groups);
      break;
    case (int)FloatType::kF16:
      prep::exact_rows_kernel<__half, true><<<blocks_for(groups), kThreadsPerBlock, 0, stream>>>(
          static_cast<const __half*>(x), nullptr, o, groups);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace jax_fa4::cuda
