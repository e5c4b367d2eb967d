// MXFP8 attention forward/backward on the CPU (NUMERICS.md sections 2-3). See the header for
// layouts.
//
// Structure of both passes:
//  1. A parallel pre-pass dequantizes every MX operand exactly to fp32, once, into layouts the
//     micro-kernels want: K (and V_h in the backward) transposed into packed panels of 16 keys
//     ([H][16] contiguous), so the QK^T inner loop vectorizes over keys; V, K_s, Q, dO row-major
//     so the PV-like products vectorize over H. (Dequantizing per tile inside the attention loop
//     would redo this work once per query tile; the fp32 copies are the size of fp32 K/V.)
//  2. A parallel pass over work items: (batch, head, 64-query tile) for the forward, (batch, kv
//     head, 64-key tile) for the backward, with a register-blocked 6x16 fp32 GEMM micro-kernel.
//     The forward caches the tile's fp32 scores for the whole key range (256 bytes per key per
//     thread), so the softmax uses each row's exact maximum: P8 = e4m3(256 exp(S - m)) is then
//     exactly the recipe's, rather than a rounding relative to a running maximum. (Online
//     rescaling is allowed by NUMERICS.md, but it re-rounds P8 differently from the recipe, and
//     on single long rows that alone moved rel_err by up to ~10%, past the contract's 1.05.)
//     l is accumulated in double and lse = m + log(l) rounded once.
// Tiles are multiples of 32 aligned at 0, so the backward's MX quantization of dS (blocks of 32
// keys / 32 queries of the full axes) is done tile-locally and exactly as the recipe.
// dQ, the one output several items add to, takes its key tiles' adds in key-tile order (a turn per
// block of 64 query rows), so the backward is bitwise reproducible run to run.
#include "cpu/mx_attention_cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <thread>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#define JFA_AVX2 1
#include <immintrin.h>
#else
#define JFA_AVX2 0
#endif
#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#define JFA_HAVE_MXCSR 1
#else
#define JFA_HAVE_MXCSR 0
#endif

