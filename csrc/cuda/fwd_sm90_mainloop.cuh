// The sm_90a MXFP8 attention forward kernel: FA3's structure in FP8.
//   warpgroup 0 (producer): one elected thread issues TMA loads of Q (once), and of K, the key
//     scales and V^T per key tile into a kStages-deep ring of shared-memory stages, on mbarriers.
//   warpgroups 1, 2 (consumers): 64 query rows each. Per key tile: S = Q K^T (SS wgmma, fp8),
//     scale by the per-key K scale, mask, online softmax (fp32, base 2, P*256 directly),
//     P -> e4m3 in registers, O += P V (RS wgmma, P as the register A operand), release the stage.
// Two score paths (kExact):
//   FP8 scores (kExact = false): Q and K e4m3 from mx_prep.cuh, each row on one power-of-two scale;
//     Q's scale folds into the softmax row factor, K's is one FMUL per score. Fastest, but FP8
//     wgmma sums its products with fewer bits than fp32 (docs/HOPPER_FORWARD.md, "Accuracy").
//   Exact scores (kExact = true): Q and K as bf16 holding the dequantized MX values (exact: an e4m3
//     value times a power of two fits bf16), Q K^T on bf16 wgmma with fp32 sums; no Q/K scales.
//     The contract's path: its scores are the recipe's up to fp32 summation order.
// Both: V transposed to [B, K, H, S_pad] (S contiguous, K-major for the PV wgmma) on one scale per
// head-dim column, which the epilogue applies.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <cmath>
#include "cuda/fwd_sm90_epilogue.cuh"
#include "cuda/fwd_sm90_params.cuh"
#include "cuda/fwd_sm90_softmax.cuh"
#include "cuda/mask.cuh"
#include "cuda/sm90_ptx.cuh"
#include "cuda/tile_config.cuh"
#include "cuda/wgmma_ops.cuh"

