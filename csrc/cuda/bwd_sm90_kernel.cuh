// The sm_90a MX attention backward kernel (FA3's structure: one CTA per key tile, dK and dV in
// registers, dQ accumulated across CTAs in fp32).
//   warpgroup 0 (producer): one thread loads K and V of the CTA's 128 keys once (TMA), then streams
//     the (Q, dO) tiles of 64 queries, with their lse and delta rows, through a kStages ring.
//   warpgroups 1, 2 (consumers): 64 keys each. Per query tile:
//     S^T = K Q^T and dP^T = V dO^T (SS wgmma, K-major along H);
//     P^T = exp2(S^T * scale log2e - lse log2e) (0 where masked), dS^T = P^T (dP^T - delta);
//     dV += P8^T dO with P8 = e4m3(P * 256) (the recipe's fixed P scale; /256 in the epilogue),
//     dK += dS^T Q (RS wgmma: P^T / dS^T straight from the accumulator registers, dO / Q N-major);
//     dS^T -> shared memory (bf16), then dQ = dS K (SS, both operands MN-major) and fp32 atomics
//     into dQ, or, with `deterministic`, adds ordered across the key tiles by a per-tile counter.
// Operands: bf16 holding exact dequantized MX values (q, k blocked along H, v and dO along H), so
// every product is exact up to fp32 summation order; dS is rounded to bf16 (8 significant bits,
// finer than the recipe's MX e4m3). Masks: mask.cuh (lengths, causal, windows).
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>
#include "cuda/bwd_wgmma_ops.cuh"
#include "cuda/mask.cuh"
#include "cuda/sm90_ptx.cuh"
#include "cuda/tile_config.cuh"

namespace jax_fa4::sm90 {

struct BwdParams {
  int B, T, S, N, Kh, H;  // leading batch dims are folded into B
  int group;              // N / Kh
  int T_pad;              // row length of lse2 / delta (a multiple of the query tile)
  int num_m_blocks;       // ceil(T / BM)
  const float* lse2;      // [B, N, T_pad] lse * log2(e); +inf where the row has no keys or is padding
  const float* delta;     // [B, N, T_pad] rowsum(O * dO); 0 past T
  const int32_t* q_len;   // [B]
  const int32_t* kv_len;  // [B]
  float* dq;              // [B, T, N, H] fp32, zeroed by the launcher; unscaled (dS K)
  float* dk;              // [B, S, Kh, H] fp32 (scale applied)
  float* dv;              // [B, S, Kh, H] fp32
  int32_t* sem;           // [B, N, num_m_blocks] zeroed; used when deterministic
  int deterministic;
  float scale;            // softmax scale (dK's factor)
  float scale_log2;       // softmax scale * log2(e)
  MaskParams mask;
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

template <int H>
__global__ void __launch_bounds__(kThreads, 1)
    bwd_sm90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                    const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_do,
                    const BwdParams p) {
  using Cfg = BwdTileConfig<H>;
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, ST = Cfg::kStages, HV = Cfg::kHV, SW = Cfg::kSw;
  constexpr int ATOMS = Cfg::kAtoms;

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint8_t* sK = smem;
  uint8_t* sV = sK + Cfg::kKBytes;
  uint8_t* sQ = sV + Cfg::kKBytes;        // ST tiles
  uint8_t* sdO = sQ + ST * Cfg::kQBytes;  // ST tiles
  uint8_t* sdS = sdO + ST * Cfg::kQBytes; // 2 buffers
  float* sLse = reinterpret_cast<float*>(sdS + 2 * Cfg::kDSBytes);  // ST x BM
  float* sDelta = sLse + ST * BM;                                   // ST x BM
  uint64_t* bars = reinterpret_cast<uint64_t*>(sDelta + ST * BM);
  uint64_t* bar_kv = bars;
  uint64_t* bar_full = bars + 1;
  uint64_t* bar_empty = bars + 1 + ST;

  const int n_tile = blockIdx.x;  // key tile: fastest grid index, so tile j-1 launches before j
  const int k0 = n_tile * BN;
  const int kh = blockIdx.y / Cfg::kChunks;
  const int h0 = (blockIdx.y % Cfg::kChunks) * HV;  // this CTA's dK / dV / dQ columns
  const int b = blockIdx.z;
  const int q_len = min(max(p.q_len[b], 0), p.T);
  const int kv_len = min(max(p.kv_len[b], 0), p.S);
  int m_lo, m_hi;
  query_range<BM, BN>(k0, q_len, kv_len, p.mask, m_lo, m_hi);
  const int n_m = m_hi - m_lo;
  const int n_iters = n_m * p.group;  // (query head of the group, query tile) pairs, heads outer

  if (threadIdx.x == 0) {
    mbar_init(bar_kv, 1);
    for (int s = 0; s < ST; ++s) {
      mbar_init(&bar_full[s], 1);
      mbar_init(&bar_empty[s], kNumConsumerWG * 4);
    }
    fence_barrier_init();
  }
  __syncthreads();

  const int wg = threadIdx.x / kWarpgroupThreads;
  if (wg == static_cast<int>(WarpRole::kProducer)) {
    setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0 && n_iters > 0) {
      tma_prefetch_desc(&tm_q);
      tma_prefetch_desc(&tm_k);
      tma_prefetch_desc(&tm_v);
      tma_prefetch_desc(&tm_do);
      mbar_arrive_expect_tx(bar_kv, 2 * Cfg::kKBytes);
#pragma unroll
      for (int c = 0; c < ATOMS; ++c) {
        tma_load_4d(sK + c * BN * SW, &tm_k, bar_kv, c * SW, k0, kh, b);
        tma_load_4d(sV + c * BN * SW, &tm_v, bar_kv, c * SW, k0, kh, b);
      }
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
    }
    return;
  }