namespace jax_fa4 {
namespace cpu {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kPScale = 256.0f;      // fixed scale of P (NUMERICS.md 2.4)
constexpr float kInvPScale = 1.0f / 256.0f;
constexpr float kE4M3Max = 448.0f;
constexpr float kInv448 = 1.0f / 448.0f;  // fp32(1/448), as the scale rule specifies
constexpr int64_t kBq = 64;  // query tile (multiple of 32: dS is quantized in 32-query blocks)
constexpr int64_t kBk = 64;  // key tile (multiple of 32: dS is quantized in 32-key blocks)
constexpr int64_t kNR = 16;  // micro-kernel width (two 8-float vectors)

inline uint32_t f2u(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float u2f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
inline int64_t ceil_div(int64_t x, int64_t m) { return (x + m - 1) / m; }

// 2^e as a normal float, e in [-126, 127].
inline float pow2i(int e) { return u2f(static_cast<uint32_t>(e + 127) << 23); }

// Two normal powers of two whose product is 2^e, e in [-127, 127]; the same split as
// jax_fa4/mx.py (e1 = floor(e / 2), e2 = e - e1) so dequantization is bit-exact with it.
inline void pow2_split(int e, float* f1, float* f2) {
  int e1 = (e >= 0) ? e / 2 : -((-e + 1) / 2);
  *f1 = pow2i(e1);
  *f2 = pow2i(e - e1);
}

// Dequantization factors of a scale byte: value = (elem * d1) * d2; NaN for 255.
inline void deq_factors(uint8_t byte, float* d1, float* d2) {
  if (byte == 255) {
    *d1 = kNaN;
    *d2 = kNaN;
    return;
  }
  pow2_split(static_cast<int>(byte) - 127, d1, d2);
}

struct E4M3Table {
  float v[256];
  E4M3Table() {
    for (int b = 0; b < 256; ++b) {
      int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
      float mag;
      if (e == 15 && m == 7) {
        mag = kNaN;
      } else if (e == 0) {
        mag = static_cast<float>(m) * (1.0f / 512.0f);
      } else {
        mag = std::ldexp(1.0f + static_cast<float>(m) / 8.0f, e - 7);
      }
      v[b] = s ? -mag : mag;
    }
  }
};
const E4M3Table& e4m3_table() {
  static const E4M3Table t;
  return t;
}

// ================================ SIMD layer (8 floats) ================================
#if JFA_AVX2
struct V8 {
  __m256 v;
};
inline V8 vload(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void vstore(float* p, V8 a) { _mm256_storeu_ps(p, a.v); }
inline V8 vset1(float x) { return {_mm256_set1_ps(x)}; }
inline V8 vbcast(const float* p) { return {_mm256_broadcast_ss(p)}; }
inline V8 vzero() { return {_mm256_setzero_ps()}; }
inline V8 vadd(V8 a, V8 b) { return {_mm256_add_ps(a.v, b.v)}; }
inline V8 vsub(V8 a, V8 b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline V8 vmul(V8 a, V8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline V8 vdiv(V8 a, V8 b) { return {_mm256_div_ps(a.v, b.v)}; }
inline V8 vfma(V8 a, V8 b, V8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline V8 vmax(V8 a, V8 b) { return {_mm256_max_ps(a.v, b.v)}; }
inline V8 vclamp448(V8 a) {
  return {_mm256_min_ps(_mm256_max_ps(a.v, _mm256_set1_ps(-kE4M3Max)), _mm256_set1_ps(kE4M3Max))};
}
inline V8 vabs(V8 a) { return {_mm256_andnot_ps(_mm256_set1_ps(-0.0f), a.v)}; }
// max that propagates NaN from either operand.
inline V8 vmax_nan(V8 acc, V8 x) {
  __m256 r = _mm256_max_ps(x.v, acc.v);  // acc if either is NaN
  return {_mm256_blendv_ps(r, x.v, _mm256_cmp_ps(x.v, x.v, _CMP_UNORD_Q))};
}
inline float vhmax(V8 a) {  // NaN-propagating horizontal max
  alignas(32) float t[8];
  _mm256_store_ps(t, a.v);
  float m = t[0];
  for (int i = 1; i < 8; ++i) m = (std::isnan(t[i]) || t[i] > m) ? t[i] : m;
  return m;
}
inline float vhsum(V8 a) {
  __m128 lo = _mm256_castps256_ps128(a.v), hi = _mm256_extractf128_ps(a.v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}
// exp(x), Cephes-style (~1 ulp); -inf and x < ln(2^-126) -> 0, NaN propagates.
inline V8 vexp(V8 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654475f), hi = _mm256_set1_ps(88.3762626647949f);
  __m256 nanm = _mm256_cmp_ps(x.v, x.v, _CMP_UNORD_Q);
  __m256 under = _mm256_cmp_ps(x.v, lo, _CMP_LT_OQ);
  __m256 xc = _mm256_min_ps(_mm256_max_ps(x.v, lo), hi);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
  __m256 r2 = _mm256_mul_ps(r, r);
  __m256 y = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  y = _mm256_andnot_ps(under, y);
  return {_mm256_blendv_ps(y, x.v, nanm)};
}
// e4m3(x) as float, RNE; |x| <= 448 (NaN stays NaN).
inline V8 vround_e4m3(V8 x) {
  const __m256 signm = _mm256_set1_ps(-0.0f);
  __m256 sign = _mm256_and_ps(x.v, signm);
  __m256 a = _mm256_andnot_ps(signm, x.v);
  __m256i ai = _mm256_castps_si256(a);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(ai, 20), _mm256_set1_epi32(1));
  __m256i rn = _mm256_add_epi32(ai, _mm256_add_epi32(_mm256_set1_epi32(0x7FFFF), lsb));
  rn = _mm256_and_si256(rn, _mm256_set1_epi32(static_cast<int>(0xFFF00000u)));
  const __m256 magic = _mm256_set1_ps(16384.0f);  // ulp 2^-9: the e4m3 subnormal step
  __m256 sub = _mm256_sub_ps(_mm256_add_ps(a, magic), magic);
  __m256 small = _mm256_cmp_ps(a, _mm256_set1_ps(0.015625f), _CMP_LT_OQ);
  __m256 r = _mm256_blendv_ps(_mm256_castsi256_ps(rn), sub, small);
  return {_mm256_or_ps(r, sign)};
}
// 8 e4m3 bytes -> 8 floats (exact; 0x7F/0xFF -> NaN).
inline V8 vload_e4m3(const uint8_t* p) {
  __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
  __m256i em = _mm256_and_si256(x, _mm256_set1_epi32(0x7F));
  __m256i nb = _mm256_add_epi32(_mm256_slli_epi32(em, 20), _mm256_set1_epi32(120 << 23));
  __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(1.0f / 512.0f));
  __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(8), em);
  __m256 mag = _mm256_blendv_ps(_mm256_castsi256_ps(nb), sub, _mm256_castsi256_ps(is_sub));
  __m256i is_nan = _mm256_cmpeq_epi32(em, _mm256_set1_epi32(0x7F));
  mag = _mm256_or_ps(mag, _mm256_castsi256_ps(is_nan));
  return {_mm256_or_ps(mag, _mm256_castsi256_ps(sign))};
}
// Per-lane factors of powers of two: for 8 int exponents e in [-127, 127] (split as pow2_split),
// and NaN lanes where nan_lane is set.
inline void vpow2_split(__m256i e, __m256i nan_lane, V8* f1, V8* f2) {
  __m256i e1 = _mm256_srai_epi32(e, 1);
  __m256i e2 = _mm256_sub_epi32(e, e1);
  const __m256i b = _mm256_set1_epi32(127);
  __m256 a1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e1, b), 23));
  __m256 a2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e2, b), 23));
  __m256 nanv = _mm256_set1_ps(kNaN), nm = _mm256_castsi256_ps(nan_lane);
  f1->v = _mm256_blendv_ps(a1, nanv, nm);
  f2->v = _mm256_blendv_ps(a2, nanv, nm);
}
// Dequantization factors of 8 scale bytes.
inline void vdeq_factors(const uint8_t* sb, V8* d1, V8* d2) {
  __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb)));
  __m256i nanl = _mm256_cmpeq_epi32(b, _mm256_set1_epi32(255));
  vpow2_split(_mm256_sub_epi32(b, _mm256_set1_epi32(127)), nanl, d1, d2);
}
// MX scale bytes of 8 block maxima: quantization factors (x * q1) * q2 and dequantization
// factors (e * d1) * d2.
inline void vmx_factors(V8 amax, V8* q1, V8* q2, V8* d1, V8* d2) {
  __m256i bits = _mm256_castps_si256(_mm256_mul_ps(amax.v, _mm256_set1_ps(kInv448)));
  __m256i ex = _mm256_and_si256(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(0xFF));
  __m256i man = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFF));
  __m256i nz = _mm256_andnot_si256(_mm256_cmpeq_epi32(man, _mm256_setzero_si256()),
                                   _mm256_set1_epi32(1));
  __m256i byte = _mm256_min_epi32(_mm256_add_epi32(ex, nz), _mm256_set1_epi32(254));
  __m256i nanl = _mm256_castps_si256(_mm256_cmp_ps(amax.v, amax.v, _CMP_UNORD_Q));
  vpow2_split(_mm256_sub_epi32(_mm256_set1_epi32(127), byte), nanl, q1, q2);
  vpow2_split(_mm256_sub_epi32(byte, _mm256_set1_epi32(127)), nanl, d1, d2);
}
// Eight float lanes accumulated in double (the softmax row sum l).
struct D8 {
  __m256d a = _mm256_setzero_pd(), b = _mm256_setzero_pd();
};
inline void dacc(D8* d, V8 x) {
  d->a = _mm256_add_pd(d->a, _mm256_cvtps_pd(_mm256_castps256_ps128(x.v)));
  d->b = _mm256_add_pd(d->b, _mm256_cvtps_pd(_mm256_extractf128_ps(x.v, 1)));
}
// p[0..8) += x (in double).
inline void vaddto_f64(double* p, V8 x) {
  _mm256_storeu_pd(p, _mm256_add_pd(_mm256_loadu_pd(p), _mm256_cvtps_pd(_mm256_castps256_ps128(x.v))));
  _mm256_storeu_pd(p + 4, _mm256_add_pd(_mm256_loadu_pd(p + 4), _mm256_cvtps_pd(_mm256_extractf128_ps(x.v, 1))));
}
inline double dhsum(const D8& d) {
  alignas(32) double t[4];
  _mm256_store_pd(t, _mm256_add_pd(d.a, d.b));
  return (t[0] + t[1]) + (t[2] + t[3]);
}
#else  // portable fallback
struct D8 {
  double v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
};
struct V8;
inline void dacc(D8* d, const V8& x);
inline double dhsum(const D8& d) { double s = 0; for (int i = 0; i < 8; ++i) s += d.v[i]; return s; }
struct V8 {
  float v[8];
};
inline void dacc(D8* d, const V8& x) { for (int i = 0; i < 8; ++i) d->v[i] += x.v[i]; }
inline void vaddto_f64(double* p, const V8& x) { for (int i = 0; i < 8; ++i) p[i] += x.v[i]; }
inline V8 vload(const float* p) { V8 r; for (int i = 0; i < 8; ++i) r.v[i] = p[i]; return r; }
inline void vstore(float* p, V8 a) { for (int i = 0; i < 8; ++i) p[i] = a.v[i]; }
inline V8 vset1(float x) { V8 r; for (int i = 0; i < 8; ++i) r.v[i] = x; return r; }
inline V8 vbcast(const float* p) { return vset1(*p); }
inline V8 vzero() { return vset1(0.0f); }
#define JFA_V8_BIN(name, expr) \
  inline V8 name(V8 a, V8 b) { V8 r; for (int i = 0; i < 8; ++i) { float x = a.v[i], y = b.v[i]; r.v[i] = (expr); } return r; }
