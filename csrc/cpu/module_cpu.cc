// nanobind module _jax_fa4_cpu: the FFI handler capsules of the CPU kernels, plus a few
// byte-level hooks into the MX helpers for tests.
#include <nanobind/nanobind.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu/mx_attention_cpu.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/api.h"

namespace nb = nanobind;

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFa4MxFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFa4MxBwdCpu);

namespace {

template <typename T>
nb::capsule encapsulate(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

std::vector<float> floats_of(const nb::bytes& b) {
  if (b.size() % 4 != 0) throw nb::value_error("expected a float32 buffer (size % 4 == 0)");
  std::vector<float> x(b.size() / 4);
  if (!x.empty()) std::memcpy(x.data(), b.c_str(), b.size());
  return x;
}

nb::bytes bytes_of(const void* p, size_t n) { return nb::bytes(static_cast<const char*>(p), n); }

}  // namespace

NB_MODULE(_jax_fa4_cpu, m) {
  m.doc() = "jax_fa4 CPU kernels (XLA FFI, platform 'cpu')";

  m.def("registrations", []() {
    nb::dict d;
    d["jax_fa4_mx_fwd"] = encapsulate(JaxFa4MxFwdCpu);
    d["jax_fa4_mx_bwd"] = encapsulate(JaxFa4MxBwdCpu);
    return d;
  }, "{target_name: capsule} of every FFI handler, for jax.ffi.register_ffi_target(platform='cpu').");

  m.def("num_threads", []() { return jax_fa4::cpu::num_threads(); },
        "Threads the kernels run on (the caller included).");

  // ---- test hooks (raw little-endian bytes in and out) ----
  m.def("_f32_to_e4m3", [](nb::bytes b) {
    std::vector<float> x = floats_of(b);
    std::vector<uint8_t> out(x.size());
    for (size_t i = 0; i < x.size(); ++i) out[i] = jax_fa4::cpu::f32_to_e4m3(x[i]);
    return bytes_of(out.data(), out.size());
  }, "float32 bytes -> e4m3 bytes (scalar helper, RNE, saturating).");

  m.def("_e4m3_to_f32", [](nb::bytes b) {
    std::vector<float> out(b.size());
    const uint8_t* p = reinterpret_cast<const uint8_t*>(b.c_str());
    for (size_t i = 0; i < out.size(); ++i) out[i] = jax_fa4::cpu::e4m3_to_f32(p[i]);
    return bytes_of(out.data(), out.size() * 4);
  }, "e4m3 bytes -> float32 bytes.");

  m.def("_round_e4m3", [](nb::bytes b) {
    std::vector<float> x = floats_of(b), out(x.size());
    jax_fa4::cpu::round_to_e4m3(x.data(), static_cast<int64_t>(x.size()), out.data());
    return bytes_of(out.data(), out.size() * 4);
  }, "float32 bytes -> e4m3-rounded float32 bytes (the kernels' vectorized path).");

  m.def("_e8m0_from_amax", [](nb::bytes b) {
    std::vector<float> x = floats_of(b);
    std::vector<uint8_t> out(x.size());
    for (size_t i = 0; i < x.size(); ++i) out[i] = jax_fa4::cpu::e8m0_from_amax(x[i]);
    return bytes_of(out.data(), out.size());
  }, "float32 block maxima bytes -> e8m0 scale bytes.");

  m.def("_mx_qdq", [](nb::bytes b, int64_t rows, int64_t cols, bool along_rows) {
    std::vector<float> x = floats_of(b);
    if (rows < 0 || cols < 0 || static_cast<int64_t>(x.size()) != rows * cols)
      throw nb::value_error("size must be rows * cols");
    if ((along_rows ? cols : rows) % 32 != 0)
      throw nb::value_error("the block axis must be a multiple of 32");
    if (cols % 8 != 0) throw nb::value_error("cols must be a multiple of 8");
    std::vector<float> out(x.size());
    if (along_rows)
      jax_fa4::cpu::mx_quantize_dequantize_rows(x.data(), rows, cols, cols, out.data());
    else
      jax_fa4::cpu::mx_quantize_dequantize_cols(x.data(), rows, cols, cols, out.data());
    return bytes_of(out.data(), out.size() * 4);
  }, "MX quantize+dequantize of a [rows, cols] float32 matrix, blocks of 32 along each row "
     "(along_rows=True, the dS->dQ path) or down each column (the dS->dK path).");
}
