// The sm_90a MX attention backward kernel (FA3's structure: one CTA per key tile, dK and dV in
// registers, dQ accumulated across CTAs in fp32).
//   warpgroup 0 (producer): one thread streams the (Q, dO) tiles of 64 queries, with their lse and
//     delta rows, through a kStages ring (TMA).
//   warpgroups 1, 2 (consumers): first, all 256 threads dequantize K and V of the CTA's 128 keys from
//     MX (e4m3 + E8M0 block bytes) into the swizzled bf16 tiles (once per CTA; dequant_kv_tile), so
//     no bf16 copy of K or V exists in global memory. Then 64 keys each. Per query tile:
//     S^T = K Q^T and dP^T = V dO^T (SS wgmma, K-major along H);
//     P^T = exp2(S^T * scale log2e - lse log2e) (0 where masked), dS^T = P^T (dP^T - delta);
//     dV += P8^T dO with P8 = e4m3(P * 256) (the recipe's fixed P scale; /256 in the epilogue),
//     dK += dS^T Q (RS wgmma: P^T / dS^T straight from the accumulator registers, dO / Q N-major);
//     dS^T -> shared memory (bf16), then dQ = dS K (SS, both operands MN-major); each consumer
//     stores its fp32 dQ tile to shared memory and warp 1 of the producer warpgroup adds it to the
//     launch's fp32 dQ accumulator (one chunk of batches x kv heads, launcher) with TMA reduce-add
//     (H = 256, short of shared memory: fp32 atomics from registers);
//     with `deterministic`, the adds are ordered across the key tiles by a per-tile counter.
// Operands: bf16 holding exact dequantized MX values (q, k blocked along H, v and dO along H), so
// every product is exact up to fp32 summation order; dS is rounded as the recipe rounds it (MX
// e4m3, blocked along T for dK and along S for dQ), online in registers, and held as the exact bf16
// values of that rounding. Masks: mask.cuh (lengths, causal, windows).
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cstdint>
#include "cuda/bwd_wgmma_ops.cuh"
#include "cuda/mask.cuh"
#include "cuda/mx_math.cuh"
#include "cuda/sm90_ptx.cuh"
#include "cuda/tile_config.cuh"

namespace jax_fa4::sm90 {

// Phase timestamps for measurement builds only (-DJAX_FA4_BWD_TRACE, scripts/trace_bwd.py): thread 0
// of each consumer warpgroup of one CTA writes clock64() at 16 points of each of its first 32 query
// tiles. Normal builds compile none of it.
#ifdef JAX_FA4_BWD_TRACE
constexpr int kBwdTraceTile = 40, kBwdTraceHead = 3, kBwdTraceIters = 32, kBwdTracePoints = 16;
// (defined here: bwd_sm90_launch.cu is the only translation unit that includes this header)
__device__ unsigned long long g_bwd_trace[2][kBwdTraceIters][kBwdTracePoints];
#define JAX_FA4_BWD_TRACE_AT(it, k) \
  do { if (trace_on && (it) < kBwdTraceIters) g_bwd_trace[cw][(it)][(k)] = clock64(); } while (0)
#else
#define JAX_FA4_BWD_TRACE_AT(it, k) do {} while (0)
#endif

struct BwdParams {
  int B, T, S, N, Kh, H;  // leading batch dims are folded into B
  int group;              // N / Kh
  int T_pad;              // row length of lse2 / delta (a multiple of the query tile)
  int num_m_blocks;       // ceil(T / BM)
  const float* lse2;      // [B, N, T_pad] lse * log2(e); +inf where the row has no keys or is padding
  const float* delta;     // [B, N, T_pad] rowsum(O * dO); 0 past T
  const int32_t* q_len;   // [B]
  const int32_t* kv_len;  // [B]
  int b0, kh0;            // the launch's first batch and kv head (the launcher's dQ chunks)
  int dq_N;               // heads of the dQ accumulator (the launch's kv heads x group)
  float* dq;              // [launch batches, T, dq_N, H] fp32 accumulator of the launch's heads,
                          // zeroed by the launcher; unscaled (dS K)
  void* dk;               // [B, S, Kh, H] (scale applied), fp32 / bf16 / fp16 as dkv_type
  void* dv;               // [B, S, Kh, H]
  int dkv_type;           // 0 fp32, 1 bf16, 2 fp16 (launch.h FloatType)
  int32_t* sem;           // [B, N, column chunks, num_m_blocks] zeroed; used when deterministic
  int deterministic;
  int tiles_slowest;      // grid (kv head x column chunk, key tile, batch) instead of (key tile, ...)
  float scale;            // softmax scale (dK's factor)
  float scale_log2;       // softmax scale * log2(e)
  MaskParams mask;
  const uint8_t* k8;      // [B, S, Kh, H] e4m3, K blocked along H (16-byte aligned: launcher checks)
  const uint8_t* ks;      // [B, S, Kh, H / 32] E8M0 scale bytes of k8
  const uint8_t* v8;      // [B, S, Kh, H] e4m3, V blocked along H
  const uint8_t* vs;      // [B, S, Kh, H / 32] E8M0 scale bytes of v8
};

// MN-major shared-memory descriptor, 128B swizzle: the M/N axis runs along the 128-byte rows (64
// bf16), `lbo` bytes between consecutive 64-element atoms of it; the K axis runs down the rows, 8
// rows (1024 bytes) per core-matrix group (PTX ISA "matrix descriptor": for MN-major swizzled
// layouts the leading offset steps along M/N, the stride offset along K).
__device__ __forceinline__ uint64_t make_desc_mn128(uint32_t smem_addr, uint32_t lbo) {
  uint64_t d = 0;
  d |= (uint64_t)((smem_addr & 0x3FFFF) >> 4);
  d |= (uint64_t)((lbo >> 4) & 0x3FFF) << 16;
  d |= (uint64_t)(1024 >> 4) << 32;
  d |= (uint64_t)1 << 62;
  return d;
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// P * 256 rounded to e4m3 (saturating, as the forward's P), as an exact bf16 pair.
__device__ __forceinline__ uint32_t pack_p8_bf16x2(float p_lo, float p_hi) {
  const float2 f = e4m3x2_to_float2(cvt_e4m3x2(p_lo * 256.f, p_hi * 256.f));
  return pack_bf16x2(f.x, f.y);
}

// Two adjacent outputs of dK / dV in the caller's gradient dtype (one rounding from fp32).
__device__ __forceinline__ void store_pair(void* base, int64_t i, int type, float x, float y) {
  if (type == 1) {
    *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(base) + i) = __floats2bfloat162_rn(x, y);
  } else if (type == 2) {
    *reinterpret_cast<__half2*>(static_cast<__half*>(base) + i) = __floats2half2_rn(x, y);
  } else {
    *reinterpret_cast<float2*>(static_cast<float*>(base) + i) = make_float2(x, y);
  }
}

// The deterministic order of dQ adds: the counter of (batch, head, column chunk, query tile) counts
// the key tiles that have added; key tile n_tile adds when it reads its rank. Column chunks add
// disjoint columns, so each chunk has its own counter.
__device__ __forceinline__ void dq_order_acquire(const int32_t* sem, int rank) {
  int v;
  do {
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(sem) : "memory");
  } while (v != rank);
}
__device__ __forceinline__ void dq_order_release(int32_t* sem) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(sem) : "memory");
}