JFA_V8_BIN(vadd, x + y)
JFA_V8_BIN(vsub, x - y)
JFA_V8_BIN(vmul, x * y)
JFA_V8_BIN(vdiv, x / y)
JFA_V8_BIN(vmax, (x > y) ? x : y)
JFA_V8_BIN(vmax_nan, std::isnan(y) ? y : (std::isnan(x) ? x : ((x > y) ? x : y)))
#undef JFA_V8_BIN
inline V8 vfma(V8 a, V8 b, V8 c) { V8 r; for (int i = 0; i < 8; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]); return r; }
inline V8 vclamp448(V8 a) { V8 r; for (int i = 0; i < 8; ++i) r.v[i] = std::min(std::max(a.v[i], -kE4M3Max), kE4M3Max); return r; }
inline V8 vabs(V8 a) { V8 r; for (int i = 0; i < 8; ++i) r.v[i] = std::fabs(a.v[i]); return r; }
inline float vhmax(V8 a) { float m = a.v[0]; for (int i = 1; i < 8; ++i) m = (std::isnan(a.v[i]) || a.v[i] > m) ? a.v[i] : m; return m; }
inline float vhsum(V8 a) { float s = 0; for (int i = 0; i < 8; ++i) s += a.v[i]; return s; }
inline V8 vexp(V8 x) {
  V8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = (x.v[i] < -87.33654475f) ? 0.0f : std::exp(x.v[i]);
  return r;
}
inline float round_e4m3_scalar(float x);
inline V8 vround_e4m3(V8 x) { V8 r; for (int i = 0; i < 8; ++i) r.v[i] = round_e4m3_scalar(x.v[i]); return r; }
inline V8 vload_e4m3(const uint8_t* p) { V8 r; for (int i = 0; i < 8; ++i) r.v[i] = e4m3_table().v[p[i]]; return r; }
inline void vdeq_factors(const uint8_t* sb, V8* d1, V8* d2) {
  for (int i = 0; i < 8; ++i) deq_factors(sb[i], &d1->v[i], &d2->v[i]);
}
inline void vmx_factors(V8 amax, V8* q1, V8* q2, V8* d1, V8* d2) {
  for (int i = 0; i < 8; ++i) {
    uint8_t b = e8m0_from_amax(amax.v[i]);
    if (b == 255) {
      q1->v[i] = q2->v[i] = d1->v[i] = d2->v[i] = kNaN;
    } else {
      pow2_split(127 - b, &q1->v[i], &q2->v[i]);
      pow2_split(b - 127, &d1->v[i], &d2->v[i]);
    }
  }
}
#endif

// Scalar e4m3 rounding as a float (|x| <= 448 or NaN), for the fallback and tests.
inline float round_e4m3_scalar(float x) { return e4m3_table().v[f32_to_e4m3(x)]; }

// ================================== FTZ / DAZ ==================================
// XLA's CPU runtime flushes fp32 subnormals; the kernels do too (also for speed).
class ScopedFlushDenormal {
 public:
  ScopedFlushDenormal() {
#if JFA_HAVE_MXCSR
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ | 0x8040u);  // FTZ | DAZ
#endif
  }
  ~ScopedFlushDenormal() {
#if JFA_HAVE_MXCSR
    _mm_setcsr(saved_);
#endif
  }

 private:
  unsigned saved_ = 0;
};

// ================================== thread pool ==================================
struct Job {
  const std::function<void(int64_t)>* fn = nullptr;
  int64_t n = 0;
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  int64_t done = 0;  // guarded by the pool mutex
  int active = 0;    // workers inside this job; guarded by the pool mutex
};

// Runs items of `j` until none is left; returns how many it ran.
int64_t drain(Job* j) {
  int64_t cnt = 0;
  for (;;) {
    int64_t i = j->next.fetch_add(1, std::memory_order_relaxed);
    if (i >= j->n) break;
    try {
      (*j->fn)(i);
    } catch (...) {
      j->failed.store(true);
    }
    ++cnt;
  }
  return cnt;
}

class Pool {
 public:
  explicit Pool(int workers) {
    for (int t = 0; t < workers; ++t) {
      try {
        std::thread th([this] { Worker(); });
        th.detach();  // the pool lives for the whole process
        ++workers_;
      } catch (...) {
        break;  // fewer threads: the caller runs the remaining work itself
      }
    }
  }
  int size() const { return workers_ + 1; }

  bool Run(int64_t n, const std::function<void(int64_t)>& fn) {
    Job j;
    j.fn = &fn;
    j.n = n;
    {
      std::lock_guard<std::mutex> lk(mu_);
      jobs_.push_back(&j);
    }
    work_cv_.notify_all();
    int64_t cnt = drain(&j);
    std::unique_lock<std::mutex> lk(mu_);
    Remove(&j);
    j.done += cnt;
    done_cv_.wait(lk, [&] { return j.done == j.n && j.active == 0; });
    return !j.failed.load();
  }

 private:
  void Remove(Job* j) {  // mu_ held
    auto it = std::find(jobs_.begin(), jobs_.end(), j);
    if (it != jobs_.end()) jobs_.erase(it);
  }
  void Worker() {
#if JFA_HAVE_MXCSR
    _mm_setcsr(_mm_getcsr() | 0x8040u);
#endif
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      work_cv_.wait(lk, [&] { return !jobs_.empty(); });
      Job* j = jobs_.front();
      ++j->active;
      lk.unlock();
      int64_t cnt = drain(j);
      lk.lock();
      Remove(j);  // exhausted
      j->done += cnt;
      --j->active;
      if (j->done == j->n && j->active == 0) done_cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Job*> jobs_;
  int workers_ = 0;
};

int configured_threads() {
  int n = static_cast<int>(std::thread::hardware_concurrency());
  if (const char* e = std::getenv("JAX_FA4_CPU_THREADS")) {
    int v = std::atoi(e);
    if (v > 0) n = v;
  }
  return std::max(1, std::min(n, 256));
}

Pool& pool() {
  static Pool* p = new Pool(configured_threads() - 1);  // leaked on purpose: no exit-time join
  return *p;
}

// ================================== aligned scratch ==================================
struct FloatBuf {
  std::unique_ptr<float[]> mem;
  float* p = nullptr;
  bool alloc(size_t n) {
    mem.reset(new (std::nothrow) float[n + 16]);
    if (!mem) return false;
    uintptr_t a = reinterpret_cast<uintptr_t>(mem.get());
    p = reinterpret_cast<float*>((a + 63) & ~uintptr_t{63});
    return true;
  }
};

// Per-thread tile scratch, grown on demand (throws bad_alloc -> item failure).
float* thread_scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n + 16) buf.resize(n + 16);
  uintptr_t a = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<float*>((a + 63) & ~uintptr_t{63});
}

// ================================== GEMM ==================================
// C[MR x 16] (+)= A[MR x K] B[K x 16]; A(m, k) = A[m * rsA + k * csA]; B row k at B + k * ldb.
// The accumulators must live in registers: raw __m256 arrays with fully unrolled m loops (an
// array of wrapper structs made GCC keep them on the stack).
#if JFA_AVX2
#define JFA_UNROLL _Pragma("GCC unroll 8")
template <int MR>
__attribute__((noinline)) void ukernel(int64_t K, const float* __restrict A, int64_t rsA,
                                       int64_t csA, const float* __restrict B, int64_t ldb,
                                       float* __restrict C, int64_t ldc, bool acc) {
  __m256 c0[MR], c1[MR];
  if (acc) {
    JFA_UNROLL for (int m = 0; m < MR; ++m) {
      c0[m] = _mm256_loadu_ps(C + m * ldc);
      c1[m] = _mm256_loadu_ps(C + m * ldc + 8);
    }
  } else {
    JFA_UNROLL for (int m = 0; m < MR; ++m) c0[m] = c1[m] = _mm256_setzero_ps();
  }
  const float* a = A;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B), b1 = _mm256_loadu_ps(B + 8);
    B += ldb;
    JFA_UNROLL for (int m = 0; m < MR; ++m) {
      const __m256 av = _mm256_broadcast_ss(a + m * rsA);
      c0[m] = _mm256_fmadd_ps(av, b0, c0[m]);
      c1[m] = _mm256_fmadd_ps(av, b1, c1[m]);
    }
    a += csA;
  }
  JFA_UNROLL for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(C + m * ldc, c0[m]);
    _mm256_storeu_ps(C + m * ldc + 8, c1[m]);
  }
}
#else
template <int MR>
void ukernel(int64_t K, const float* __restrict A, int64_t rsA, int64_t csA,
             const float* __restrict B, int64_t ldb, float* __restrict C, int64_t ldc, bool acc) {
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 16; ++j) {
      float s = acc ? C[m * ldc + j] : 0.0f;
      for (int64_t k = 0; k < K; ++k) s = std::fma(A[m * rsA + k * csA], B[k * ldb + j], s);
      C[m * ldc + j] = s;
    }
}
#endif

