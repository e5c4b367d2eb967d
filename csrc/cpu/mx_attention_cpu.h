// MXFP8 attention on the CPU: the forward and backward recipes of NUMERICS.md sections 2-3.
//
// Pure C++17 (no XLA or nanobind types). The FFI handlers in ffi_cpu.cc validate shapes and
// dtypes and then call mx_attention_forward / mx_attention_backward with raw pointers.
//
// Layouts (row-major, "Bt" = the flattened batch, every leading dim before the last three):
//   q, q_scale          [Bt, T, N, H] e4m3, [Bt, T, N, H/32] e8m0 bytes   (blocked along H)
//   q_t, q_t_scale      [Bt, T, N, H],      [Bt, ceil(T/32), N, H]         (blocked along T)
//   k, k_scale          [Bt, S, K, H],      [Bt, S, K, H/32]               (blocked along H)
//   k_s, k_s_scale      [Bt, S, K, H],      [Bt, ceil(S/32), K, H]         (blocked along S)
//   v, v_scale (fwd)    [Bt, S, K, H],      [Bt, ceil(S/32), K, H]         (blocked along S)
//   v_h, v_h_scale      [Bt, S, K, H],      [Bt, S, K, H/32]               (blocked along H)
//   do_h / do_t         as q / q_t
//   o, dq               [Bt, T, N, H] f32;  lse, delta [Bt, T, N] f32;  dk, dv [Bt, S, K, H] f32
//   q_seqlen, kv_seqlen [Bt] int32 (clamped to [0, T] / [0, S])
// Query head n reads kv head n / (N / K).
#ifndef JAX_FA4_CSRC_CPU_MX_ATTENTION_CPU_H_
#define JAX_FA4_CSRC_CPU_MX_ATTENTION_CPU_H_

#include <cstddef>
#include <cstdint>
#include <functional>

namespace jax_fa4 {
namespace cpu {

// ---- MX format helpers (NUMERICS.md section 1) ----

// e4m3fn byte -> float (exact; 0x7F / 0xFF are NaN).
float e4m3_to_f32(uint8_t b);
// float -> e4m3fn byte, round-to-nearest-even, saturating to +-448; NaN -> 0x7F (sign kept).
// Bit-exact with ml_dtypes' float8_e4m3fn cast of x clamped to [-448, 448].
uint8_t f32_to_e4m3(float x);
// The e8m0 scale byte of a block with absolute maximum `amax` (TransformerEngine rule:
// v = amax * fp32(1/448), biased exponent of v, +1 if its mantissa is non-zero, clamp 254; NaN
// -> 255).
uint8_t e8m0_from_amax(float amax);
// 2^(b - 127) (NaN for 255). b = 0 gives the subnormal 2^-127.
float e8m0_to_f32(uint8_t b);

// Quantizes `rows` x `cols` fp32 values (row-major, leading dim `ld`) to MX in blocks of 32
// consecutive elements along a row (cols a multiple of 32) and writes the DEQUANTIZED values
// (exactly what a consumer of the MX tensor sees) to `out` (same layout). The kernel that dS
// goes through; exposed for tests.
void mx_quantize_dequantize_rows(const float* x, int64_t rows, int64_t cols, int64_t ld,
                                 float* out);
// The same with blocks of 32 consecutive rows (rows a multiple of 32), per column.
void mx_quantize_dequantize_cols(const float* x, int64_t rows, int64_t cols, int64_t ld,
                                 float* out);
// e4m3(x) as a float (RNE, saturating at +-448), the vectorized path used for P: exposed for
// tests.
void round_to_e4m3(const float* x, int64_t n, float* out);

// ---- attention ----

struct MaskSpec {
  bool is_causal = false;
  int64_t window_left = -1;   // -1 = unbounded
  int64_t window_right = -1;  // -1 = unbounded
};

struct Dims {
  int64_t batch = 0;  // flattened leading dims
  int64_t T = 0, S = 0, N = 0, K = 0, H = 0;
};

struct ForwardArgs {
  Dims d;
  const uint8_t *q, *q_scale, *k, *k_scale, *v, *v_scale;
  const int32_t *q_seqlen, *kv_seqlen;
  float scale;
  MaskSpec mask;
  float* o;
  float* lse;
};

struct BackwardArgs {
  Dims d;
  const uint8_t *q_h, *q_h_scale, *q_t, *q_t_scale;
  const uint8_t *k_h, *k_h_scale, *k_s, *k_s_scale;
  const uint8_t *v_h, *v_h_scale;
  const uint8_t *do_h, *do_h_scale, *do_t, *do_t_scale;
  const float *lse, *delta;
  const int32_t *q_seqlen, *kv_seqlen;
  float scale;
  MaskSpec mask;
  float *dq, *dk, *dv;
};

// The kernels assume validated arguments (H % 32 == 0, 32 <= H <= 256, N % K == 0, K >= 1).
// Every output element is written. They return false only if scratch memory could not be
// allocated (the outputs are then unspecified).
bool mx_attention_forward(const ForwardArgs& a);
bool mx_attention_backward(const BackwardArgs& a);

// ---- work partitioning ----

// Runs fn(i) for i in [0, n) on the static pool (hardware_concurrency threads in all, the
// caller included; JAX_FA4_CPU_THREADS overrides), returning when every item is done. Items are
// handed out dynamically in increasing order. Safe to call from several threads at once.
// fp32 subnormals are flushed (FTZ/DAZ) while items run, as in XLA's CPU runtime. Returns false
// if an item threw (e.g. bad_alloc).
bool parallel_for(int64_t n, const std::function<void(int64_t)>& fn);
int num_threads();

}  // namespace cpu
}  // namespace jax_fa4

#endif  // JAX_FA4_CSRC_CPU_MX_ATTENTION_CPU_H_