// The query-tile range [m_lo, m_hi) whose rows meet keys [k0, k0 + BN): the exact interval test of
// the mask band (row - left <= key <= row + right, key < kv_len, row < q_len), so that it agrees
// with the forward's tile_range on which (query tile, key tile) pairs interact.
template <int BM, int BN>
__device__ __forceinline__ void query_range(int k0, int q_len, int kv_len, MaskParams mk, int& m_lo, int& m_hi) {
  m_lo = 0;
  m_hi = 0;
  if (k0 >= kv_len || q_len <= 0) return;
  const long long k1 = min(k0 + BN, kv_len) - 1;
  long long row_lo = 0, row_hi = q_len - 1;
  if (mk.right < kUnbounded) row_lo = max(0LL, (long long)k0 - mk.right);
  if (mk.left < kUnbounded) row_hi = min(row_hi, k1 + mk.left);
  if (row_hi < row_lo) return;
  m_lo = (int)(row_lo / BM);
  m_hi = (int)(row_hi / BM) + 1;
}

// The first key tile that meets query tile m (the order counter of the deterministic dQ adds starts
// there). Key tiles meeting a query tile are contiguous, and every one of them runs that tile.
template <int BM, int BN>
__device__ __forceinline__ int first_key_tile(int m0, MaskParams mk) {
  if (mk.left >= kUnbounded) return 0;
  const long long lo = (long long)m0 - mk.left;
  return lo <= 0 ? 0 : (int)(lo / BN);
}

// 0 for this thread's accumulator elements (S^T / dS^T layout: element 4 j + e is key
// key_loc[(e >> 1) & 1], query m0 + 8 j + 2 tq + (e & 1)) that the mask removes. Boundary tiles only.
template <int BM>
__device__ __forceinline__ void mask_zero(float* x, int m0, int k0, const int* key_loc, int kv_len, MaskParams mk,
                                          int tq) {
#pragma unroll
  for (int j = 0; j < BM / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (!key_allowed(m0 + 8 * j + 2 * tq + (e & 1), k0 + key_loc[(e >> 1) & 1], kv_len, mk)) x[4 * j + e] = 0.f;
}

// The CTA's work: the query tiles [m_lo, m_lo + n_m) that meet its key tile, for each of the
// group's query heads (n_iters pairs, heads outer). Each role computes it after its setmaxnreg:
// computed once before the role split, n_iters left the uniform registers at H = 256 once the
// producer no longer issued the K / V loads, and ptxas spilled it around the consumers' loop.
struct BwdWork {
  int kv_len, m_lo, n_m, n_iters;
};
template <int BM, int BN>
__device__ __forceinline__ BwdWork bwd_work(const BwdParams& p, int b, int k0) {
  const int q_len = min(max(p.q_len[b], 0), p.T);
  const int kv_len = min(max(p.kv_len[b], 0), p.S);
  int m_lo, m_hi;
  query_range<BM, BN>(k0, q_len, kv_len, p.mask, m_lo, m_hi);
  return {kv_len, m_lo, m_hi - m_lo, (m_hi - m_lo) * p.group};
}

// K or V of the CTA's key tile, MX -> the bf16 tile the consumers' wgmmas read, written by the 256
// consumer threads (t = 0..255) with generic-proxy stores. The bytes are those the TMA load of the
// bf16 copy (exact_rows' output: dequant8_bf16 of the same e4m3 bytes and scale byte) wrote before:
//   * layout: the tile is kAtoms column atoms of 64 bf16 (128 bytes) x BN rows, atom a at a * BN * 128;
//     in each, row r's 16-byte chunk c (bf16 columns 64 a + 8 c .. + 7) sits at
//     r * 128 + ((c ^ (r & 7)) << 4): the TMA 128B swizzle of a box of 128-byte rows written to a
//     1024-byte aligned address (the swizzle XORs address bits [4:6] with bits [7:9]);
//     tests/test_bwd_kv_dequant_layout.py models both and compares them;
//   * rows at or past S (the last tile's padding) are zero bytes, as the TMA unit's out-of-bounds
//     fill made them (OOB_FILL_NONE: zeros); rows below S are read whatever kv_len says, as the TMA
//     load read them;
//   * values: dequant8_bf16 (mx_math.cuh), exact_rows_kernel's own function, on the same 8 e4m3
//     bytes and the same scale byte (element e of a row has byte e / 32 of the row's H / 32).
// Thread t takes 16 consecutive elements (one 16-byte load; both halves share a 32-element block
// and so one scale byte) of kRowsPerPass rows apart: group g = t % (H / 16) of rows
// t / (H / 16) + i * kRowsPerPass. A warp then reads whole 64- to 256-byte rows (coalesced). All the
// loads are issued before the first store (H / 32 x 16 B each of K and V per thread: <= 64 data
// registers at H = 256, while nothing else is live yet).
template <int H>
struct KvDequant {
  using Cfg = BwdTileConfig<H>;
  static constexpr int kGroups = H / 16;                       // 16-element groups per row
  static constexpr int kRowsPerPass = kNumConsumerWG * kWarpgroupThreads / kGroups;
  static constexpr int kPasses = Cfg::kBlockN / kRowsPerPass;  // H / 32
  static_assert(kRowsPerPass * kPasses == Cfg::kBlockN, "the consumers cover the key tile exactly");
  static_assert(Cfg::kSw == 128 && Cfg::kRowBytes == 2 * H, "128-byte swizzle rows of bf16");
};

template <int H>
__device__ __forceinline__ void dequant_kv_tile(uint8_t* sK, uint8_t* sV, const BwdParams& p, int b, int kh, int k0,
                                                int t) {
  using D = KvDequant<H>;
  constexpr int BN = D::Cfg::kBlockN;
  const int g = t % D::kGroups;
  const int r0 = t / D::kGroups;
  const int rows = min(BN, p.S - k0) - r0;  // passes i with i * kRowsPerPass < rows are rows below S
  // This thread's first row, (b, k0 + r0, kh) of [B * S * Kh] rows.
  const int64_t row = ((int64_t)b * p.S + k0 + r0) * p.Kh + kh;
  const int64_t step = (int64_t)D::kRowsPerPass * p.Kh;  // rows between passes
  const uint4* kp = reinterpret_cast<const uint4*>(p.k8 + row * H) + g;
  const uint4* vp = reinterpret_cast<const uint4*>(p.v8 + row * H) + g;
  const uint8_t* ksp = p.ks + row * (H / 32) + g / 2;
  const uint8_t* vsp = p.vs + row * (H / 32) + g / 2;
  uint4 kd[D::kPasses], vd[D::kPasses];
  uint32_t kb[D::kPasses], vb[D::kPasses];
#pragma unroll
  for (int i = 0; i < D::kPasses; ++i) {
    kd[i] = vd[i] = make_uint4(0u, 0u, 0u, 0u);
    kb[i] = vb[i] = 0u;
    if (i * D::kRowsPerPass < rows) {
      kd[i] = __ldg(kp + i * step * (H / 16));
      vd[i] = __ldg(vp + i * step * (H / 16));
      kb[i] = __ldg(ksp + i * step * (H / 32));
      vb[i] = __ldg(vsp + i * step * (H / 32));
    }
  }
  const int atom = g / 4, c0 = 2 * (g % 4), odd = atom & 1;
#pragma unroll
  for (int i = 0; i < D::kPasses; ++i) {
    const int r = r0 + i * D::kRowsPerPass;
    const bool live = i * D::kRowsPerPass < rows;
    const uint32_t base = atom * BN * 128 + r * 128;
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      uint8_t* const dst = m == 0 ? sK : sV;
      const uint4 w = m == 0 ? kd[i] : vd[i];
      const uint32_t sb = m == 0 ? kb[i] : vb[i];
      const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
      const uint4 lo = live ? prep::dequant8_bf16(w.x, w.y, sb) : zero;  // elements 16 g .. 16 g + 7
      const uint4 hi = live ? prep::dequant8_bf16(w.z, w.w, sb) : zero;  // elements 16 g + 8 .. + 15
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int h = j ^ odd;  // 0: lo (chunk c0), 1: hi (chunk c0 + 1)
        const uint32_t off = base + (((c0 + h) ^ (r & 7)) << 4);
        *reinterpret_cast<uint4*>(dst + off) = h ? hi : lo;
      }
    }
  }
}