// C[M x N] (+)= A[M x K] B[K x N], N % 16 == 0. A(m, k) = A[m*rsA + k*csA]; B(k, n) =
// B[(n / 16) * bsB + k * ldb + n % 16] (row-major B: ldb = N, bsB = 16; packed 16-column panels:
// ldb = 16, bsB = 16 * K); C row-major with leading dim ldc.
void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t rsA, int64_t csA,
          const float* B, int64_t ldb, int64_t bsB, float* C, int64_t ldc, bool acc) {
  for (int64_t n0 = 0; n0 < N; n0 += kNR) {
    const float* Bp = B + (n0 / kNR) * bsB;
    float* Cp = C + n0;
    int64_t m0 = 0;
    for (; m0 + 6 <= M; m0 += 6)
      ukernel<6>(K, A + m0 * rsA, rsA, csA, Bp, ldb, Cp + m0 * ldc, ldc, acc);
    const float* Ar = A + m0 * rsA;
    float* Cr = Cp + m0 * ldc;
    switch (M - m0) {
      case 5: ukernel<5>(K, Ar, rsA, csA, Bp, ldb, Cr, ldc, acc); break;
      case 4: ukernel<4>(K, Ar, rsA, csA, Bp, ldb, Cr, ldc, acc); break;
      case 3: ukernel<3>(K, Ar, rsA, csA, Bp, ldb, Cr, ldc, acc); break;
      case 2: ukernel<2>(K, Ar, rsA, csA, Bp, ldb, Cr, ldc, acc); break;
      case 1: ukernel<1>(K, Ar, rsA, csA, Bp, ldb, Cr, ldc, acc); break;
      default: break;
    }
  }
}

// C[M x N] += A[M x K] B[K x N] with C in double: fp32 FMA over chunks of kDaccChunk terms,
// each chunk's partial sums added to C in double. Used where fp32 summation noise over long
// sums would otherwise rival the recipe's own error (PV with near-uniform P). A row-major
// (rsA, csA = 1); B row-major (ldb), N % 16 == 0.
constexpr int64_t kDaccChunk = 64;
#if JFA_AVX2
template <int MR>
__attribute__((noinline)) void ukernel_dacc(int64_t K, const float* __restrict A, int64_t rsA,
                                            const float* __restrict B, int64_t ldb,
                                            double* __restrict C, int64_t ldc) {
  for (int64_t k0 = 0; k0 < K; k0 += kDaccChunk) {
    const int64_t kk = std::min(kDaccChunk, K - k0);
    __m256 c0[MR], c1[MR];
    JFA_UNROLL for (int m = 0; m < MR; ++m) c0[m] = c1[m] = _mm256_setzero_ps();
    const float* a = A + k0;
    const float* Bk = B + k0 * ldb;
    for (int64_t k = 0; k < kk; ++k) {
      const __m256 b0 = _mm256_loadu_ps(Bk), b1 = _mm256_loadu_ps(Bk + 8);
      Bk += ldb;
      JFA_UNROLL for (int m = 0; m < MR; ++m) {
        const __m256 av = _mm256_broadcast_ss(a + m * rsA);
        c0[m] = _mm256_fmadd_ps(av, b0, c0[m]);
        c1[m] = _mm256_fmadd_ps(av, b1, c1[m]);
      }
      ++a;
    }
    JFA_UNROLL for (int m = 0; m < MR; ++m) {
      vaddto_f64(C + m * ldc, V8{c0[m]});
      vaddto_f64(C + m * ldc + 8, V8{c1[m]});
    }
  }
}
#else
template <int MR>
void ukernel_dacc(int64_t K, const float* __restrict A, int64_t rsA, const float* __restrict B,
                  int64_t ldb, double* __restrict C, int64_t ldc) {
  for (int64_t k0 = 0; k0 < K; k0 += kDaccChunk) {
    const int64_t kk = std::min(kDaccChunk, K - k0);
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < 16; ++j) {
        float s = 0.0f;
        for (int64_t k = k0; k < k0 + kk; ++k) s = std::fma(A[m * rsA + k], B[k * ldb + j], s);
        C[m * ldc + j] += s;
      }
  }
}
#endif

void gemm_dacc(int64_t M, int64_t N, int64_t K, const float* A, int64_t rsA, const float* B,
               int64_t ldb, double* C, int64_t ldc) {
  for (int64_t n0 = 0; n0 < N; n0 += kNR) {
    int64_t m0 = 0;
    for (; m0 + 6 <= M; m0 += 6)
      ukernel_dacc<6>(K, A + m0 * rsA, rsA, B + n0, ldb, C + m0 * ldc + n0, ldc);
    const float* Ar = A + m0 * rsA;
    double* Cr = C + m0 * ldc + n0;
    switch (M - m0) {
      case 5: ukernel_dacc<5>(K, Ar, rsA, B + n0, ldb, Cr, ldc); break;
      case 4: ukernel_dacc<4>(K, Ar, rsA, B + n0, ldb, Cr, ldc); break;
      case 3: ukernel_dacc<3>(K, Ar, rsA, B + n0, ldb, Cr, ldc); break;
      case 2: ukernel_dacc<2>(K, Ar, rsA, B + n0, ldb, Cr, ldc); break;
      case 1: ukernel_dacc<1>(K, Ar, rsA, B + n0, ldb, Cr, ldc); break;
      default: break;
    }
  }
}

// ================================== dequantization ==================================
// One row of H elements blocked along H (one scale byte per 32): out[h] exact fp32.
inline void deq_row_h(const uint8_t* __restrict x, const uint8_t* __restrict sc, int64_t H,
                      float* __restrict out) {
  for (int64_t blk = 0; blk < H / 32; ++blk) {
    float d1, d2;
    deq_factors(sc[blk], &d1, &d2);
    V8 f1 = vset1(d1), f2 = vset1(d2);
    for (int v = 0; v < 4; ++v) {
      const int64_t o = blk * 32 + v * 8;
      vstore(out + o, vmul(vmul(vload_e4m3(x + o), f1), f2));
    }
  }
}
// One row of H elements of a tensor blocked along its sequence axis: sc is that row's block's
// H scale bytes.
inline void deq_row_seq(const uint8_t* __restrict x, const uint8_t* __restrict sc, int64_t H,
                        float* __restrict out) {
  for (int64_t h = 0; h < H; h += 8) {
    V8 d1, d2;
    vdeq_factors(sc + h, &d1, &d2);
    vstore(out + h, vmul(vmul(vload_e4m3(x + h), d1), d2));
  }
}
// Scatters one dequantized key row into packed 16-key panels ([H][16] per panel).
inline void scatter_panel(const float* __restrict row, int64_t j, int64_t H,
                          float* __restrict panels) {
  float* p = panels + (j / kNR) * H * kNR + (j % kNR);
  for (int64_t h = 0; h < H; ++h) p[h * kNR] = row[h];
}

// ================================== masks ==================================
struct RowMask {
  int64_t qlen, kvlen;
  bool causal;
  int64_t wl, wr;  // clamped: -1 = unbounded
  // Allowed keys of query row i: [lo, hi) (empty if lo >= hi); rows >= qlen have none.
  inline void interval(int64_t i, int64_t* lo, int64_t* hi) const {
    int64_t l = 0, h = kvlen;
    if (i >= qlen) {
      *lo = 0;
      *hi = 0;
      return;
    }
    if (causal) h = std::min(h, i + 1);
    if (wl >= 0) l = std::max(l, i - wl);
    if (wr >= 0) h = std::min(h, i + wr + 1);
    *lo = l;
    *hi = h;
  }
};

