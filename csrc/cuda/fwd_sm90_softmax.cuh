// Online softmax of one consumer thread's two score rows (rows gid and gid+8 of its warp's 16).
//
// Units: the wgmma gives acc = q8 . k8; x = acc * k_scale[j] is the score up to the per-row
// factor rf = q_scale[i] * softmax_scale * log2(e) (> 0). The running max m is kept in x units,
// so one FFMA per element gives  x*rf - m*rf = log2(P), and exp2 of it times 256 is P*256, the
// recipe's fixed P scale, ready for the e4m3 conversion. l accumulates these unquantised
// values (l = 256 * sum P); the epilogue divides by it, which also removes the 256.
//
// l's precision: the lse of a flat row (every P ~ 1) is a log of its sum alone, so the sum's
// rounding is the lse error, and the contract then asks for the recipe's fp32-floor accuracy.
// A tile's 32 values per thread row are summed as a tree (8 partials, same op count as a chain),
// and l is carried across tiles and the quad in fp64 (2 DFMA per row per tile: noise next to
// the 64 elements' work). Seen on an H200 with an fp32 chain: lse error 3.8e-8 vs the recipe's
// 2.1e-8 on flat rows. (Skipping rescales while the max grows little, FA4's trick, was tried
// and dropped: with a stale max the dominant P of a peaked row no longer lands on 256, an exact
// e4m3 value, and O's error on token outliers rose 1.3x past the bound.)
#pragma once
#include <cmath>
#include "cuda/mask.cuh"
#include "cuda/sm90_ptx.cuh"

namespace jax_fa4::sm90 {

// FP8 scores: x = acc * k_scale[key] for this thread's keys (accumulator layout of RowSoftmax).
template <int BN>
__device__ __forceinline__ void scale_by_keys(float* s, const float* key_scales, int tq) {
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const float2 kv = *reinterpret_cast<const float2*>(key_scales + j * 8 + tq * 2);
    s[j * 4 + 0] *= kv.x;
    s[j * 4 + 1] *= kv.y;
    s[j * 4 + 2] *= kv.x;
    s[j * 4 + 3] *= kv.y;
  }
}

// -inf for this thread's scores of key tile n that the mask removes (boundary tiles only).
template <int BN>
__device__ __forceinline__ void mask_tile(float* s, const int* rows, int n, int kv_len, MaskParams mk, int tq) {
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = n * BN + j * 8 + tq * 2 + (e & 1);
      if (!key_allowed(rows[e >> 1], key, kv_len, mk)) s[j * 4 + e] = -INFINITY;
    }
  }
}

template <int BN>
struct RowSoftmax {
  // Accumulator layout (wgmma m64nBN, fp32): s[j*4 + e] is row gid, column j*8 + tq*2 + e;
  // s[j*4 + 2 + e] is row gid + 8 (j < BN/8, e < 2).
  static constexpr int kRegs = BN / 2;
  float m[2];   // running max in x units (-inf until a finite score arrives)
  double l[2];  // per-thread partial of 256 * sum P (the quad's 4 partials are added at the end)
  float rf[2];
#ifdef JAX_FA4_FWD_TRACE
  unsigned long long* tr = nullptr;  // measurement builds: clock64() after the max, after the sums
#endif

  __device__ __forceinline__ void init(float rf0, float rf1) {
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.0;
    rf[0] = rf0;
    rf[1] = rf1;
  }

  // Updates m and l from the tile s (in place: s becomes P*256), returns the O rescale factors.
  // kDiagNoExp (timing diagnostics only, wrong results): the exp2 argument stands in for P, so the
  // loop runs without its MUFU work. kFold8 (measurement only): the 256 folded into the exp2 argument
  // as "+ 8" instead of one FMUL per element (see below for why the default does not).
  template <bool kDiagNoExp = false, bool kFold8 = false>
  __device__ __forceinline__ void step(float* s, float& alpha0, float& alpha1) {
    // Row max over 4 interleaved partial maxima, then a tree (BN/32 + 3 dependent steps instead of a
    // BN/8-long chain: the softmax of a tile is latency-bound, measured on an H100). A full tree of
    // BN/8 leaves made ptxas spill. max is exact in any order.
    float mx[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float v[4];
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        const float pr = fmaxf(s[j * 4 + 2 * r], s[j * 4 + 2 * r + 1]);
        v[j % 4] = j < 4 ? pr : fmaxf(v[j % 4], pr);
      }
      mx[r] = fmaxf(m[r], fmaxf(fmaxf(v[0], v[1]), fmaxf(v[2], v[3])));
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    }
    float bias[2], alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (mx[r] == -INFINITY) {
        // Everything so far is masked: P = exp2(-inf) = 0, nothing to rescale.
        alpha[r] = 1.f;
        bias[r] = 0.f;
      } else {
        // m[r] = -inf gives exp2(-inf) = 0: O and l are still zero then, any factor is fine.
        alpha[r] = exp2_approx((m[r] - mx[r]) * rf[r]);
        bias[r] = kFold8 ? fmaf(-mx[r], rf[r], 8.f) : -mx[r] * rf[r];
      }
      m[r] = mx[r];
    }