// The CTA's query tile `it` (head kh * group + it / n_m, query tile m_lo + it % n_m): its Q and dO
// rows (bf16, TMA, 128B swizzle) and its lse / delta rows into stage it % ST. One elected thread.
// (The default kernel's producer keeps its own copy of these lines: calling this helper there moved
// its SASS at H = 128, and the default kernels are kept bit for bit until a GPU has run a change.)
template <int H>
__device__ __forceinline__ void load_query_tile(const BwdParams& p, const CUtensorMap* tm_q, const CUtensorMap* tm_do,
                                                uint8_t* sQ, uint8_t* sdO, float* sLse, float* sDelta,
                                                uint64_t* bar_full, int it, int kh, int b, int m_lo, int n_m) {
  using Cfg = BwdTileConfig<H>;
  constexpr int BM = Cfg::kBlockM, ST = Cfg::kStages, SW = Cfg::kSw;
  const int s = it % ST;
  const int n_head = kh * p.group + it / n_m;
  const int m0 = (m_lo + it % n_m) * BM;
  mbar_arrive_expect_tx(&bar_full[s], 2 * Cfg::kQBytes + 2 * BM * 4);
#pragma unroll
  for (int c = 0; c < Cfg::kAtoms; ++c) {
    tma_load_4d(sQ + s * Cfg::kQBytes + c * BM * SW, tm_q, &bar_full[s], c * SW, m0, n_head, b);
    tma_load_4d(sdO + s * Cfg::kQBytes + c * BM * SW, tm_do, &bar_full[s], c * SW, m0, n_head, b);
  }
  const int64_t row = ((int64_t)b * p.N + n_head) * p.T_pad + m0;
  bulk_load(sLse + s * BM, p.lse2 + row, BM * 4, &bar_full[s]);
  bulk_load(sDelta + s * BM, p.delta + row, BM * 4, &bar_full[s]);
}

// Shared-memory pointers and mbarriers of one CTA that the dQ warpgroup uses.
struct BwdDQWGSmem {
  uint8_t *sK, *sQ, *sdO, *sdS, *sdQ;
  float *sLse, *sDelta;
  uint64_t *bar_full, *bar_empty;      // the (Q, dO, lse, delta) ring
  uint64_t *bar_ds_full, *bar_ds_empty;  // the two dS^T buffers: stored by both consumers / read by dQ
};