RowMask make_mask(const MaskSpec& m, int64_t T, int64_t S, int32_t qlen, int32_t kvlen) {
  RowMask r;
  r.qlen = std::min<int64_t>(std::max<int32_t>(qlen, 0), T);
  r.kvlen = std::min<int64_t>(std::max<int32_t>(kvlen, 0), S);
  r.causal = m.is_causal;
  const int64_t big = T + S + 1;  // a window this wide is unbounded; keeps i +- w from overflow
  r.wl = m.window_left < 0 ? -1 : std::min(m.window_left, big);
  r.wr = m.window_right < 0 ? -1 : std::min(m.window_right, big);
  return r;
}

// ================================== MX quantization of dS ==================================
// One block of 32 contiguous floats -> dequantized MX values.
inline void mxqd_block32(const float* __restrict x, float* __restrict out) {
  V8 v[4];
  V8 am = vzero();
  for (int t = 0; t < 4; ++t) {
    v[t] = vload(x + 8 * t);
    am = vmax_nan(am, vabs(v[t]));
  }
  const float amax = vhmax(am);
  const uint8_t byte = e8m0_from_amax(amax);
  if (byte == 255) {
    for (int t = 0; t < 4; ++t) vstore(out + 8 * t, vset1(kNaN));
    return;
  }
  if (byte == 0) {  // amax == 0 (or below the smallest scale): all zeros
    bool all_zero = (amax == 0.0f);
    if (all_zero) {
      for (int t = 0; t < 4; ++t) vstore(out + 8 * t, vzero());
      return;
    }
  }
  float q1, q2, d1, d2;
  pow2_split(127 - static_cast<int>(byte), &q1, &q2);
  pow2_split(static_cast<int>(byte) - 127, &d1, &d2);
  const V8 Q1 = vset1(q1), Q2 = vset1(q2), D1 = vset1(d1), D2 = vset1(d2);
  for (int t = 0; t < 4; ++t) {
    V8 y = vclamp448(vmul(vmul(v[t], Q1), Q2));
    vstore(out + 8 * t, vmul(vmul(vround_e4m3(y), D1), D2));
  }
}

// Blocks of 32 along rows (contiguous).
void mxqd_rows(const float* x, int64_t rows, int64_t cols, int64_t ldx, float* out,
               int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; c += 32) mxqd_block32(x + r * ldx + c, out + r * ldo + c);
}

// Blocks of 32 consecutive rows, per column (vectorized over 8 columns).
void mxqd_cols(const float* x, int64_t rows, int64_t cols, int64_t ldx, float* out,
               int64_t ldo) {
  for (int64_t r0 = 0; r0 < rows; r0 += 32) {
    for (int64_t c = 0; c < cols; c += 8) {
      V8 am = vzero();
      for (int64_t r = 0; r < 32; ++r) am = vmax_nan(am, vabs(vload(x + (r0 + r) * ldx + c)));
      V8 q1, q2, d1, d2;
      vmx_factors(am, &q1, &q2, &d1, &d2);
      for (int64_t r = 0; r < 32; ++r) {
        V8 y = vclamp448(vmul(vmul(vload(x + (r0 + r) * ldx + c), q1), q2));
        vstore(out + (r0 + r) * ldo + c, vmul(vmul(vround_e4m3(y), d1), d2));
      }
    }
  }
}

// ================================== forward ==================================
struct FwdCtx {
  const ForwardArgs* a;
  int64_t G, Spad, nqt;
  const float* kp;  // [batch][K][Spad/16][H][16] dequantized K, packed panels
  const float* vf;  // [batch][K][Spad][H] dequantized V
};

void fwd_prepass_item(const ForwardArgs& a, int64_t Spad, float* kp, float* vf, int64_t item) {
  const Dims& d = a.d;
  const int64_t nkb = Spad / kBk;
  const int64_t b = item / (d.K * nkb), g = (item / nkb) % d.K, kb = item % nkb;
  const int64_t H = d.H;
  float* kpanels = kp + (b * d.K + g) * Spad * H;
  float* vrows = vf + (b * d.K + g) * Spad * H;
  alignas(64) float row[256];
  const int64_t nsb = ceil_div(d.S, 32);
  for (int64_t j = kb * kBk; j < (kb + 1) * kBk; ++j) {
    if (j < d.S) {
      const int64_t e = ((b * d.S + j) * d.K + g) * H;
      deq_row_h(a.k + e, a.k_scale + e / 32, H, row);
      scatter_panel(row, j, H, kpanels);
      deq_row_seq(a.v + e, a.v_scale + ((b * nsb + j / 32) * d.K + g) * H, H, vrows + j * H);
    } else {
      std::memset(row, 0, sizeof(float) * H);
      scatter_panel(row, j, H, kpanels);
      std::memset(vrows + j * H, 0, sizeof(float) * H);
    }
  }
}

