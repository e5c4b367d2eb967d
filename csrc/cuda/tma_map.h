// Host helpers shared by the sm_90a launchers: TMA tensor maps over byte-addressed data, and the
// shared-memory opt-in.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <mutex>

namespace jax_fa4::cuda {

// cuTensorMapEncodeTiled through the runtime's driver entry point, so the module needs no link
// against libcuda (the wheel then loads wherever the driver is).
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
inline EncodeTiledFn encode_tiled() {
  static EncodeTiledFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      p = nullptr;
    return reinterpret_cast<EncodeTiledFn>(p);
  }();
  return fn;
}

// 4-D tiled tensor map, uint8 (e4m3 or bytes of wider data) unless `dtype` says otherwise; dims and
// box in elements, innermost first; strides in bytes.
inline cudaError_t make_map(CUtensorMap* map, const void* base, const cuuint64_t dims[4], const cuuint64_t strides[3],
                     const cuuint32_t box[4], CUtensorMapSwizzle swizzle,
                     CUtensorMapDataType dtype = CU_TENSOR_MAP_DATA_TYPE_UINT8) {
  const cuuint32_t estr[4] = {1, 1, 1, 1};
  EncodeTiledFn enc = encode_tiled();
  if (enc == nullptr) return cudaErrorSymbolNotFound;
  CUresult r = enc(map, dtype, 4, const_cast<void*>(base), dims, strides,
                                      box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

inline constexpr CUtensorMapSwizzle swizzle_of(int bytes) {
  return bytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
}

// The dynamic shared-memory opt-in of `kernel` is a per-device function attribute: set it once per
// device. The kernel is a template argument so that each kernel has its own once-flags (kernels of
// one signature share a function-pointer type: keyed on the type, H = 64's kernel would be skipped
// after H = 128's was set).
template <auto kKernel>
cudaError_t set_max_smem_once(int bytes) {
  constexpr int kMaxDevices = 64;
  static std::once_flag once[kMaxDevices];
  static cudaError_t errs[kMaxDevices];
  int dev = 0;
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  if (dev < 0 || dev >= kMaxDevices) return cudaErrorInvalidDevice;
  std::call_once(once[dev], [&] { errs[dev] = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes); });
  return errs[dev];
}

}  // namespace jax_fa4::cuda