// Warpgroup 0 of the dQ-warpgroup variant (bwd_sm90_kernel<H, true>, H <= 128). Thread 0 streams
// the query tiles as the default producer does, as far ahead as the ring allows; the warpgroup
// computes dQ[BM x HV] = dS K of each query tile over all BN keys from the consumers' dS^T buffer
// (A = dS: M = queries along the dS^T rows, K = keys down them; B = K likewise), in passes of PN
// columns (one PN / 2-register accumulator each: tile_config.cuh says why PN = 32 at H = 128), into
// the shared fp32 dQ tile, and thread 32 adds it to the global dQ with TMA reduce-add, ordered across
// key tiles when deterministic (the default kernel's writer). At H = 128 each column's dQ is the
// default kernel's product (same keys, same k16 steps, same order); at H = 64 one 128-key product
// replaces the default kernel's two 64-key partials (one per consumer, both reduce-added): other
// bits, half the reduce-add traffic.
template <int H>
__device__ __forceinline__ void dq_warpgroup(const CUtensorMap* tm_q, const CUtensorMap* tm_do,
                                             const CUtensorMap* tm_dq, const BwdParams& p, const BwdDQWGSmem& sm,
                                             int kh, int b, int chunk, int n_tile, int dq_b, int dq_n0) {
  using Cfg = BwdTileConfig<H>;
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, ST = Cfg::kStages, SW = Cfg::kSw;
  constexpr int HV = Cfg::kHV, PN = Cfg::kDQWGPassN;
  constexpr int kHalf = BM * 128;  // one 32-column fp32 half of the dQ tile: BM rows of 128 bytes
  static_assert(Cfg::kDQWGFits, "the dQ warpgroup fits the register file at H <= 128 only (tile_config.cuh)");
  static_assert(HV % PN == 0 && PN % 32 == 0 && (PN <= 64), "passes are whole 32-column halves of one 64-column atom");
  static_assert((HV / 32) * kHalf <= Cfg::kDQBytes, "the dQ tile must fit the shared dQ buffer");
  const int k0 = n_tile * BN;
  const BwdWork work = bwd_work<BM, BN>(p, b, k0);
  const int m_lo = work.m_lo, n_m = work.n_m, n_iters = work.n_iters;
  if (n_iters == 0) return;
  const int t = threadIdx.x, warp = t / 32, lane = t % 32, gid = lane / 4, tq = lane % 4;
  if (t == 0) {
    tma_prefetch_desc(tm_q);
    tma_prefetch_desc(tm_do);
    for (int it = 0; it < ST && it < n_iters; ++it)
      load_query_tile<H>(p, tm_q, tm_do, sm.sQ, sm.sdO, sm.sLse, sm.sDelta, sm.bar_full, it, kh, b, m_lo, n_m);
  } else if (t == 32) {
    tma_prefetch_desc(tm_dq);
  }
  const uint32_t k_base = smem_u32(sm.sK);
  for (int it = 0; it < n_iters; ++it) {
    const int n_head = kh * p.group + it / n_m;
    const int m_block = m_lo + it % n_m;
    const int m0 = m_block * BM;
    const uint32_t ds_base = smem_u32(sm.sdS + (it & 1) * Cfg::kDSBytes);
    mbar_wait(&sm.bar_ds_full[it & 1], (it >> 1) & 1);  // both consumers' dS^T of this tile stored
#pragma unroll 1
    for (int pass = 0; pass < HV / PN; ++pass) {
      float dq[PN / 2];
#pragma unroll
      for (int i = 0; i < PN / 2; ++i) reg_fence(dq[i]);
      // B = K's columns [PN pass, PN pass + PN): 64-column atom (PN pass) / 64, at byte (PN pass % 64) * 2
      // of its 128-byte rows (the 128B swizzle XORs address bits 4..6 with 7..9, so a start 64 bytes
      // into the rows reads chunks 4..7 where the TMA-style layout put them).
      const uint32_t b_cols = k_base + (pass * PN / 64) * BN * SW + (pass * PN % 64) * 2;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        const uint64_t da = make_desc_mn128(ds_base + kk * 16 * SW, BN * SW);
        const uint64_t db = make_desc_mn128(b_cols + kk * 16 * SW, BN * SW);
        BwdMma<PN>::ss_mn(dq, da, db, kk > 0 ? 1 : 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < PN / 2; ++i) reg_fence(dq[i]);
      // Every thread arrives (an arrive orders only its own thread's reads: the stage-release note).
      if (pass == HV / PN - 1) mbar_arrive(&sm.bar_ds_empty[it & 1]);
      if (pass == 0) {
        // Producer duty, outside any wgmma in flight (a branch between an issue and its wait made
        // ptxas serialise the k-steps and spill the accumulators): the consumers release this
        // tile's stage once their dV and dK of it are done, right after the dS^T stores that let
        // this warpgroup in, and are by then on tile it + 1, loaded a tile earlier; tile it + ST
        // goes into the stage.
        if (t == 0 && it + ST < n_iters) {
          mbar_wait(&sm.bar_empty[it % ST], (((it + ST) / ST) & 1) ^ 1);
          load_query_tile<H>(p, tm_q, tm_do, sm.sQ, sm.sdO, sm.sLse, sm.sDelta, sm.bar_full, it + ST, kh, b, m_lo, n_m);
        }
        __syncwarp();  // bar.sync and wgmma are warp-aligned: warp 0 reconverges after thread 0's loads
        // The writer passes this barrier only after its previous reduce-add has read the dQ tile.
        asm volatile("bar.sync 7, 128;" ::: "memory");
      }
      // Accumulator element i of n-group j: query m0 + 16 warp + gid + 8 ((i >> 1) & 1), column
      // PN pass + 8 j + 2 tq + (i & 1); the layout is the default kernel's dQ tile (32-column halves
      // of 128-byte rows, 128B swizzle: 16-byte chunk ^ (row & 7); float2 stores).
#pragma unroll
      for (int j = 0; j < PN / 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int col = pass * PN + 8 * j;
          const int r = warp * 16 + gid + 8 * h;
          const int chunk16 = ((col % 32) / 8) * 2 + tq / 2;
          const uint32_t off = (col / 32) * kHalf + r * 128 + ((chunk16 ^ (r & 7)) << 4) + (tq & 1) * 8;
          *reinterpret_cast<float2*>(sm.sdQ + off) = make_float2(dq[4 * j + 2 * h], dq[4 * j + 2 * h + 1]);
        }
    }
    fence_proxy_async_shared();  // the generic-proxy stores before the TMA unit's reads
    asm volatile("bar.sync 7, 128;" ::: "memory");
    if (t == 32) {
      int32_t* sem = p.sem + (((int64_t)b * p.N + n_head) * Cfg::kChunks + chunk) * p.num_m_blocks + m_block;
      if (p.deterministic) {
        dq_order_acquire(sem, n_tile - first_key_tile<BM, BN>(m0, p.mask));
        fence_proxy_async_global();
      }
#pragma unroll
      for (int half = 0; half < HV / 32; ++half)
        tma_reduce_add_4d(tm_dq, sm.sdQ + half * kHalf, 32 * half, m0, n_head - dq_n0, dq_b);
      bulk_commit();
      if (p.deterministic) {
        bulk_wait<0>();
        fence_proxy_async_global();
        dq_order_release(sem);
      } else {
        bulk_wait_read<0>();
      }
    }
    __syncwarp();  // warp 1 reconverges after the writer's thread
  }
  if (t == 32) bulk_wait<0>();
}