void fwd_item(const FwdCtx& c, int64_t item) {
  const ForwardArgs& a = *c.a;
  const Dims& d = a.d;
  const int64_t H = d.H, BN = d.batch * d.N;
  // Larger query tiles first (the costly rows of a causal triangle), then (b, n).
  const int64_t qt = c.nqt - 1 - item / BN;
  const int64_t b = (item % BN) / d.N, n = item % d.N, g = n / c.G;
  const int64_t i0 = qt * kBq, mq = std::min(kBq, d.T - i0);
  const RowMask mk = make_mask(a.mask, d.T, d.S, a.q_seqlen[b], a.kv_seqlen[b]);

  int64_t lo[kBq], hi[kBq];
  int64_t jmin = d.S, jmax = 0, mr = 0;
  for (int64_t r = 0; r < mq; ++r) {
    mk.interval(i0 + r, &lo[r], &hi[r]);
    if (lo[r] < hi[r]) {
      jmin = std::min(jmin, lo[r]);
      jmax = std::max(jmax, hi[r]);
      mr = r + 1;
    }
  }
  float* o_base = a.o + ((b * d.T + i0) * d.N + n) * H;  // row r at + r * N * H
  float* lse_base = a.lse + (b * d.T + i0) * d.N + n;    // row r at + r * N

  if (mr > 0) {
    // Keys [j_start, j_start + W) cover every allowed key of the tile's rows.
    const int64_t j_start = (jmin / kBk) * kBk, W = round_up(jmax - j_start, kBk);
    const int64_t w_eff = jmax - j_start;
    const int64_t ldS = W + 16;  // padded: rows 2^k floats apart would alias in L1
    float* Qf = thread_scratch(static_cast<size_t>(kBq) * (3 * H + ldS + 1));
    double* Oacc = reinterpret_cast<double*>(Qf + kBq * H);  // [Bq][H] in double
    float* Sp = Qf + 3 * kBq * H;  // scores, then 256 * P8: [Bq][ldS]
    float* m = Sp + kBq * ldS;
    double l[kBq];
    for (int64_t r = 0; r < mr; ++r) {
      const int64_t e = ((b * d.T + i0 + r) * d.N + n) * H;
      deq_row_h(a.q + e, a.q_scale + e / 32, H, Qf + r * H);
    }
    const float* kpanels = c.kp + (b * d.K + g) * c.Spad * H;
    const float* vrows = c.vf + (b * d.K + g) * c.Spad * H;

    // Pass 1: S = Q K^T for the whole key range (K from packed 16-key panels).
    gemm(mr, W, H, Qf, H, 1, kpanels + j_start * H, kNR, kNR * H, Sp, ldS, false);

    // Pass 2, per row: scale, mask, the exact row max m, P = exp(S - m), l = sum P (double),
    // 256 * P8 = e4m3(256 P) in place. With the final max, P8 is exactly the recipe's.
    const V8 vscale = vset1(a.scale), v256 = vset1(kPScale);
    for (int64_t r = 0; r < mr; ++r) {
      float* row = Sp + r * ldS;
      l[r] = 0.0;
      m[r] = -kInf;
      if (lo[r] >= hi[r]) {
        std::memset(row, 0, sizeof(float) * W);
        continue;
      }
      const int64_t clo = lo[r] - j_start, chi = hi[r] - j_start;
      const int64_t ca = clo & ~int64_t{7}, cb = round_up(chi, 8);  // 8-aligned cover
      if (ca > 0) std::memset(row, 0, sizeof(float) * ca);
      if (cb < W) std::memset(row + cb, 0, sizeof(float) * (W - cb));
      V8 vm = vset1(-kInf);
      for (int64_t cc = ca; cc < cb; cc += 8) {  // scale, mask (edge chunks only), max
        V8 sv;
        if (cc < clo || cc + 8 > chi) {
          for (int64_t t = cc; t < cc + 8; ++t)
            row[t] = (t >= clo && t < chi) ? row[t] * a.scale : -kInf;
          sv = vload(row + cc);
        } else {
          sv = vmul(vload(row + cc), vscale);
          vstore(row + cc, sv);
        }
        vm = vmax(vm, sv);
      }
      const float mx = vhmax(vm);
      if (mx == -kInf) {  // only -inf logits (impossible for finite inputs)
        std::memset(row + ca, 0, sizeof(float) * (cb - ca));
        continue;
      }
      const V8 vmx = vset1(mx);
      D8 sum;
      for (int64_t cc = ca; cc < cb; cc += 8) {
        V8 p = vexp(vsub(vload(row + cc), vmx));
        dacc(&sum, p);
        vstore(row + cc, vround_e4m3(vmul(p, v256)));
      }
      m[r] = mx;
      l[r] = dhsum(sum);
    }

    // Pass 3: O = (256 P8) V, in chunks of keys that keep the V rows in cache.
    std::memset(Oacc, 0, sizeof(double) * mr * H);
    constexpr int64_t kChunk = 256;
    for (int64_t k0 = 0; k0 < w_eff; k0 += kChunk) {
      gemm_dacc(mr, H, std::min(kChunk, w_eff - k0), Sp + k0, ldS, vrows + (j_start + k0) * H, H,
                Oacc, H);
    }
    for (int64_t r = 0; r < mr; ++r) {
      float* orow = o_base + r * d.N * H;
      if (l[r] > 0.0) {
        const double inv = 1.0 / (static_cast<double>(kPScale) * l[r]);
        for (int64_t h = 0; h < H; ++h) orow[h] = static_cast<float>(Oacc[r * H + h] * inv);
        lse_base[r * d.N] = static_cast<float>(static_cast<double>(m[r]) + std::log(l[r]));
      } else if (std::isnan(l[r]) || std::isnan(m[r])) {
        for (int64_t h = 0; h < H; ++h) orow[h] = kNaN;
        lse_base[r * d.N] = kNaN;
      } else {
        std::memset(orow, 0, sizeof(float) * H);
        lse_base[r * d.N] = -kInf;
      }
    }
  }
  for (int64_t r = mr; r < mq; ++r) {  // fully masked rows
    std::memset(o_base + r * d.N * H, 0, sizeof(float) * H);
    lse_base[r * d.N] = -kInf;
  }
}

// ================================== backward ==================================
struct BwdCtx {
  const BackwardArgs* a;
  int64_t G, Tpad, Spad, nqt, nkt;
  const float *qh, *qt, *doh, *dot;  // [batch][N][Tpad][H]
  const float *khp, *vhp;            // [batch][K][Spad/16][H][16] packed panels
  const float* ks;                   // [batch][K][Spad][H]
  // dQ's adds in key-tile order: dq_turn[(b * N + n) * nqt + qt] is the key tile whose add to that
  // block of 64 query rows is next. fp32 adds in a fixed order make dQ bitwise reproducible (with
  // lock-ordered adds it differed from run to run); a key tile with nothing to add to a block
  // passes the turn on. parallel_for hands items out in increasing order and key tile kt - 1's
  // item comes before kt's, so the item waited for is already running (or done): no item waits on
  // one that no thread holds.
  std::atomic<int32_t>* dq_turn;
  std::atomic<bool>* failed;  // an item threw: the ones waiting for its turn give up
};

// Waits until key tile kt holds the turn of dQ block blk.
void wait_dq_turn(const BwdCtx& c, int64_t blk, int64_t kt) {
  while (c.dq_turn[blk].load(std::memory_order_acquire) != kt) {
    if (c.failed->load(std::memory_order_relaxed)) throw std::runtime_error("backward item failed");
    std::this_thread::yield();
  }
}

// Key tile kt's turn of dQ blocks [lo, hi) of query head n, with nothing to add.
void pass_dq_turns(const BwdCtx& c, int64_t b, int64_t n, int64_t lo, int64_t hi, int64_t kt) {
  for (int64_t qt = lo; qt < hi; ++qt) {
    const int64_t blk = (b * c.a->d.N + n) * c.nqt + qt;
    wait_dq_turn(c, blk, kt);
    c.dq_turn[blk].store(static_cast<int32_t>(kt + 1), std::memory_order_release);
  }
}

void bwd_prepass_item(const BackwardArgs& a, const BwdCtx& c, float* qh, float* qt, float* doh,
                      float* dot, float* khp, float* vhp, float* ks, int64_t item) {
  const Dims& d = a.d;
  const int64_t H = d.H;
  const int64_t nq_items = d.batch * d.N * c.nqt;
  if (item < nq_items) {  // query side: (b, n, query tile)
    const int64_t b = item / (d.N * c.nqt), n = (item / c.nqt) % d.N, t = item % c.nqt;
    const int64_t ntb = ceil_div(d.T, 32);
    const int64_t base = ((b * d.N + n) * c.Tpad) * H;
    for (int64_t i = t * kBq; i < (t + 1) * kBq; ++i) {
      float* o1 = qh + base + i * H;
      float* o2 = qt + base + i * H;
      float* o3 = doh + base + i * H;
      float* o4 = dot + base + i * H;
      if (i < d.T) {
        const int64_t e = ((b * d.T + i) * d.N + n) * H;
        const int64_t st = ((b * ntb + i / 32) * d.N + n) * H;
        deq_row_h(a.q_h + e, a.q_h_scale + e / 32, H, o1);
        deq_row_seq(a.q_t + e, a.q_t_scale + st, H, o2);
        deq_row_h(a.do_h + e, a.do_h_scale + e / 32, H, o3);
        deq_row_seq(a.do_t + e, a.do_t_scale + st, H, o4);
        // dq is accumulated into: start from zero.
        std::memset(a.dq + e, 0, sizeof(float) * H);
      } else {
        for (float* o : {o1, o2, o3, o4}) std::memset(o, 0, sizeof(float) * H);
      }
    }
    return;
  }
  item -= nq_items;  // key side: (b, g, key tile)
  const int64_t b = item / (d.K * c.nkt), g = (item / c.nkt) % d.K, t = item % c.nkt;
  const int64_t nsb = ceil_div(d.S, 32);
  const int64_t base = ((b * d.K + g) * c.Spad) * H;
  alignas(64) float row[256];
  for (int64_t j = t * kBk; j < (t + 1) * kBk; ++j) {
    if (j < d.S) {
      const int64_t e = ((b * d.S + j) * d.K + g) * H;
      deq_row_h(a.k_h + e, a.k_h_scale + e / 32, H, row);
      scatter_panel(row, j, H, khp + base);
      deq_row_h(a.v_h + e, a.v_h_scale + e / 32, H, row);
      scatter_panel(row, j, H, vhp + base);
      deq_row_seq(a.k_s + e, a.k_s_scale + ((b * nsb + j / 32) * d.K + g) * H, H,
                  ks + base + j * H);
    } else {
      std::memset(row, 0, sizeof(float) * H);
      scatter_panel(row, j, H, khp + base);
      scatter_panel(row, j, H, vhp + base);
      std::memset(ks + base + j * H, 0, sizeof(float) * H);
    }
  }
}

