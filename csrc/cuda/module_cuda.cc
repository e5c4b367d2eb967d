// nanobind module `_jax_fa4_cuda`: hands the FFI handler symbols to Python as capsules, which
// jax_fa4/_cuda_ops.py registers with jax.ffi.register_ffi_target(..., platform="CUDA").
#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

extern "C" {
XLA_FFI_Error* JaxFa4CudaQuantize(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxFa4CudaPrepRowsMx(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxFa4CudaPrepRowsFloat(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxFa4CudaExactRowsMx(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxFa4CudaExactRowsFloat(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxFa4CudaPrepV(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxFa4CudaFwd(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxFa4CudaBwd(XLA_FFI_CallFrame*);
}

#ifdef JAX_FA4_FWD_TRACE
extern "C" int jax_fa4_fwd_trace(unsigned long long* host);  // fwd_sm90_launch.cu
#endif
#ifdef JAX_FA4_BWD_TRACE
extern "C" int jax_fa4_bwd_trace(unsigned long long* host);  // bwd_sm90_launch.cu
#endif

namespace {
template <typename F>
nb::capsule capsule(F* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

#if defined(JAX_FA4_FWD_TRACE) || defined(JAX_FA4_BWD_TRACE)
// Measurement builds only: the clock64 values of the last traced launch, flattened ([] if the copy
// failed); `read` copies the kernel's N-value trace buffer to the host.
template <size_t N>
nb::list trace_list(int (*read)(unsigned long long*)) {
  static unsigned long long buf[N];
  nb::list out;
  if (read(buf) != 0) return out;
  for (unsigned long long v : buf) out.append(v);
  return out;
}
#endif
}  // namespace

NB_MODULE(_jax_fa4_cuda, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["jax_fa4_cuda_quantize"] = capsule(JaxFa4CudaQuantize);
    d["jax_fa4_cuda_prep_rows_mx"] = capsule(JaxFa4CudaPrepRowsMx);
    d["jax_fa4_cuda_prep_rows_float"] = capsule(JaxFa4CudaPrepRowsFloat);
    d["jax_fa4_cuda_exact_rows_mx"] = capsule(JaxFa4CudaExactRowsMx);
    d["jax_fa4_cuda_exact_rows_float"] = capsule(JaxFa4CudaExactRowsFloat);
    d["jax_fa4_cuda_prep_v"] = capsule(JaxFa4CudaPrepV);
    d["jax_fa4_cuda_fwd"] = capsule(JaxFa4CudaFwd);
    d["jax_fa4_cuda_bwd"] = capsule(JaxFa4CudaBwd);
    return d;
  });
#ifdef JAX_FA4_FWD_TRACE
  // [consumer][tile][point] of the traced CTA (g_fwd_trace: up to 3 consumers).
  m.def("fwd_trace", []() { return trace_list<3 * 32 * 12>(jax_fa4_fwd_trace); });
#endif
#ifdef JAX_FA4_BWD_TRACE
  // [consumer][query tile][point] of the traced CTA (g_bwd_trace).
  m.def("bwd_trace", []() { return trace_list<2 * 32 * 16>(jax_fa4_bwd_trace); });
#endif
}