namespace jax_fa4::sm90 {

// kPipe selects the experimental overlapped consumer loop (a separate instantiation, so the default
// kernel's register allocation does not carry the variants' pressure).
template <int H, bool kPipe, bool kExact>
__global__ void __launch_bounds__(kThreads, 1)
    fwd_sm90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                    const __grid_constant__ CUtensorMap tm_v, const FwdParams p) {
  using Cfg = TileConfig<H, kExact ? 2 : 1>;
  static_assert(!(kPipe && kExact), "the experimental overlapped loop exists for FP8 scores only");
  constexpr int BM = kBlockM, BN = Cfg::kBlockN, ST = Cfg::kStages;
  constexpr int SWQK = Cfg::kSwQK, SWV = Cfg::kSwV;

  extern __shared__ uint8_t smem_raw[];
  // Swizzled tiles need 1024-byte aligned bases (the swizzle pattern is a function of the address).
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint8_t* sQ = smem;
  uint8_t* sK = sQ + Cfg::kQBytes;
  uint8_t* sV = sK + ST * Cfg::kKBytes;
  float* sKs = reinterpret_cast<float*>(sV + ST * Cfg::kVBytes);
  uint64_t* bars = reinterpret_cast<uint64_t*>(sKs + ST * BN);
  uint64_t* bar_q = bars;
  uint64_t* bar_k = bars + 1;            // K tile + key scales landed
  uint64_t* bar_v = bars + 1 + ST;       // V^T tile landed
  uint64_t* bar_empty = bars + 1 + 2 * ST;  // both consumers done with the stage (every consumer thread arrives)

  // Heaviest query tiles first under causal masks (their key ranges are the longest).
  const int m_block = p.num_m_blocks - 1 - blockIdx.x;
  const int m0 = m_block * BM;
  const int n_head = blockIdx.y;
  const int b = blockIdx.z;
  const int kh = n_head / p.group;
  const int q_len = min(max(p.q_len[b], 0), p.T);
  const int kv_len = min(max(p.kv_len[b], 0), p.S);
  int n_lo, n_hi;
  tile_range<BM, BN>(m0, q_len, kv_len, p.mask, n_lo, n_hi);
  const int n_tiles = n_hi - n_lo;

  if (threadIdx.x == 0) {
    mbar_init(bar_q, 1);
    for (int s = 0; s < ST; ++s) {
      mbar_init(&bar_k[s], 1);
      mbar_init(&bar_v[s], 1);
      mbar_init(&bar_empty[s], kNumConsumerWG * kWarpgroupThreads);
    }
    fence_barrier_init();
  }
  __syncthreads();

  const int wg = threadIdx.x / kWarpgroupThreads;
  if (wg == static_cast<int>(WarpRole::kProducer)) {
    setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0 && n_tiles > 0) {
      tma_prefetch_desc(&tm_q);
      tma_prefetch_desc(&tm_k);
      tma_prefetch_desc(&tm_v);
      mbar_arrive_expect_tx(bar_q, Cfg::kQBytes);
#pragma unroll
      for (int c = 0; c < Cfg::kChunksQK; ++c)
        tma_load_4d(sQ + c * BM * SWQK, &tm_q, bar_q, c * SWQK, m0, n_head, b);
      const float* ks_row = kExact ? nullptr : p.ks + ((int64_t)b * p.Kh + kh) * p.S_pad;
      for (int it = 0; it < n_tiles; ++it) {
        const int s = it % ST;
        const uint32_t phase = (it / ST) & 1;
        if (it >= ST) mbar_wait(&bar_empty[s], phase ^ 1);
        const int n = n_lo + it;
        // Exact scores have no key scales: the stage is the K tile alone.
        mbar_arrive_expect_tx(&bar_k[s], Cfg::kKBytes + (kExact ? 0 : BN * 4));
#pragma unroll
        for (int c = 0; c < Cfg::kChunksQK; ++c)
          tma_load_4d(sK + s * Cfg::kKBytes + c * BN * SWQK, &tm_k, &bar_k[s], c * SWQK, n * BN, kh, b);
        if constexpr (!kExact) bulk_load(sKs + s * BN, ks_row + n * BN, BN * 4, &bar_k[s]);
        mbar_arrive_expect_tx(&bar_v[s], Cfg::kVBytes);
        tma_load_4d(sV + s * Cfg::kVBytes, &tm_v, &bar_v[s], n * BN, 0, kh, b);
      }
    }
  } else {
    setmaxnreg_inc<kConsumerRegs>();
    const int cw = wg - 1;  // consumer index: query rows [m0 + 64*cw, m0 + 64*cw + 64)
    const int t = threadIdx.x % kWarpgroupThreads;
    const int warp = t / 32, lane = t % 32;
    const int gid = lane / 4, tq = lane % 4;
    int rows[2];
    rows[0] = m0 + cw * 64 + warp * 16 + gid;
    rows[1] = rows[0] + 8;
    float rfv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float q_scale = 1.f;  // exact scores: the bf16 values carry their own scale
      if constexpr (!kExact) q_scale = rows[r] < p.T ? p.qs[((int64_t)b * p.N + n_head) * p.T + rows[r]] : 1.f;
      float rf = q_scale * p.scale_log2;
      // A row on the smallest scale (2^-127) must not flush rf to zero: -inf * 0 would be NaN.
      rfv[r] = rf < 1.17549435e-38f ? 1.17549435e-38f : rf;  // (NaN stays NaN)
    }
    RowSoftmax<BN> sm;
    sm.init(rfv[0], rfv[1]);
    float o[H / 2];