// kDQWG: the dQ-warpgroup variant (opt-in, H <= 128; tile_config.cuh and dq_warpgroup above).
template <int H, bool kDQWG = false>
__global__ void __launch_bounds__(kThreads, 1)
    bwd_sm90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_do,
                    const __grid_constant__ CUtensorMap tm_dq, const BwdParams p) {
  using Cfg = BwdTileConfig<H>;
  static_assert(!kDQWG || Cfg::kDQWGFits, "the dQ-warpgroup variant exists at H <= 128 only (tile_config.cuh)");
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, ST = Cfg::kStages, HV = Cfg::kHV, SW = Cfg::kSw;
  constexpr int ATOMS = Cfg::kAtoms;
  constexpr bool kDQSmem = Cfg::kDQViaSmem;
  constexpr int kDQTile = BM * 64 * 4;  // one consumer's fp32 dQ tile: two 32-column halves of BM x 128 B

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint8_t* sK = smem;
  uint8_t* sV = sK + Cfg::kKBytes;
  uint8_t* sQ = sV + Cfg::kKBytes;        // ST tiles
  uint8_t* sdO = sQ + ST * Cfg::kQBytes;  // ST tiles
  uint8_t* sdS = sdO + ST * Cfg::kQBytes; // 2 buffers
  uint8_t* sdQ = sdS + 2 * Cfg::kDSBytes;  // kNumConsumerWG dQ tiles (when kDQSmem)
  float* sLse = reinterpret_cast<float*>(sdQ + (kDQSmem ? Cfg::kDQBytes : 0));  // ST x BM
  float* sDelta = sLse + ST * BM;                                               // ST x BM
  uint8_t* sXchg = reinterpret_cast<uint8_t*>(sDelta + ST * BM);  // [consumer][warp][BM / 2] u16x2 scale-byte words
  // (the dQ-warpgroup variant holds two exchange buffers, one per query-tile parity)
  uint64_t* bars = reinterpret_cast<uint64_t*>(sXchg + (kDQWG ? 2 : 1) * Cfg::kXchgBytes);
  uint64_t* bar_full = bars;
  uint64_t* bar_empty = bars + ST;
  uint64_t* bar_dq_full = bars + 2 * ST;       // both consumers' dQ tiles stored (every thread arrives)
  uint64_t* bar_dq_empty = bars + 1 + 2 * ST;  // the reduce-add has read the dQ tiles
  uint64_t* bar_ds_full = bars + 2 + 2 * ST;   // kDQWG, per dS^T buffer: both consumers stored it
  uint64_t* bar_ds_empty = bars + 4 + 2 * ST;  // kDQWG, per dS^T buffer: the dQ warpgroup read it

  // Either order launches key tile j - 1 of a head before its tile j, which the deterministic dQ
  // order waits on. Under a causal mask key tile j's work shrinks with j, so the launcher makes the
  // key tile the slowest index (heaviest tiles of every head first, the light ones filling the tail).
  const int n_tile = p.tiles_slowest ? blockIdx.y : blockIdx.x;
  const int head_chunk = p.tiles_slowest ? blockIdx.x : blockIdx.y;
  const int k0 = n_tile * BN;
  const int kh = p.kh0 + head_chunk / Cfg::kChunks;
  const int chunk = head_chunk % Cfg::kChunks;
  const int h0 = chunk * HV;  // this CTA's dK / dV / dQ columns
  const int b = p.b0 + blockIdx.z;
  // The dQ accumulator holds only this launch's batches and heads (launcher: dQ in chunks).
  const int dq_b = blockIdx.z, dq_n0 = p.kh0 * p.group;

  if (threadIdx.x == 0) {
    for (int s = 0; s < ST; ++s) {
      mbar_init(&bar_full[s], 1);
      mbar_init(&bar_empty[s], kNumConsumerWG * kWarpgroupThreads);
    }
    mbar_init(bar_dq_full, kNumConsumerWG * kWarpgroupThreads);
    mbar_init(bar_dq_empty, 1);
    if constexpr (kDQWG) {
      for (int i = 0; i < 2; ++i) {
        mbar_init(&bar_ds_full[i], kNumConsumerWG * kWarpgroupThreads);
        mbar_init(&bar_ds_empty[i], kWarpgroupThreads);
      }
    }
    fence_barrier_init();
  }
  __syncthreads();

  const int wg = threadIdx.x / kWarpgroupThreads;
  if constexpr (kDQWG) {
    if (wg == static_cast<int>(WarpRole::kProducer)) {
      setmaxnreg_dec<Cfg::kDQWGProducerRegs>();
      const BwdDQWGSmem sm{sK, sQ, sdO, sdS, sdQ, sLse, sDelta, bar_full, bar_empty, bar_ds_full, bar_ds_empty};
      dq_warpgroup<H>(&tm_q, &tm_do, &tm_dq, p, sm, kh, b, chunk, n_tile, dq_b, dq_n0);
      return;
    }
  } else if (wg == static_cast<int>(WarpRole::kProducer)) {
    setmaxnreg_dec<kProducerRegs>();
    const BwdWork work = bwd_work<BM, BN>(p, b, k0);
    const int m_lo = work.m_lo, n_m = work.n_m, n_iters = work.n_iters;
    if (threadIdx.x == 0 && n_iters > 0) {
      tma_prefetch_desc(&tm_q);
      tma_prefetch_desc(&tm_do);
      for (int it = 0; it < n_iters; ++it) {
        const int s = it % ST;
        if (it >= ST) mbar_wait(&bar_empty[s], ((it / ST) & 1) ^ 1);
        const int n_head = kh * p.group + it / n_m;
        const int m0 = (m_lo + it % n_m) * BM;
        mbar_arrive_expect_tx(&bar_full[s], 2 * Cfg::kQBytes + 2 * BM * 4);
#pragma unroll
        for (int c = 0; c < ATOMS; ++c) {
          tma_load_4d(sQ + s * Cfg::kQBytes + c * BM * SW, &tm_q, &bar_full[s], c * SW, m0, n_head, b);
          tma_load_4d(sdO + s * Cfg::kQBytes + c * BM * SW, &tm_do, &bar_full[s], c * SW, m0, n_head, b);
        }
        const int64_t row = ((int64_t)b * p.N + n_head) * p.T_pad + m0;
        bulk_load(sLse + s * BM, p.lse2 + row, BM * 4, &bar_full[s]);
        bulk_load(sDelta + s * BM, p.delta + row, BM * 4, &bar_full[s]);
      }
    } else if (kDQSmem && threadIdx.x == 32 && n_iters > 0) {
      // dQ writer: per query tile, add both consumers' fp32 tiles to the global dQ (TMA reduce-add).
      tma_prefetch_desc(&tm_dq);
      for (int it = 0; it < n_iters; ++it) {
        const int n_head = kh * p.group + it / n_m;
        const int m_block = m_lo + it % n_m;
        const int m0 = m_block * BM;
        int32_t* sem = p.sem + (((int64_t)b * p.N + n_head) * Cfg::kChunks + chunk) * p.num_m_blocks + m_block;
        mbar_wait(bar_dq_full, it & 1);
        if (p.deterministic) {
          dq_order_acquire(sem, n_tile - first_key_tile<BM, BN>(m0, p.mask));
          fence_proxy_async_global();  // the acquired adds of earlier key tiles come before this one
        }
#pragma unroll
        for (int c = 0; c < kNumConsumerWG; ++c) {
          const int q_col = Cfg::kSplitKeysDQ ? h0 : h0 + 64 * c;
#pragma unroll
          for (int half = 0; half < 2; ++half)
            tma_reduce_add_4d(&tm_dq, sdQ + c * kDQTile + half * (kDQTile / 2), q_col + 32 * half, m0,
                              n_head - dq_n0, dq_b);
        }
        bulk_commit();
        if (p.deterministic) {
          bulk_wait<0>();              // the adds are performed in global memory ...
          fence_proxy_async_global();  // ... and ordered before the release of the next key tile
          dq_order_release(sem);
        } else {
          bulk_wait_read<0>();  // the tiles have been read: the consumers may store the next ones
        }
        mbar_arrive(bar_dq_empty);
      }
      bulk_wait<0>();
    }
    return;
  }

  setmaxnreg_inc<kDQWG ? Cfg::kDQWGConsumerRegs : kConsumerRegs>();
  const BwdWork work = bwd_work<BM, BN>(p, b, k0);
  const int kv_len = work.kv_len, m_lo = work.m_lo, n_m = work.n_m, n_iters = work.n_iters;
  const int cw = wg - 1;  // keys [k0 + 64 cw, k0 + 64 cw + 64)
  const int t = threadIdx.x % kWarpgroupThreads;
  const int warp = t / 32, lane = t % 32;
  const int gid = lane / 4, tq = lane % 4;
  const int key_loc[2] = {cw * 64 + warp * 16 + gid, cw * 64 + warp * 16 + gid + 8};  // within the tile
  // This thread's dS^T row offsets (key * 128 bytes) with its swizzle chunk base: key & 7 == gid, so
  // chunk j of the row sits at ds_row ^ (j << 4) (bits 4..6 hold only the chunk; SW == 128).
  const uint32_t ds_row[2] = {(uint32_t)(key_loc[0] * SW + (gid << 4) + tq * 4),
                              (uint32_t)(key_loc[1] * SW + (gid << 4) + tq * 4)};
  static_assert(SW == 128 && BM / 8 <= 8, "dS^T rows are one 128-byte swizzle row of <= 8 chunks");
  static_assert((Cfg::kDSBytes & (Cfg::kDSBytes - 1)) == 0 && Cfg::kDSBytes >= BN * SW,
                "the dS^T buffer index is XORed into the row offsets: a power of two above them");

  float dv[HV / 2], dk[HV / 2];
#pragma unroll
  for (int i = 0; i < HV / 2; ++i) {
    dv[i] = 0.f;
    dk[i] = 0.f;
  }
  // The dK / dV accumulators pinned in their registers across a wgmma issue or wait.
  auto fence_dkv = [&]() {
#pragma unroll
    for (int i = 0; i < HV / 2; ++i) {
      reg_fence(dv[i]);
      reg_fence(dk[i]);
    }
  };
  if (n_iters > 0) {
    dequant_kv_tile<H>(sK, sV, p, b, kh, k0, threadIdx.x - kWarpgroupThreads);
    // The generic-proxy stores must be visible to the wgmma (async proxy) reads of both consumers
    // (dQ = dS K reads all 128 keys of K): each writer fences its own stores, then the barrier.
    // Barrier 1 again serves the dS^T stores of every query tile; all 256 threads pass this use
    // before any reaches the next.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("bar.sync 1, 256;" ::: "memory");
  }
  const uint32_t k_base = smem_u32(sK), v_base = smem_u32(sV);
#ifdef JAX_FA4_BWD_TRACE
  const bool trace_on = t == 0 && n_tile == kBwdTraceTile && head_chunk == kBwdTraceHead && blockIdx.z == 0;
#endif

  for (int it = 0; it < n_iters; ++it) {
    const int s = it % ST;
    const int n_head = kh * p.group + it / n_m;
    const int m_block = m_lo + it % n_m;
    const int m0 = m_block * BM;
    const uint32_t q_base = smem_u32(sQ + s * Cfg::kQBytes), do_base = smem_u32(sdO + s * Cfg::kQBytes);
    JAX_FA4_BWD_TRACE_AT(it, 0);
    mbar_wait(&bar_full[s], (it / ST) & 1);
    JAX_FA4_BWD_TRACE_AT(it, 1);

    // ---- S^T = K Q^T and dP^T = V dO^T: 64 keys x BM queries each, contracting H.
    float sc[BM / 2], dp[BM / 2];
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) {
      reg_fence(sc[i]);
      reg_fence(dp[i]);
    }
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < H / 16; ++kk) {  // 32 bytes of each row per k-step
      const int atom = (kk * 32) / SW, within = (kk * 32) % SW;
      const uint64_t da = make_desc<SW>(k_base + atom * BN * SW + cw * 64 * SW + within);
      const uint64_t db = make_desc<SW>(q_base + atom * BM * SW + within);
      BwdMma<BM>::ss_kk(sc, da, db, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < H / 16; ++kk) {
      const int atom = (kk * 32) / SW, within = (kk * 32) % SW;
      const uint64_t da = make_desc<SW>(v_base + atom * BN * SW + cw * 64 * SW + within);
      const uint64_t db = make_desc<SW>(do_base + atom * BM * SW + within);
      BwdMma<BM>::ss_kk(dp, da, db, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
    JAX_FA4_BWD_TRACE_AT(it, 2);
    wgmma_wait<1>();
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) reg_fence(sc[i]);
    JAX_FA4_BWD_TRACE_AT(it, 3);

    // ---- P^T (fp32), in place of S^T. Accumulator element i of n-group j: key key_loc[(i >> 1) & 1],
    // query m0 + 8 j + 2 tq + (i & 1).
    // The mask on boundary tiles only, as loops of n_mask = 0 or 1 trips (mask.cuh, opaque_one: an
    // `if` was if-converted into ~150 predicated instructions per masked phase on every tile).
    const int n_mask = tile_is_full<BM, BN>(m0, n_tile, kv_len, p.mask) ? 0 : opaque_one();
    const float* lse_s = sLse + s * BM;
    const float* del_s = sDelta + s * BM;
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {
      const float2 l2 = *reinterpret_cast<const float2*>(lse_s + 8 * j + 2 * tq);
#pragma unroll
      for (int e = 0; e < 4; ++e)
        sc[4 * j + e] = exp2_approx(fmaf(sc[4 * j + e], p.scale_log2, -((e & 1) ? l2.y : l2.x)));
    }
    // (Tested per element inside the loop above, the mask compiled to a branch per element.)
#pragma unroll 1
    for (int r = 0; r < n_mask; ++r) mask_zero<BM>(sc, m0, k0, key_loc, kv_len, p.mask, tq);
    JAX_FA4_BWD_TRACE_AT(it, 4);
    wgmma_wait<0>();  // dP^T done
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) reg_fence(dp[i]);
    JAX_FA4_BWD_TRACE_AT(it, 5);

    // ---- P8 = e4m3(P * 256) as the register A operand of dV, and dS^T = P^T (dP^T - delta), exactly
    // 0 where masked (a NaN in a masked V must not leak), in one pass over the pairs: P's registers
    // free as P8's fill, so the consumers' peak is dK + dV + S^T + dP^T (tile_config.cuh).
    // Register r of k-step kk holds elements 8 kk + 2 r + {0, 1}: n-group j = 2 kk + (r >> 1),
    // queries 8 j + 2 tq + {0, 1}.
    uint32_t pa[BM / 16][4];
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = 8 * kk + 2 * r, j = 2 * kk + (r >> 1);
        const float2 d2 = *reinterpret_cast<const float2*>(del_s + 8 * j + 2 * tq);
        pa[kk][r] = pack_p8_bf16x2(sc[i], sc[i + 1]);
        dp[i] = sc[i] * (dp[i] - d2.x);
        dp[i + 1] = sc[i + 1] * (dp[i + 1] - d2.y);
      }