void bwd_item_body(const BwdCtx& c, int64_t item) {
  const BackwardArgs& a = *c.a;
  const Dims& d = a.d;
  const int64_t H = d.H;
  // Items run key tile major, (batch, kv head) minor: the items running at once mostly belong to
  // different (batch, kv head) groups, so few wait for a dQ turn (key tile minor, each waited
  // for its neighbour: +7-20% under a causal mask on 2 threads).
  const int64_t grp = item % (d.batch * d.K), kt = item / (d.batch * d.K);
  const int64_t b = grp / d.K, g = grp % d.K;
  const int64_t j0 = kt * kBk;
  const RowMask mk = make_mask(a.mask, d.T, d.S, a.q_seqlen[b], a.kv_seqlen[b]);
  const int64_t nk = std::min(kBk, mk.kvlen - j0);  // keys >= kvlen get no gradient
  const int64_t nkp = round_up(std::max<int64_t>(nk, 1), 32);
  const int64_t nkeys_out = std::min(kBk, d.S - j0);

  // Query rows whose allowed interval meets [j0, j0 + nk): a contiguous range [ilo, ihi).
  int64_t ilo = mk.qlen, ihi = 0;
  if (nk > 0) {
    for (int64_t i = 0; i < mk.qlen; ++i) {
      int64_t lo, hi;
      mk.interval(i, &lo, &hi);
      if (lo < hi && lo < j0 + nk && hi > j0) {
        ilo = std::min(ilo, i);
        ihi = i + 1;
      }
    }
  }

  const size_t tile = static_cast<size_t>(kBq) * kBk;
  float* dK = thread_scratch(2 * kBk * H + 5 * tile + kBq * H + 2 * kBq);
  float* dV = dK + kBk * H;
  float* P = dV + kBk * H;  // unquantized P  [Bq][Bk]
  float* P8 = P + tile;     // 256 * P8       [Bq][Bk]
  float* dS = P8 + tile;    // dP, then dS    [Bq][Bk]
  float* dSk = dS + tile;   // dS via MX along keys    [Bq][Bk]
  float* dSq = dSk + tile;  // dS via MX along queries [Bq][Bk]
  float* dQl = dSq + tile;  // [Bq][H]
  std::memset(dK, 0, sizeof(float) * 2 * kBk * H);

  if (ihi <= ilo) {
    for (int64_t hn = 0; hn < c.G; ++hn) pass_dq_turns(c, b, g * c.G + hn, 0, c.nqt, kt);
  } else {
    const int64_t qt_lo = ilo / kBq, qt_hi = ceil_div(ihi, kBq), nq = qt_hi - qt_lo;
    const size_t kv_off = static_cast<size_t>((b * d.K + g) * c.Spad) * H;
    const float* khp = c.khp + kv_off + j0 * H;
    const float* vhp = c.vhp + kv_off + j0 * H;
    const float* ks = c.ks + kv_off + j0 * H;
    const V8 vscale = vset1(a.scale), v256 = vset1(kPScale);
    for (int64_t hn = 0; hn < c.G; ++hn) {
      const int64_t n = g * c.G + hn;
      const size_t q_off = static_cast<size_t>((b * d.N + n) * c.Tpad) * H;
      pass_dq_turns(c, b, n, 0, qt_lo, kt);
      for (int64_t s = 0; s < nq; ++s) {
        // In order: the next key tile's item follows this one block behind.
        const int64_t qt = qt_lo + s;
        const int64_t i0 = qt * kBq;
        const int64_t r_lo = std::max<int64_t>(ilo - i0, 0);
        const int64_t mr = std::min<int64_t>(ihi - i0, kBq);  // rows [mr, Bq) are all zero
        const int64_t mqp = round_up(mr, 32);
        const float* qh = c.qh + q_off + i0 * H;
        const float* doh = c.doh + q_off + i0 * H;
        // S = Q K^T and dP = dO V^T.
        gemm(mr, nkp, H, qh, H, 1, khp, kNR, kNR * H, P, kBk, false);
        gemm(mr, nkp, H, doh, H, 1, vhp, kNR, kNR * H, dS, kBk, false);
        for (int64_t r = 0; r < mqp; ++r) {
          float* prow = P + r * kBk;
          float* p8row = P8 + r * kBk;
          float* dsrow = dS + r * kBk;
          const int64_t i = i0 + r;
          int64_t lo = 0, hi = 0;
          if (r >= r_lo && r < mr) mk.interval(i, &lo, &hi);
          const float lse = (hi > lo) ? a.lse[(b * d.T + i) * d.N + n] : -kInf;
          const int64_t clo = std::max<int64_t>(lo - j0, 0);
          const int64_t chi = std::min<int64_t>(hi - j0, nk);
          if (clo >= chi || lse == -kInf) {
            std::memset(prow, 0, sizeof(float) * nkp);
            std::memset(p8row, 0, sizeof(float) * nkp);
            std::memset(dsrow, 0, sizeof(float) * nkp);
            continue;
          }
          const V8 vlse = vset1(lse);
          const V8 vdelta = vset1(a.delta[(b * d.T + i) * d.N + n]);
          for (int64_t cc = 0; cc < nkp; cc += 8) {
            V8 p = vexp(vsub(vmul(vload(prow + cc), vscale), vlse));
            vstore(prow + cc, p);
          }
          if (clo > 0 || chi < nkp) {
            for (int64_t cc = 0; cc < clo; ++cc) prow[cc] = 0.0f;
            for (int64_t cc = chi; cc < nkp; ++cc) prow[cc] = 0.0f;
          }
          for (int64_t cc = 0; cc < nkp; cc += 8) {
            V8 p = vload(prow + cc);
            vstore(p8row + cc, vround_e4m3(vclamp448(vmul(p, v256))));
            vstore(dsrow + cc, vmul(p, vsub(vload(dsrow + cc), vdelta)));
          }
        }
        // dS to MX twice: blocks of 32 keys (for dQ) and of 32 queries (for dK).
        mxqd_rows(dS, mr, nkp, kBk, dSk, kBk);
        mxqd_cols(dS, mqp, nkp, kBk, dSq, kBk);
        // dQ_tile = dS_k K_s; added (times scale) in this key tile's turn: other key tiles add
        // to the block too.
        gemm(mr, H, nkp, dSk, kBk, 1, ks, H, kNR, dQl, H, false);
        {
          const int64_t e0 = ((b * d.T + i0) * d.N + n) * H;
          const int64_t blk = (b * d.N + n) * c.nqt + qt;
          wait_dq_turn(c, blk, kt);
          for (int64_t r = r_lo; r < mr; ++r) {
            float* dqrow = a.dq + e0 + r * d.N * H;
            const float* src = dQl + r * H;
            for (int64_t h = 0; h < H; h += 8)
              vstore(dqrow + h, vfma(vload(src + h), vscale, vload(dqrow + h)));
          }
          c.dq_turn[blk].store(static_cast<int32_t>(kt + 1), std::memory_order_release);
        }
        // dK += dS_q^T Q_t; dV += (256 P8)^T dO_t (A transposed through its strides).
        gemm(nk, H, mr, dSq, 1, kBk, c.qt + q_off + i0 * H, H, kNR, dK, H, true);
        gemm(nk, H, mr, P8, 1, kBk, c.dot + q_off + i0 * H, H, kNR, dV, H, true);
      }
      pass_dq_turns(c, b, n, qt_hi, c.nqt, kt);
    }
  }
  // Write dK * scale and dV / 256 (zeros for keys without gradient).
  const V8 vscale = vset1(a.scale), vinv = vset1(kInvPScale);
  for (int64_t jj = 0; jj < nkeys_out; ++jj) {
    const int64_t e = ((b * d.S + j0 + jj) * d.K + g) * H;
    if (jj < nk) {
      for (int64_t h = 0; h < H; h += 8) {
        vstore(a.dk + e + h, vmul(vload(dK + jj * H + h), vscale));
        vstore(a.dv + e + h, vmul(vload(dV + jj * H + h), vinv));
      }
    } else {
      std::memset(a.dk + e, 0, sizeof(float) * H);
      std::memset(a.dv + e, 0, sizeof(float) * H);
    }
  }
}

