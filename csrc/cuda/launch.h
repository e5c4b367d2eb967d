// Host-side entry points of the CUDA kernels (no XLA types): each fills the kernel parameters,
// picks the tile configuration, launches on `stream` and returns the launch's cudaError_t.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace jax_fa4::cuda {

enum class FloatType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// x viewed as [outer, L, inner], blocks of 32 along L. data: same shape (e4m3 bytes);
// scale: [outer, ceil(L/32), inner] (e8m0 bytes).
cudaError_t launch_quantize_mx(const void* x, FloatType type, uint8_t* data, uint8_t* scale, int64_t outer, int L,
                               int inner, cudaStream_t stream);

// Q/K row requantisation. x: [B, L, NH, HD] e4m3 (+ xs [B, L, NH, HD/32] e8m0) or floats
// (float_type >= 0, xs == nullptr). out: [B, L, NH, HD] e4m3; rs: [B, NH, L_pad] fp32.
cudaError_t launch_prep_rows(const void* x, int float_type /* -1: MX input */, const uint8_t* xs, uint8_t* out,
                             float* rs, int B, int L, int NH, int HD, int L_pad, cudaStream_t stream);

// V: [B, S, Kh, HD] e4m3 + vscale [B, ceil(S/32), Kh, HD] -> vt [B, Kh, HD, S_pad], vs [B, Kh, HD].
cudaError_t launch_prep_v(const uint8_t* v, const uint8_t* vscale, const int32_t* kv_len, uint8_t* vt, float* vs,
                          int B, int S, int Kh, int HD, int S_pad, cudaStream_t stream);

// The exact-score Q/K operand: x [n] blocked along its last axis (n and that axis multiples of 32),
// e4m3 with block scales xs [n/32] (float_type -1) or floats -> out [n] bf16, the dequantized MX
// values (bit for bit mx.quantize(x).dequantize(bfloat16)).
cudaError_t launch_exact_rows(const void* x, int float_type, const uint8_t* xs, void* out, int64_t n,
                              cudaStream_t stream);

struct FwdArgs {
  int B, T, S, N, Kh, H, S_pad;
  bool exact_scores;     // q8/k8 hold bf16 dequantized MX values (Q K^T on bf16 wgmma); qs, ks unused
  const uint8_t* q8;     // [B, T, N, H] e4m3, or bf16 when exact_scores
  const float* qs;       // [B, N, T] (FP8 scores only)
  const uint8_t* k8;     // [B, S, Kh, H] e4m3, or bf16 when exact_scores
  const float* ks;       // [B, Kh, S_pad] (FP8 scores only)
  const uint8_t* vt;     // [B, Kh, H, S_pad]
  const float* vs;       // [B, Kh, H]
  const int32_t* q_len;  // [B]
  const int32_t* kv_len; // [B]
  void* o;               // [B, T, N, H]
  FloatType out_type;
  float* lse;            // [B, T, N]
  float scale;
  bool causal;
  int64_t window_left, window_right;  // -1: unbounded
};
// Returns cudaErrorInvalidValue for shapes the kernel does not serve (checked in Python first).
cudaError_t launch_fwd_sm90(const FwdArgs& a, cudaStream_t stream);

struct BwdArgs {
  int B, T, S, N, Kh, H, T_pad;
  const void* q;         // [B, T, N, H] bf16, the exact values of q blocked along H
  const uint8_t* k8;     // [B, S, Kh, H] e4m3, k blocked along H (16-byte aligned); the kernel
  const uint8_t* ks;     // [B, S, Kh, H / 32] E8M0 bytes   dequantizes K and V into shared memory
  const uint8_t* v8;     // [B, S, Kh, H] e4m3, v blocked along H (16-byte aligned)
  const uint8_t* vs;     // [B, S, Kh, H / 32] E8M0 bytes
  const void* dout;      // [B, T, N, H] bf16 (dO blocked along H)
  const float* lse2;     // [B, N, T_pad] lse * log2(e), +inf for rows without keys and padding
  const float* delta;    // [B, N, T_pad] rowsum(O * dO), 0 past T
  const int32_t* q_len;  // [B]
  const int32_t* kv_len; // [B]
  void* dq;              // [B, T, N, H] in dq_type: dS K * scale (may alias q: each dQ chunk is
                         // written after the only CTAs that read its slice of q are done)
  FloatType dq_type;
  float* dq_acc;         // fp32 accumulator of one dQ chunk, [chunk_b, T, chunk_kh * N / Kh, H];
                         // == dq (all of it, one chunk) when dq_type is fp32
  int chunk_b, chunk_kh; // batches and kv heads per dQ chunk (one launch of the kernel each)
  void* dk;              // [B, S, Kh, H] in dkv_type
  void* dv;              // [B, S, Kh, H] in dkv_type
  FloatType dkv_type;    // fp32, bf16 or fp16: dK and dV leave the kernel in the gradients' dtype
  int32_t* sem;          // [B, N, bwd_column_chunks(H), ceil(T / 64)] scratch of the deterministic
                         // dQ order, zeroed here
  float scale;
  bool causal, deterministic;
  int64_t window_left, window_right;  // -1: unbounded
};
// Per dQ chunk (chunk_b batches x chunk_kh kv heads): zeroes the accumulator, launches one CTA per
// (128-key tile, kv head x column chunk, batch) of the chunk, then writes dQ * scale into the
// chunk's slice of dq. Zeroes sem once.
cudaError_t launch_bwd_sm90(const BwdArgs& a, cudaStream_t stream);
// The query tile of the backward: lse2 / delta rows are padded to a multiple of it.
constexpr int kBwdBlockM = 64;
// Column chunks of the backward (CTAs per key tile along H): one CTA accumulates at most 128
// columns of dK / dV (tile_config.cuh BwdTileConfig::kChunks).
constexpr int bwd_column_chunks(int H) { return H > 128 ? H / 128 : 1; }

// The smem padding unit of V^T and of the key scales (tile_config.cuh kSeqPad).
constexpr int kSeqPad = 128;

}  // namespace jax_fa4::cuda
