// Masks of the forward kernel: per-batch lengths, causal (top-left aligned) and sliding windows.
// key j is allowed for query row i iff j < kv_len && i - left <= j <= i + right, where an absent
// bound is kUnbounded and causal is right = min(right, 0).
#pragma once
#include <cstdint>

namespace jax_fa4::sm90 {

constexpr int kUnbounded = 1 << 30;

// 1, as a value the compiler cannot see through. The backward runs its per-element mask on
// boundary tiles only, as a loop of `full ? 0 : opaque_one()` trips: written as `if (!full)
// mask(...)`, ptxas if-converted the mask into predicated instructions (key tests packed into a bit
// mask, a select per element: ~300 per query tile and thread) that every tile issued, full or not;
// a loop whose trip count it cannot see stays behind a branch (-3% backward time, H100). The
// forward keeps its `if` (~130 predicated instructions per key tile): the loop there cost a spill
// per key tile in the 160-register three-consumer kernel and measured 4-7% slower.
__device__ __forceinline__ int opaque_one() {
  int v;
  asm volatile("mov.u32 %0, 1;" : "=r"(v));
  return v;
}

struct MaskParams {
  int left;   // kUnbounded if none
  int right;  // kUnbounded if none; causal folds in as min(right, 0)
};

// The launchers' encoding: window bounds -1 = unbounded (clamped below kUnbounded), causal folded
// into the right bound.
inline MaskParams make_mask_params(int64_t window_left, int64_t window_right, bool causal) {
  MaskParams mk;
  mk.left = window_left < 0 ? kUnbounded : (int)(window_left < kUnbounded - 1 ? window_left : kUnbounded - 1);
  mk.right = window_right < 0 ? kUnbounded : (int)(window_right < kUnbounded - 1 ? window_right : kUnbounded - 1);
  if (causal && mk.right > 0) mk.right = 0;
  return mk;
}

// The key-tile range [n_lo, n_hi) a query tile [m0, m0 + BM) needs. Rows >= q_len give 0 output,
// so the range is computed over the valid rows only; an empty range means "write zeros".
template <int BM, int BN>
__device__ __forceinline__ void tile_range(int m0, int q_len, int kv_len, MaskParams mk, int& n_lo, int& n_hi) {
  int m_last = min(m0 + BM, q_len) - 1;
  if (m_last < m0 || kv_len <= 0) { n_lo = 0; n_hi = 0; return; }
  long long hi_key = kv_len;
  if (mk.right < kUnbounded) hi_key = min(hi_key, (long long)m_last + mk.right + 1);
  long long lo_key = 0;
  if (mk.left < kUnbounded) lo_key = max(0LL, (long long)m0 - mk.left);
  if (hi_key <= lo_key) { n_lo = 0; n_hi = 0; return; }
  n_lo = (int)(lo_key / BN);
  n_hi = (int)((hi_key + BN - 1) / BN);
}

// True when every (row, key) of the tile pair is allowed, so the per-element mask can be skipped.
template <int BM, int BN>
__device__ __forceinline__ bool tile_is_full(int m0, int n, int kv_len, MaskParams mk) {
  int k0 = n * BN, k1 = n * BN + BN - 1;
  bool ok = k1 < kv_len;
  if (mk.right < kUnbounded) ok = ok && (k1 <= m0 + mk.right);          // first row is the tightest
  if (mk.left < kUnbounded) ok = ok && (k0 >= m0 + BM - 1 - mk.left);   // last row is the tightest
  return ok;
}

__device__ __forceinline__ bool key_allowed(int row, int key, int kv_len, MaskParams mk) {
  bool ok = key < kv_len;
  if (mk.right < kUnbounded) ok = ok && (key <= row + mk.right);
  if (mk.left < kUnbounded) ok = ok && (key >= row - mk.left);
  return ok;
}

}  // namespace jax_fa4::sm90