#ifdef JAX_FA4_FWD_TRACE
    if (tr) tr[0] = clock64();
#endif
    constexpr int kPart = (BN / 8 >= 8) ? 8 : BN / 8;  // tree partials per row
    static_assert((BN / 8) % kPart == 0, "tile columns must split evenly over the partial sums");
    float part[2][kPart];
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        // exp2 of x*rf - m*rf, then * 256 (exact). Folding the 256 into the exponent as "+ 8"
        // would round the argument at ulp(8) = 2^-20: P off by up to 3e-7 near the row max,
        // which was the lse error of short flat rows on an H200 (4.2e-8 vs the recipe's 3.4e-8).
        const float x = fmaf(s[j * 4 + e], rf[r], bias[r]);
        float p = kDiagNoExp ? x : kFold8 ? exp2_approx(x) : exp2_approx(x) * 256.f;
        s[j * 4 + e] = p;
        if (j < kPart && (e & 1) == 0) part[r][j] = p;
        else part[r][j % kPart] += p;
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int w = kPart / 2; w >= 1; w /= 2)
#pragma unroll
        for (int i = 0; i < w; ++i) part[r][i] += part[r][i + w];
      l[r] = fma(l[r], (double)alpha[r], (double)part[r][0]);
    }
#ifdef JAX_FA4_FWD_TRACE
    if (tr) tr[1] = clock64();
#endif
    alpha0 = alpha[0];
    alpha1 = alpha[1];
  }

  // Adds the quad's partial sums (the 4 threads that share a row).
  __device__ __forceinline__ void finish() {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);  // (the fp64 overload: two 32-bit shuffles)
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
  }
};

// Packs the P*256 tile into the A-operand registers of the PV wgmma (m64 k32 per instruction).
// The A fragment wants, for k-step kk, row gid: columns tq*4 + {0..3} and 16 + tq*4 + {0..3}
// (row gid+8 likewise). The accumulator gives this thread keys tq*2 + {0,1} and 8 + tq*2 + {0,1}
// of each 16-key half instead. Rather than shuffling bytes between threads, the V^T operand is
// stored with its keys permuted inside every 16-key group (see mx_prep.cuh, vt_pos_of_key), so
// A column c of a 16-group IS key (c/4)*2 + (c&1) + ((c>>1)&1)*8, the key this thread holds.
template <int BN>
__device__ __forceinline__ void pack_p(const float* s, uint32_t (*pa)[4]) {
#pragma unroll
  for (int kk = 0; kk < BN / 32; ++kk) {
    const float* c0 = s + (4 * kk + 0) * 4;
    const float* c1 = s + (4 * kk + 1) * 4;
    const float* c2 = s + (4 * kk + 2) * 4;
    const float* c3 = s + (4 * kk + 3) * 4;
    pa[kk][0] = pack_e4m3x4(c0[0], c0[1], c1[0], c1[1]);  // row gid,   A cols tq*4 + 0..3
    pa[kk][1] = pack_e4m3x4(c0[2], c0[3], c1[2], c1[3]);  // row gid+8, A cols tq*4 + 0..3
    pa[kk][2] = pack_e4m3x4(c2[0], c2[1], c3[0], c3[1]);  // row gid,   A cols 16 + tq*4 + 0..3
    pa[kk][3] = pack_e4m3x4(c2[2], c2[3], c3[2], c3[3]);  // row gid+8, A cols 16 + tq*4 + 0..3
  }
}

}  // namespace jax_fa4::sm90