#pragma unroll 1
    for (int r = 0; r < n_mask; ++r) mask_zero<BM>(dp, m0, k0, key_loc, kv_len, p.mask, tq);
    JAX_FA4_BWD_TRACE_AT(it, 6);

    // ---- dV += P8^T dO, issued before dS is rounded so that the rounding runs while it does (B
    // N-major: the HV columns from h0 run along the 128-byte rows, one 64-column atom every BM * 128
    // bytes).
    fence_dkv();
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) reg_fence(pa[kk][r]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      const uint64_t db = make_desc_mn128(do_base + (h0 / 64) * BM * SW + kk * 16 * SW, BM * SW);
      BwdMma<HV>::rs_n(dv, pa[kk], db, 1);
    }
    wgmma_commit();
    JAX_FA4_BWD_TRACE_AT(it, 7);
    // ---- dS rounded as the recipe rounds it (NUMERICS.md section 3): MX e4m3 blocked along T for
    // dK = dS^T Q (here) and along S for dQ = dS K (below, while dK runs), held as the exact bf16
    // values of that rounding. The kernel first kept dS in bf16, finer than the recipe; on outlier
    // inputs that missed the contract on some seeds (1.05-1.08x the recipe's dQ / dK error, measured
    // on the H200 and reproduced in float64): the contract measures against the recipe's rounding.
    // T-blocks: key half kh2 (register bit 1) x query block qb (j in [4 qb, 4 qb + 4)); a thread holds
    // 8 of a block's 32 values, its quad (the 4 tq lanes) the rest.
    uint32_t dsa[BM / 16][4];