void bwd_item(const BwdCtx& c, int64_t item) {
  try {
    bwd_item_body(c, item);
  } catch (...) {
    c.failed->store(true);  // the items waiting for this one's dQ turns must not wait forever
    throw;
  }
}

}  // namespace

// ================================== public helpers ==================================
float e4m3_to_f32(uint8_t b) { return e4m3_table().v[b]; }

uint8_t f32_to_e4m3(float x) {
  const uint32_t u = f2u(x);
  const uint8_t s = static_cast<uint8_t>((u >> 24) & 0x80);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return s | 0x7F;         // NaN
  if (a >= f2u(kE4M3Max)) return s | 0x7E;      // saturate (inf included)
  if (a < f2u(0.015625f)) {                     // below 2^-6: e4m3 subnormals, step 2^-9
    volatile float t = u2f(a) + 16384.0f;       // RNE to a multiple of 2^-9
    const float r = t - 16384.0f;
    return s | static_cast<uint8_t>(static_cast<int>(r * 512.0f));  // 8 -> 0x08 = 2^-6
  }
  const uint32_t r = (a + 0x7FFFFu + ((a >> 20) & 1u)) & 0xFFF00000u;
  const uint32_t e = (r >> 23) - 120u, m = (r >> 20) & 7u;
  return s | static_cast<uint8_t>((e << 3) | m);
}

uint8_t e8m0_from_amax(float amax) {
  if (std::isnan(amax)) return 255;
  const uint32_t bits = f2u(std::fabs(amax) * kInv448);
  uint32_t byte = ((bits >> 23) & 0xFFu) + ((bits & 0x7FFFFFu) != 0 ? 1u : 0u);
  return static_cast<uint8_t>(std::min(byte, 254u));
}

float e8m0_to_f32(uint8_t b) {
  if (b == 255) return kNaN;
  return std::ldexp(1.0f, static_cast<int>(b) - 127);
}

void mx_quantize_dequantize_rows(const float* x, int64_t rows, int64_t cols, int64_t ld,
                                 float* out) {
  mxqd_rows(x, rows, cols, ld, out, ld);
}
void mx_quantize_dequantize_cols(const float* x, int64_t rows, int64_t cols, int64_t ld,
                                 float* out) {
  mxqd_cols(x, rows, cols, ld, out, ld);
}
void round_to_e4m3(const float* x, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) vstore(out + i, vround_e4m3(vclamp448(vload(x + i))));
  for (; i < n; ++i) out[i] = round_e4m3_scalar(std::min(std::max(x[i], -kE4M3Max), kE4M3Max));
}

int num_threads() { return pool().size(); }

bool parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return true;
  ScopedFlushDenormal ftz;
  if (n == 1 || pool().size() == 1) {
    Job j;
    j.fn = &fn;
    j.n = n;
    drain(&j);
    return !j.failed.load();
  }
  return pool().Run(n, fn);
}

bool mx_attention_forward(const ForwardArgs& a) {
  const Dims& d = a.d;
  if (d.batch == 0 || d.T == 0 || d.N == 0) return true;
  FwdCtx c;
  c.a = &a;
  c.G = d.N / d.K;
  c.Spad = round_up(std::max<int64_t>(d.S, 1), kBk);
  c.nqt = ceil_div(d.T, kBq);
  const size_t kvn = static_cast<size_t>(d.batch * d.K) * c.Spad * d.H;
  FloatBuf kp, vf;
  if (!kp.alloc(kvn) || !vf.alloc(kvn)) return false;
  c.kp = kp.p;
  c.vf = vf.p;
  const int64_t Spad = c.Spad;
  float *kpp = kp.p, *vfp = vf.p;
  if (d.S > 0) {
    if (!parallel_for(d.batch * d.K * (Spad / kBk),
                      [&](int64_t it) { fwd_prepass_item(a, Spad, kpp, vfp, it); }))
      return false;
  }
  return parallel_for(d.batch * d.N * c.nqt, [&](int64_t it) { fwd_item(c, it); });
}

bool mx_attention_backward(const BackwardArgs& a) {
  const Dims& d = a.d;
  if (d.batch == 0) return true;
  const size_t dkn = static_cast<size_t>(d.batch * d.S * d.K * d.H);
  if (d.T == 0 || d.S == 0 || d.N == 0) {
    std::memset(a.dq, 0, sizeof(float) * static_cast<size_t>(d.batch * d.T * d.N * d.H));
    std::memset(a.dk, 0, sizeof(float) * dkn);
    std::memset(a.dv, 0, sizeof(float) * dkn);
    return true;
  }
  BwdCtx c;
  c.a = &a;
  c.G = d.N / d.K;
  c.Tpad = round_up(d.T, kBq);
  c.Spad = round_up(d.S, kBk);
  c.nqt = c.Tpad / kBq;
  c.nkt = c.Spad / kBk;
  const size_t qn = static_cast<size_t>(d.batch * d.N) * c.Tpad * d.H;
  const size_t kn = static_cast<size_t>(d.batch * d.K) * c.Spad * d.H;
  FloatBuf qh, qt, doh, dot, khp, vhp, ks;
  if (!qh.alloc(qn) || !qt.alloc(qn) || !doh.alloc(qn) || !dot.alloc(qn) || !khp.alloc(kn) ||
      !vhp.alloc(kn) || !ks.alloc(kn))
    return false;
  c.qh = qh.p;
  c.qt = qt.p;
  c.doh = doh.p;
  c.dot = dot.p;
  c.khp = khp.p;
  c.vhp = vhp.p;
  c.ks = ks.p;
  const size_t n_blk = static_cast<size_t>(d.batch * d.N * c.nqt);
  std::unique_ptr<std::atomic<int32_t>[]> dq_turn(new (std::nothrow) std::atomic<int32_t>[n_blk]);
  if (!dq_turn) return false;
  for (size_t i = 0; i < n_blk; ++i) dq_turn[i].store(0, std::memory_order_relaxed);
  std::atomic<bool> failed{false};
  c.dq_turn = dq_turn.get();
  c.failed = &failed;
  const int64_t n_pre = d.batch * d.N * c.nqt + d.batch * d.K * c.nkt;
  if (!parallel_for(n_pre, [&](int64_t it) {
        bwd_prepass_item(a, c, qh.p, qt.p, doh.p, dot.p, khp.p, vhp.p, ks.p, it);
      }))
    return false;
  return parallel_for(d.batch * d.K * c.nkt, [&](int64_t it) { bwd_item(c, it); });
}

}  // namespace cpu
}  // namespace jax_fa4