  setmaxnreg_inc<kConsumerRegs>();
  const int cw = wg - 1;  // keys [k0 + 64 cw, k0 + 64 cw + 64)
  const int t = threadIdx.x % kWarpgroupThreads;
  const int warp = t / 32, lane = t % 32;
  const int gid = lane / 4, tq = lane % 4;
  const int key_loc[2] = {cw * 64 + warp * 16 + gid, cw * 64 + warp * 16 + gid + 8};  // within the tile

  float dv[HV / 2], dk[HV / 2];
#pragma unroll
  for (int i = 0; i < HV / 2; ++i) {
    dv[i] = 0.f;
    dk[i] = 0.f;
  }
  if (n_iters > 0) mbar_wait(bar_kv, 0);
  const uint32_t k_base = smem_u32(sK), v_base = smem_u32(sV);

  for (int it = 0; it < n_iters; ++it) {
    const int s = it % ST;
    const int n_head = kh * p.group + it / n_m;
    const int m_block = m_lo + it % n_m;
    const int m0 = m_block * BM;
    const uint32_t q_base = smem_u32(sQ + s * Cfg::kQBytes), do_base = smem_u32(sdO + s * Cfg::kQBytes);
    mbar_wait(&bar_full[s], (it / ST) & 1);

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
    wgmma_wait<1>();
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) reg_fence(sc[i]);

    // ---- P^T (fp32) and P8 as the register A operand of dV. Accumulator element i of n-group j:
    // key key_loc[(i >> 1) & 1], query m0 + 8 j + 2 tq + (i & 1).
    const bool full = tile_is_full<BM, BN>(m0, n_tile, kv_len, p.mask);
    const float* lse_s = sLse + s * BM;
    const float* del_s = sDelta + s * BM;
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {
      const float2 l2 = *reinterpret_cast<const float2*>(lse_s + 8 * j + 2 * tq);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float lv = (e & 1) ? l2.y : l2.x;
        float pv = exp2_approx(fmaf(sc[4 * j + e], p.scale_log2, -lv));
        if (!full) {
          const int row = m0 + 8 * j + 2 * tq + (e & 1);
          const int key = k0 + key_loc[(e >> 1) & 1];
          if (!key_allowed(row, key, kv_len, p.mask)) pv = 0.f;
        }
        sc[4 * j + e] = pv;
      }
    }
    uint32_t pa[BM / 16][4];
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) pa[kk][r] = pack_p8_bf16x2(sc[8 * kk + 2 * r], sc[8 * kk + 2 * r + 1]);

    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) reg_fence(dp[i]);
    // ---- dS^T = P^T (dP^T - delta), exactly 0 where masked (a NaN in a masked V must not leak).
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {
      const float2 d2 = *reinterpret_cast<const float2*>(del_s + 8 * j + 2 * tq);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float ds = sc[4 * j + e] * (dp[4 * j + e] - ((e & 1) ? d2.y : d2.x));
        if (!full) {
          const int row = m0 + 8 * j + 2 * tq + (e & 1);
          const int key = k0 + key_loc[(e >> 1) & 1];
          if (!key_allowed(row, key, kv_len, p.mask)) ds = 0.f;
        }
        dp[4 * j + e] = ds;
      }
    }
    uint32_t dsa[BM / 16][4];
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) dsa[kk][r] = pack_bf16x2(dp[8 * kk + 2 * r], dp[8 * kk + 2 * r + 1]);

    // ---- dV += P8^T dO and dK += dS^T Q over this tile's BM queries (B N-major: the HV columns
    // from h0 run along the 128-byte rows, one 64-column atom every BM * 128 bytes).