#pragma unroll
    for (int kh2 = 0; kh2 < 2; ++kh2)
#pragma unroll
      for (int qb = 0; qb < BM / 32; ++qb) {
        // (the block max as floats: prep::abs_max says why NaN blocks change no output)
        float amf[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float* a = dp + 4 * (4 * qb + 2 * h) + 2 * kh2;  // j = 4 qb + 2 h, then j + 1 (a + 4)
          amf[h] = fmaxf(prep::abs_max(a[0], a[1]), prep::abs_max(a[4], a[5]));
        }
        float am = fmaxf(amf[0], amf[1]);
        am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 1));
        am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 2));
        const prep::MxScale st = prep::mx_scale_of_byte(prep::online_scale_byte(__float_as_uint(am)));
#pragma unroll
        for (int j = 4 * qb; j < 4 * qb + 4; ++j) {
          const float2 v = prep::mx_round2(dp[4 * j + 2 * kh2], dp[4 * j + 2 * kh2 + 1], st);
          dsa[j >> 1][((j & 1) << 1) | kh2] = pack_bf16x2(v.x, v.y);  // register r of k-step kk: j = 2 kk + (r >> 1)
        }
      }

    JAX_FA4_BWD_TRACE_AT(it, 8);
    // ---- dK += dS^T Q over this tile's BM queries (RS: dS^T from the registers above).
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) reg_fence(dsa[kk][r]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      const uint64_t db = make_desc_mn128(q_base + (h0 / 64) * BM * SW + kk * 16 * SW, BM * SW);
      BwdMma<HV>::rs_n(dk, dsa[kk], db, 1);
    }
    wgmma_commit();
    JAX_FA4_BWD_TRACE_AT(it, 9);

    // ---- S-blocks of dS for dQ: the 32 keys of one query are this thread's 2 key halves, the 8 gid
    // lanes of its warp and the partner warp (warp ^ 1). The scale rule is monotone, so the block's
    // byte is the max of per-lane bytes: bytes of query slots 2 j, 2 j + 1 (queries 8 j + 2 tq + {0, 1})
    // travel as one u16x2 word through the shuffles and, between the two warps, shared memory.
    uint32_t bw[BM / 8];
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {
      const uint32_t b0 = prep::online_scale_byte(__float_as_uint(prep::abs_max(dp[4 * j], dp[4 * j + 2])));
      const uint32_t b1 = prep::online_scale_byte(__float_as_uint(prep::abs_max(dp[4 * j + 1], dp[4 * j + 3])));
      uint32_t w = b0 | (b1 << 16);
      w = prep::max_u16x2(w, __shfl_xor_sync(0xffffffffu, w, 4));
      w = prep::max_u16x2(w, __shfl_xor_sync(0xffffffffu, w, 8));
      w = prep::max_u16x2(w, __shfl_xor_sync(0xffffffffu, w, 16));
      bw[j] = w;
    }
    {
      uint8_t* xchg = kDQWG ? sXchg + (it & 1) * Cfg::kXchgBytes : sXchg;
      uint32_t* mine = reinterpret_cast<uint32_t*>(xchg) + (cw * 4 + warp) * (BM / 2);
      const uint32_t* other = reinterpret_cast<const uint32_t*>(xchg) + (cw * 4 + (warp ^ 1)) * (BM / 2);
      if (gid == 0) {
#pragma unroll
        for (int j = 0; j < BM / 8; ++j) mine[4 * j + tq] = bw[j];
      }
      // The two warps of a 32-key block (64 threads; ids 3..6). The partner reads these words before
      // it reaches barrier 1 below, and this warp writes the next tile's only after barrier 1. (kDQWG,
      // no barrier 1: a buffer per tile parity; this warp writes tile it + 2's words only after this
      // barrier of tile it + 1, which the partner reaches only after reading tile it's.)
      asm volatile("bar.sync %0, 64;" ::"r"(3 + 2 * cw + (warp >> 1)) : "memory");
#pragma unroll
      for (int j = 0; j < BM / 8; ++j) bw[j] = prep::max_u16x2(bw[j], other[4 * j + tq]);
    }

    JAX_FA4_BWD_TRACE_AT(it, 10);
    // ---- dS^T -> shared memory (bf16, [keys][BM queries], 128B-swizzled rows) for dQ = dS K.
    // Values dp[4 j + 2 kh2 + {0, 1}] are (key key_loc[kh2], queries 8 j + 2 tq + {0, 1}): 16-byte
    // chunk j of the key's row.
    uint8_t* ds_buf = sdS + (it & 1) * Cfg::kDSBytes;
    // kDQWG: the dQ warpgroup has read this buffer's previous tile (it - 2); in the default kernel
    // both consumers' own dQ of it - 2 waited on it, before barrier 1 of it - 1.
    if constexpr (kDQWG) {
      if (it >= 2) mbar_wait(&bar_ds_empty[it & 1], ((it >> 1) - 1) & 1);
    }
    // This tile's buffer folded into the row offsets: kDSBytes is a power of two above every offset.
    const uint32_t ds_off[2] = {ds_row[0] ^ ((it & 1) * Cfg::kDSBytes), ds_row[1] ^ ((it & 1) * Cfg::kDSBytes)};
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {
      const prep::MxScale s0 = prep::mx_scale_of_byte(bw[j] & 0xffffu), s1 = prep::mx_scale_of_byte(bw[j] >> 16);
#pragma unroll
      for (int kh2 = 0; kh2 < 2; ++kh2) {
        const float2 e = e4m3x2_to_float2(cvt_e4m3x2(dp[4 * j + 2 * kh2] * s0.down, dp[4 * j + 2 * kh2 + 1] * s1.down));
        // key * SW + ((j ^ (key & 7)) << 4) + tq * 4, as one XOR of j into bits 4..6 of ds_row
        *reinterpret_cast<uint32_t*>(sdS + (ds_off[kh2] ^ (j << 4))) = pack_bf16x2(e.x * s0.up, e.y * s1.up);
      }
    }
    // The generic-proxy stores must be visible to the wgmma (async proxy) reads of both consumers.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    if constexpr (kDQWG) {
      // Hand the tile to the dQ warpgroup and go on: no barrier with the other consumer.
      mbar_arrive(&bar_ds_full[it & 1]);
      JAX_FA4_BWD_TRACE_AT(it, 11);
      wgmma_wait<0>();  // dV and dK done: Q, dO, lse and delta of stage s are no longer read
      fence_dkv();
      mbar_arrive(&bar_empty[s]);  // every consumer thread (the stage-release note below)
      JAX_FA4_BWD_TRACE_AT(it, 13);
      continue;
    }
    asm volatile("bar.sync 1, 256;" ::: "memory");
    JAX_FA4_BWD_TRACE_AT(it, 11);

    // ---- dQ[BM x 64] = dS K: A = dS (M = queries along the rows of dS^T, K = keys down them),
    // B = K (N = columns along its rows, K = keys down them).
    float dq[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) reg_fence(dq[i]);
    const int q_col = Cfg::kSplitKeysDQ ? h0 : h0 + 64 * cw;      // first dQ column of this consumer
    constexpr int kKSteps = Cfg::kSplitKeysDQ ? 4 : BN / 16;       // 16 keys per k-step
    const int ks0 = Cfg::kSplitKeysDQ ? 4 * cw : 0;
    const uint32_t ds_base = smem_u32(ds_buf);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      const uint64_t da = make_desc_mn128(ds_base + (ks0 + kk) * 16 * SW, BN * SW);
      const uint64_t db = make_desc_mn128(k_base + (q_col / 64) * BN * SW + (ks0 + kk) * 16 * SW, BN * SW);
      BwdMma<64>::ss_mn(dq, da, db, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
    JAX_FA4_BWD_TRACE_AT(it, 12);
    wgmma_wait<1>();  // dV and dK done: Q, dO, lse and delta of stage s are no longer read
    fence_dkv();
    // Every consumer thread arrives (as CUTLASS's pipelines do): an arrive releases only its own
    // thread's reads, so one arrive per warp after __syncwarp would leave the other lanes' lse /
    // delta reads unordered, by the letter of the PTX memory model, against the producer's next
    // copy into the stage (compute-sanitizer racecheck reported exactly that).
    mbar_arrive(&bar_empty[s]);
    JAX_FA4_BWD_TRACE_AT(it, 13);
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < 32; ++i) reg_fence(dq[i]);
    JAX_FA4_BWD_TRACE_AT(it, 14);

    // Accumulator element i of n-group j: query m0 + 16 warp + gid + 8 ((i >> 1) & 1), column
    // q_col + 8 j + 2 tq + (i & 1).
    if constexpr (kDQSmem) {
      // ---- dQ tile -> shared memory for the writer's TMA reduce-add: two 32-column halves, each
      // BM rows of 128 bytes, 128B-swizzled as the tensor map expects (16-byte chunk ^ (row & 7));
      // a warp's float2 stores then fill every bank twice (two wavefronts, no conflicts).
      if (it > 0) mbar_wait(bar_dq_empty, (it - 1) & 1);
      uint8_t* tile = sdQ + cw * kDQTile;
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = warp * 16 + gid + 8 * h;
          const int chunk16 = (j % 4) * 2 + tq / 2;
          const uint32_t off = (j / 4) * (kDQTile / 2) + r * 128 + ((chunk16 ^ (r & 7)) << 4) + (tq & 1) * 8;
          *reinterpret_cast<float2*>(tile + off) = make_float2(dq[4 * j + 2 * h], dq[4 * j + 2 * h + 1]);
        }
      fence_proxy_async_shared();
      mbar_arrive(bar_dq_full);
      JAX_FA4_BWD_TRACE_AT(it, 15);
    } else {
      // ---- dQ adds from registers (fp32 atomics), ordered across key tiles when deterministic.
      int32_t* sem = p.sem + (((int64_t)b * p.N + n_head) * Cfg::kChunks + chunk) * p.num_m_blocks + m_block;
      if (p.deterministic) {
        if (threadIdx.x == kWarpgroupThreads) dq_order_acquire(sem, n_tile - first_key_tile<BM, BN>(m0, p.mask));
        asm volatile("bar.sync 2, 256;" ::: "memory");
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = m0 + warp * 16 + gid + 8 * h;
        if (row < p.T) {
          float* dst = p.dq + (((int64_t)dq_b * p.T + row) * p.dq_N + (n_head - dq_n0)) * p.H + q_col + 2 * tq;
#pragma unroll
          for (int j = 0; j < 8; ++j)
            atomicAdd(reinterpret_cast<float2*>(dst + 8 * j), make_float2(dq[4 * j + 2 * h], dq[4 * j + 2 * h + 1]));
        }
      }
      if (p.deterministic) {
        __threadfence();
        asm volatile("bar.sync 2, 256;" ::: "memory");
        if (threadIdx.x == kWarpgroupThreads) dq_order_release(sem);
      }
    }
  }

  // ---- Epilogue: dK * scale, dV / 256 (P8 carried the factor 256), rows < S, in the gradient dtype.
  const float inv256 = 1.f / 256.f;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = k0 + key_loc[h];
    if (key >= p.S) continue;
    const int64_t base = (((int64_t)b * p.S + key) * p.Kh + kh) * p.H + h0 + 2 * tq;
#pragma unroll
    for (int j = 0; j < HV / 8; ++j) {
      store_pair(p.dk, base + 8 * j, p.dkv_type, dk[4 * j + 2 * h] * p.scale, dk[4 * j + 2 * h + 1] * p.scale);
      store_pair(p.dv, base + 8 * j, p.dkv_type, dv[4 * j + 2 * h] * inv256, dv[4 * j + 2 * h + 1] * inv256);
    }
  }
}

}  // namespace jax_fa4::sm90