#pragma unroll
    for (int i = 0; i < H / 2; ++i) o[i] = 0.f;

    if (n_tiles > 0) mbar_wait(bar_q, 0);
    const uint32_t q_base = smem_u32(sQ) + cw * 64 * SWQK;
    bool use_pipeline = false;
    if constexpr (kPipe && H <= 128) use_pipeline = n_tiles > 0;
    if constexpr (kPipe && H <= 128) {
      if (use_pipeline) {
        // Intra-warpgroup overlap (FA3): while the tensor cores run this tile's Q K^T and the
        // previous tile's P V, the warpgroup does the previous... (see the order below):
        //   issue S(it) = Q K(it)^T; issue T = P(it-1) V(it-1); wait S; softmax(it) on the CUDA
        //   cores while T is still in flight; wait T; O = O * alpha(it-1) + T; release stage it-1;
        //   pack P(it). Same arithmetic, same order as the sequential loop: bit-identical output.
        // H = 256 keeps the sequential loop (its tile accumulator does not fit beside S).
        float sc[BN / 2];
        uint32_t pa[BN / 32][4];
        float a_prev0 = 1.f, a_prev1 = 1.f;
        auto issue_qk = [&](int stage) {
          const uint32_t k_base = smem_u32(sK + stage * Cfg::kKBytes);
#pragma unroll
          for (int i = 0; i < BN / 2; ++i) reg_fence(sc[i]);
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < H / 32; ++kk) {
            const int chunk = (kk * 32) / SWQK, within = (kk * 32) % SWQK;
            const uint64_t da = make_desc<SWQK>(q_base + chunk * BM * SWQK + within);
            const uint64_t db = make_desc<SWQK>(k_base + chunk * BN * SWQK + within);
            Wgmma<BN>::ss(sc, da, db, kk > 0 ? 1 : 0);
          }
          wgmma_commit();
        };
        auto softmax_tile = [&](int stage, int n, float& a0, float& a1) {
#pragma unroll
          for (int i = 0; i < BN / 2; ++i) reg_fence(sc[i]);
          scale_by_keys<BN>(sc, sKs + stage * BN, tq);
          if (!tile_is_full<BM, BN>(m0, n, kv_len, p.mask)) mask_tile<BN>(sc, rows, n, kv_len, p.mask, tq);
          sm.step(sc, a0, a1);
        };
        // Variant bits (JAX_FA4_SM90_PIPELINE): 1 = this overlapped loop; 2 = also ping-pong the two
        // consumers with named barriers (FA3: one warpgroup issues its GEMMs while the other runs
        // softmax); 4 = accumulate P V straight into O (single-level, no tile accumulator: 64 fewer
        // live registers, no spills, but the fp8 accumulator drift of the first version).
        const bool pingpong = (p.pipelined & 2) != 0;
        const bool direct_o = (p.pipelined & 4) != 0;
        float ot[H / 2];
        auto issue_pv = [&](int stage, float* acc, bool accumulate) {
          const uint32_t v_base = smem_u32(sV + stage * Cfg::kVBytes);
#pragma unroll
          for (int i = 0; i < H / 2; ++i) reg_fence(acc[i]);
#pragma unroll
          for (int kk = 0; kk < BN / 32; ++kk)
#pragma unroll
            for (int i = 0; i < 4; ++i) reg_fence(pa[kk][i]);
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < BN / 32; ++kk) {
            const uint64_t dv = make_desc<SWV>(v_base + kk * 32);
            Wgmma<H>::rs(acc, pa[kk], dv, (accumulate || kk > 0) ? 1 : 0);
          }
          wgmma_commit();
        };
        // P(j) V(j) for the tile whose rescale factor is (a0, a1): into the tile accumulator (two-level)
        // or, with direct_o, into O after rescaling it first.
        auto start_pv = [&](int stage, float a0, float a1) {
          if (direct_o) {
#pragma unroll
            for (int j = 0; j < H / 8; ++j) {
              o[j * 4 + 0] *= a0;
              o[j * 4 + 1] *= a0;
              o[j * 4 + 2] *= a1;
              o[j * 4 + 3] *= a1;
            }
            issue_pv(stage, o, true);
          } else {
            issue_pv(stage, ot, false);
          }
        };
        auto finish_pv = [&](float a0, float a1) {
          if (direct_o) {
#pragma unroll
            for (int i = 0; i < H / 2; ++i) reg_fence(o[i]);
            return;
          }
#pragma unroll
          for (int i = 0; i < H / 2; ++i) reg_fence(ot[i]);
#pragma unroll
          for (int j = 0; j < H / 8; ++j) {
            o[j * 4 + 0] = fmaf(o[j * 4 + 0], a0, ot[j * 4 + 0]);
            o[j * 4 + 1] = fmaf(o[j * 4 + 1], a0, ot[j * 4 + 1]);
            o[j * 4 + 2] = fmaf(o[j * 4 + 2], a1, ot[j * 4 + 2]);
            o[j * 4 + 3] = fmaf(o[j * 4 + 3], a1, ot[j * 4 + 3]);
          }
        };
        // Ping-pong: consumer c issues a GEMM block only after the other consumer's bar.arrive on
        // barrier 1 + c (256 = this warpgroup's 128 syncing threads + the other's 128 arriving).
        // Blocks: {S(0)}, {S(j), PV(j-1)} for j = 1..n-1, {PV(n-1)}: n+1 per consumer. Consumer 1
        // opens with one arrive for consumer 0 and skips its last one, so every sync is matched.
        // (Immediate barrier ids: a register id makes ptxas reserve all 16 named barriers.)
        auto pp_sync = [&]() {
          if (!pingpong) return;
          if (cw == 0) asm volatile("bar.sync 1, 256;" ::: "memory");
          else asm volatile("bar.sync 2, 256;" ::: "memory");
        };
        auto pp_arrive = [&](bool last) {
          if (!pingpong) return;
          if (cw == 0) asm volatile("bar.arrive 2, 256;" ::: "memory");
          else if (!last) asm volatile("bar.arrive 1, 256;" ::: "memory");
        };
        if (pingpong && cw == 1) asm volatile("bar.arrive 1, 256;" ::: "memory");
        // Prologue: tile 0.
        mbar_wait(&bar_k[0], 0);
        pp_sync();
        issue_qk(0);
        pp_arrive(false);
        wgmma_wait<0>();
        softmax_tile(0, n_lo, a_prev0, a_prev1);
        pack_p<BN>(sc, pa);
        for (int it = 1; it < n_tiles; ++it) {
          const int s = it % ST, sp = (it - 1) % ST;
          const uint32_t phase = (it / ST) & 1, phase_p = ((it - 1) / ST) & 1;
          mbar_wait(&bar_k[s], phase);
          mbar_wait(&bar_v[sp], phase_p);
          pp_sync();
          issue_qk(s);
          start_pv(sp, a_prev0, a_prev1);
          pp_arrive(false);
          wgmma_wait<1>();  // S(it) done; PV(it-1) may still run
          float a0, a1;
          softmax_tile(s, n_lo + it, a0, a1);
          wgmma_wait<0>();
          finish_pv(a_prev0, a_prev1);
          mbar_arrive(&bar_empty[sp]);
          pack_p<BN>(sc, pa);
          a_prev0 = a0;
          a_prev1 = a1;
        }
        {  // Epilogue of the loop: the last tile's P V.
          const int sp = (n_tiles - 1) % ST;
          mbar_wait(&bar_v[sp], ((n_tiles - 1) / ST) & 1);
          pp_sync();
          start_pv(sp, a_prev0, a_prev1);
          pp_arrive(true);
          wgmma_wait<0>();
          finish_pv(a_prev0, a_prev1);
          mbar_arrive(&bar_empty[sp]);
        }
      }
    }
    for (int it = 0; it < (use_pipeline ? 0 : n_tiles); ++it) {
      const int s = it % ST;
      const uint32_t phase = (it / ST) & 1;
      const int n = n_lo + it;
      float sc[BN / 2];
      mbar_wait(&bar_k[s], phase);
      const uint32_t k_base = smem_u32(sK + s * Cfg::kKBytes);
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) reg_fence(sc[i]);
      if (kExact || !p.qk_promote) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < Cfg::kStepsQK; ++kk) {  // 32 bytes of each row per k-step
          const int chunk = (kk * 32) / SWQK, within = (kk * 32) % SWQK;
          const uint64_t da = make_desc<SWQK>(q_base + chunk * BM * SWQK + within);
          const uint64_t db = make_desc<SWQK>(k_base + chunk * BN * SWQK + within);
          if constexpr (kExact) Wgmma<BN>::ss_bf16(sc, da, db, kk > 0 ? 1 : 0);
          else Wgmma<BN>::ss(sc, da, db, kk > 0 ? 1 : 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
      } else {
        // Experimental (JAX_FA4_SM90_QK_PROMOTE=1): every 32-wide k-step into a fresh accumulator,
        // summed in fp32 on the CUDA cores, to measure how much of the score error comes from the
        // fp8 wgmma accumulator across k-steps (DeepSeek-V3's promotion, at interval 32).
        float st[BN / 2];
#pragma unroll
        for (int kk = 0; kk < H / 32; ++kk) {
          const int chunk = (kk * 32) / SWQK, within = (kk * 32) % SWQK;
          const uint64_t da = make_desc<SWQK>(q_base + chunk * BM * SWQK + within);
          const uint64_t db = make_desc<SWQK>(k_base + chunk * BN * SWQK + within);
          float* dst = kk == 0 ? sc : st;
#pragma unroll
          for (int i = 0; i < BN / 2; ++i) reg_fence(dst[i]);
          wgmma_fence();
          Wgmma<BN>::ss(dst, da, db, 0);
          wgmma_commit();
          wgmma_wait<0>();
#pragma unroll
          for (int i = 0; i < BN / 2; ++i) reg_fence(dst[i]);
          if (kk > 0) {
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) sc[i] += st[i];
          }
        }
      }
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) reg_fence(sc[i]);

      // FP8 scores: per-key scale of K (one FMUL per element: a per-tile scale would push small keys
      // of a tile with an outlier key into e4m3's subnormals). Then the mask on boundary tiles only.
      if constexpr (!kExact) scale_by_keys<BN>(sc, sKs + s * BN, tq);
      if (!tile_is_full<BM, BN>(m0, n, kv_len, p.mask)) mask_tile<BN>(sc, rows, n, kv_len, p.mask, tq);
      float alpha0, alpha1;
      sm.step(sc, alpha0, alpha1);
      uint32_t pa[BN / 32][4];
      pack_p<BN>(sc, pa);
      mbar_wait(&bar_v[s], phase);
      const uint32_t v_base = smem_u32(sV + s * Cfg::kVBytes);
      // Two-level accumulation: this tile's P V goes to a fresh wgmma accumulator, which is then
      // added in fp32 (fused with the online-softmax rescale: O = O * alpha + tile, one FFMA,
      // the same count as the plain rescale). The fp8 wgmma accumulator keeps far fewer bits
      // than fp32 (HOPPER_KERNELS.md section 3); accumulating O across hundreds of tiles in it
      // drifted by 1e-4..1e-3 relative on the first GPU run.
      // H = 256 does it in two N = 128 halves so the tile accumulator fits the register budget.
      constexpr int NSPLIT = (H == 256) ? 2 : 1;
      constexpr int HN = H / NSPLIT;