#pragma unroll
    for (int i = 0; i < HV / 2; ++i) {
      reg_fence(dv[i]);
      reg_fence(dk[i]);
    }
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        reg_fence(pa[kk][r]);
        reg_fence(dsa[kk][r]);
      }
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      const uint64_t db = make_desc_mn128(do_base + (h0 / 64) * BM * SW + kk * 16 * SW, BM * SW);
      BwdMma<HV>::rs_n(dv, pa[kk], db, 1);
    }
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      const uint64_t db = make_desc_mn128(q_base + (h0 / 64) * BM * SW + kk * 16 * SW, BM * SW);
      BwdMma<HV>::rs_n(dk, dsa[kk], db, 1);
    }
    wgmma_commit();

    // ---- dS^T -> shared memory (bf16, [keys][BM queries], 128B-swizzled rows) for dQ = dS K.
    // Register r of k-step kk holds (key key_loc[r & 1], queries 16 kk + 8 (r >> 1) + 2 tq + {0, 1}).
    uint8_t* ds_buf = sdS + (it & 1) * Cfg::kDSBytes;
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int key = key_loc[r & 1];
        const int chunk16 = 2 * kk + (r >> 1);  // 16-byte chunk of the row (8 queries)
        const uint32_t off = key * SW + ((chunk16 ^ (key & 7)) << 4) + tq * 4;
        *reinterpret_cast<uint32_t*>(ds_buf + off) = dsa[kk][r];
      }
    // The generic-proxy stores must be visible to the wgmma (async proxy) reads of both consumers.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("bar.sync 1, 256;" ::: "memory");

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
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < 32; ++i) reg_fence(dq[i]);
#pragma unroll
    for (int i = 0; i < HV / 2; ++i) {
      reg_fence(dv[i]);
      reg_fence(dk[i]);
    }
    // Q, dO, lse and delta of stage s are no longer read by this warp.
    __syncwarp();
    if (lane == 0) mbar_arrive(&bar_empty[s]);

    // ---- dQ adds. Accumulator element i of n-group j: query m0 + 16 warp + gid + 8 ((i >> 1) & 1),
    // column q_col + 8 j + 2 tq + (i & 1).
    int32_t* sem = p.sem + ((int64_t)b * p.N + n_head) * p.num_m_blocks + m_block;
    int rank = 0;
    if (p.deterministic) {
      rank = n_tile - first_key_tile<BM, BN>(m0, p.mask);
      if (threadIdx.x == kWarpgroupThreads) {
        int v;
        do {
          asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(sem) : "memory");
        } while (v != rank);
      }
      asm volatile("bar.sync 2, 256;" ::: "memory");
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = m0 + warp * 16 + gid + 8 * h;
      if (row < p.T) {
        float* dst = p.dq + (((int64_t)b * p.T + row) * p.N + n_head) * p.H + q_col + 2 * tq;
#pragma unroll
        for (int j = 0; j < 8; ++j)
          atomicAdd(reinterpret_cast<float2*>(dst + 8 * j), make_float2(dq[4 * j + 2 * h], dq[4 * j + 2 * h + 1]));
      }
    }
    if (p.deterministic) {
      __threadfence();
      asm volatile("bar.sync 2, 256;" ::: "memory");
      if (threadIdx.x == kWarpgroupThreads) asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(sem) : "memory");
    }
  }

  // ---- Epilogue: dK * scale, dV / 256 (P8 carried the factor 256), fp32, rows < S.
  const float inv256 = 1.f / 256.f;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = k0 + key_loc[h];
    if (key >= p.S) continue;
    const int64_t base = (((int64_t)b * p.S + key) * p.Kh + kh) * p.H + h0 + 2 * tq;
#pragma unroll
    for (int j = 0; j < HV / 8; ++j) {
      *reinterpret_cast<float2*>(p.dk + base + 8 * j) =
          make_float2(dk[4 * j + 2 * h] * p.scale, dk[4 * j + 2 * h + 1] * p.scale);
      *reinterpret_cast<float2*>(p.dv + base + 8 * j) =
          make_float2(dv[4 * j + 2 * h] * inv256, dv[4 * j + 2 * h + 1] * inv256);
    }
  }
}

}  // namespace jax_fa4::sm90