#pragma unroll
      for (int h = 0; h < NSPLIT; ++h) {
        float ot[HN / 2];
#pragma unroll
        for (int i = 0; i < HN / 2; ++i) reg_fence(ot[i]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 32; ++kk) {
          const uint64_t dv = make_desc<SWV>(v_base + h * HN * SWV + kk * 32);
          Wgmma<HN>::rs(ot, pa[kk], dv, kk > 0 ? 1 : 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < HN / 2; ++i) reg_fence(ot[i]);
#pragma unroll
        for (int j = 0; j < HN / 8; ++j) {
          float* oj = o + (h * (HN / 8) + j) * 4;
          oj[0] = fmaf(oj[0], alpha0, ot[j * 4 + 0]);
          oj[1] = fmaf(oj[1], alpha0, ot[j * 4 + 1]);
          oj[2] = fmaf(oj[2], alpha1, ot[j * 4 + 2]);
          oj[3] = fmaf(oj[3], alpha1, ot[j * 4 + 3]);
        }
      }
      mbar_arrive(&bar_empty[s]);  // per thread: an arrive releases only its own reads
    }
    sm.finish();
    epilogue<H, BN>(p, o, sm.m, sm.l, sm.rf, rows, b, n_head, kh, q_len, tq);
  }
}

}  // namespace jax_fa4::sm90
