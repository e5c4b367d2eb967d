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
#include "cuda/fwd_sm90_scheduler.cuh"
#include "cuda/fwd_sm90_softmax.cuh"
#include "cuda/mask.cuh"
#include "cuda/sm90_ptx.cuh"
#include "cuda/tile_config.cuh"
#include "cuda/wgmma_ops.cuh"

namespace jax_fa4::sm90 {

// Phase timestamps for measurement builds only (-DJAX_FA4_FWD_TRACE, scripts/trace_fwd.py): thread 0
// of each consumer warpgroup of CTA kTraceCta writes clock64() at 11 points of each of its first 32
// key tiles (sequential loop; points 5 and 6 inside RowSoftmax::step). Normal builds compile none of it.
#ifdef JAX_FA4_FWD_TRACE
constexpr int kTraceCta = 300, kTraceTiles = 32, kTracePoints = 12;
// (defined here: fwd_sm90_launch.cu is the only translation unit that includes this header)
__device__ unsigned long long g_fwd_trace[3][kTraceTiles][kTracePoints];  // up to 3 consumers
#define JAX_FA4_TRACE(it, k) \
  do { if (trace_on && (it) < kTraceTiles) g_fwd_trace[cw][(it)][(k)] = clock64(); } while (0)
#else
#define JAX_FA4_TRACE(it, k) do {} while (0)
#endif

// Two-level O accumulation (below: why): o = o * alpha + t for N output columns of a tile's P V
// accumulator t (wgmma m64nN layout: elements 4 j, 4 j + 1 on row gid, 4 j + 2, 4 j + 3 on gid + 8).
// The fence first: t was written by the wgmma just waited on.
template <int N>
__device__ __forceinline__ void add_tile_to_o(float* o, float* t, float a0, float a1) {
#pragma unroll
  for (int i = 0; i < N / 2; ++i) reg_fence(t[i]);
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    o[j * 4 + 0] = fmaf(o[j * 4 + 0], a0, t[j * 4 + 0]);
    o[j * 4 + 1] = fmaf(o[j * 4 + 1], a0, t[j * 4 + 1]);
    o[j * 4 + 2] = fmaf(o[j * 4 + 2], a1, t[j * 4 + 2]);
    o[j * 4 + 3] = fmaf(o[j * 4 + 3], a1, t[j * 4 + 3]);
  }
}

// kPipe selects the experimental overlapped consumer loop (a separate instantiation, so the default
// kernel's register allocation does not carry the variants' pressure). kCons: consumer warpgroups
// (tile_config.cuh TileConfig says when 3).
template <int H, bool kPipe, bool kExact, int kCons = kNumConsumerWG>
__global__ void __launch_bounds__(TileConfig<H, kExact ? 2 : 1, kCons>::kThreads, 1)
    fwd_sm90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                    const __grid_constant__ CUtensorMap tm_v, const FwdParams p) {
  using Cfg = TileConfig<H, kExact ? 2 : 1, kCons>;
  static_assert(!kPipe || H <= 128, "the overlapped loop's registers (O, tile O, S, P) fit at H <= 128 only");
  constexpr int BM = Cfg::kBM, BN = Cfg::kBlockN, ST = Cfg::kStages;
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
  uint64_t* bar_q_empty = bars + 1 + 3 * ST;  // both consumers done with Q (its last Q K^T completed)
  // One 16-byte slot per consumer thread (Cfg::kSlotBytes): the current work tile's first query row,
  // key length, first key tile and work index. The loop reads them back from shared memory when it
  // needs them (boundary masks, the epilogue) instead of holding 4 registers: decoded by divisions,
  // the compiler cannot recompute them, and the overlapped loop at H = 128 (O, tile O, S and P fill
  // 208 of its 240 registers) spilled O registers on every key tile when they stayed live.
  int4* slots = reinterpret_cast<int4*>(reinterpret_cast<uint8_t*>(bars) + 256);
  using Sched = FwdTileScheduler<BM, BN>;

  if (threadIdx.x == 0) {
    mbar_init(bar_q, 1);
    mbar_init(bar_q_empty, kCons * kWarpgroupThreads);
    for (int s = 0; s < ST; ++s) {
      mbar_init(&bar_k[s], 1);
      mbar_init(&bar_v[s], 1);
      mbar_init(&bar_empty[s], kCons * kWarpgroupThreads);
    }
    fence_barrier_init();
  }
  __syncthreads();

  const int wg = threadIdx.x / kWarpgroupThreads;
  if (wg == static_cast<int>(WarpRole::kProducer)) {
    setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0) {
      tma_prefetch_desc(&tm_q);
      tma_prefetch_desc(&tm_k);
      tma_prefetch_desc(&tm_v);
      // The stage ring runs on across work tiles: g counts the key tiles this CTA has loaded.
      int g = 0, q_loads = 0;
      for (int wi = blockIdx.x; wi < Sched::num_work(p); wi += gridDim.x) {
        const WorkTile w = Sched::get(p, wi);
        if (w.n_tiles == 0) continue;  // the consumers write zeros without waiting for loads
        // Q is single-buffered: wait until both consumers finished the previous tile's last Q K^T.
        if (q_loads > 0) mbar_wait(bar_q_empty, (q_loads - 1) & 1);
        ++q_loads;
        mbar_arrive_expect_tx(bar_q, Cfg::kQBytes);
#pragma unroll
        for (int c = 0; c < Cfg::kChunksQK; ++c)
          tma_load_4d(sQ + c * BM * SWQK, &tm_q, bar_q, c * SWQK, w.m0, w.n_head, w.b);
        const float* ks_row = kExact ? nullptr : p.ks + ((int64_t)w.b * p.Kh + w.kh) * p.S_pad;
        for (int it = 0; it < w.n_tiles; ++it, ++g) {
          const int s = g % ST;
          const uint32_t phase = (g / ST) & 1;
          if (g >= ST) mbar_wait(&bar_empty[s], phase ^ 1);
          const int n = w.n_lo + it;
          // Exact scores have no key scales: the stage is the K tile alone.
          mbar_arrive_expect_tx(&bar_k[s], Cfg::kKBytes + (kExact ? 0 : BN * 4));
#pragma unroll
          for (int c = 0; c < Cfg::kChunksQK; ++c)
            tma_load_4d(sK + s * Cfg::kKBytes + c * BN * SWQK, &tm_k, &bar_k[s], c * SWQK, n * BN, w.kh, w.b);
          if constexpr (!kExact) bulk_load(sKs + s * BN, ks_row + n * BN, BN * 4, &bar_k[s]);
          mbar_arrive_expect_tx(&bar_v[s], Cfg::kVBytes);
          tma_load_4d(sV + s * Cfg::kVBytes, &tm_v, &bar_v[s], n * BN, 0, w.kh, w.b);
        }
      }
    }
  } else {
    setmaxnreg_inc<Cfg::kConsumerRegs>();
    const int cw = wg - 1;  // consumer index: query rows [m0 + 64*cw, m0 + 64*cw + 64)
    const int t = threadIdx.x % kWarpgroupThreads;
    const int warp = t / 32, lane = t % 32;
    const int gid = lane / 4, tq = lane % 4;
    volatile int* slot = reinterpret_cast<volatile int*>(slots + (threadIdx.x - kWarpgroupThreads));
    const int row_in_tile = cw * 64 + warp * 16 + gid;  // this thread's rows: m0 + row_in_tile (+ 8)
    int g = 0, q_loads = 0;  // key tiles consumed and Q tiles used so far (the producer's counters)
    for (int wi = blockIdx.x; wi < Sched::num_work(p); wi += gridDim.x) {
    int n_tiles;
    {
      const WorkTile w = Sched::get(p, wi);
      slot[0] = w.m0;
      slot[1] = w.kv_len;
      slot[2] = w.n_lo;
      slot[3] = wi;
      n_tiles = w.n_tiles;
    }
    // -inf where the mask removes a score of key tile n (boundary tiles only).
    auto tile_full = [&](int n) { return tile_is_full<BM, BN>(slot[0], n, slot[1], p.mask); };
    auto mask_rows = [&](float* s_, int n) {
      const int m0 = slot[0];
      const int rws[2] = {m0 + row_in_tile, m0 + row_in_tile + 8};
      mask_tile<BN>(s_, rws, n, slot[1], p.mask, tq);
    };
    auto mask_boundary = [&](float* s_, int n) {
      if (!tile_full(n)) mask_rows(s_, n);
    };
    // Stage and phase of this tile's key tile it in the CTA's ring.
    // Stage and phase of the work tile's first key tile (one division per work tile); the loops step
    // them with `advance` (ST = 3 made every key tile pay a division by 3 in the integer pipe).
    const int s_first = g % ST;
    const uint32_t ph_first = (uint32_t)((g / ST) & 1);
    auto advance = [](int& st, uint32_t& ph) {
      if (++st == ST) {
        st = 0;
        ph ^= 1u;
      }
    };
    // Both consumers arrive once their last Q K^T of the tile has completed, so the producer can
    // load the next tile's Q while they finish P V and the epilogue.
    auto release_q = [&]() { mbar_arrive(bar_q_empty); };
    float rfv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float q_scale = 1.f;  // exact scores: the bf16 values carry their own scale
      if constexpr (!kExact) {
        const WorkTile w = Sched::get(p, slot[3]);
        const int row = w.m0 + row_in_tile + 8 * r;
        q_scale = row < p.T ? p.qs[((int64_t)w.b * p.N + w.n_head) * p.T + row] : 1.f;
      }
      float rf = q_scale * p.scale_log2;
      // A row on the smallest scale (2^-127) must not flush rf to zero: -inf * 0 would be NaN.
      rfv[r] = rf < 1.17549435e-38f ? 1.17549435e-38f : rf;  // (NaN stays NaN)
    }
    RowSoftmax<BN> sm;
    sm.init(rfv[0], rfv[1]);
    float o[H / 2];
#pragma unroll
    for (int i = 0; i < H / 2; ++i) o[i] = 0.f;

    if (n_tiles > 0) mbar_wait(bar_q, q_loads & 1);
    const uint32_t q_base = smem_u32(sQ) + cw * 64 * SWQK;
    // Descriptor low halves (sm90_ptx.cuh, desc_lo): stage s of K / V^T is a fixed step away from stage 0.
    const uint32_t q_lo = desc_lo(q_base);
    const uint32_t k_lo0 = desc_lo(smem_u32(sK)), v_lo0 = desc_lo(smem_u32(sV));
    constexpr uint32_t kKStep = Cfg::kKBytes >> 4, kVStep = Cfg::kVBytes >> 4;
    bool use_pipeline = false;
    if constexpr (kPipe && H <= 128) use_pipeline = n_tiles > 0;
    // Variant bits (JAX_FA4_SM90_PIPELINE): 1 = the overlapped loop (kPipe); 2 = ping-pong the two
    // consumers with named barriers (FA3: one warpgroup issues its GEMMs while the other runs its
    // softmax), in either loop. Only switches that touch no wgmma accumulator may be run-time values:
    // a run-time choice of accumulator (the former bit 4, P V straight into O) made ptxas serialize
    // every wgmma of the loop (warning C7515: a wait after each), which hid the overlap it measured.
    const bool pingpong = kCons == 2 && (p.pipelined & 2) != 0 && n_tiles > 0;  // (two consumers only)
    // Bit 32 (measurement only, not the contract's numerics): P*256 as exp2(x + 8), no FMUL per
    // element, to time what that multiply costs the softmax. Compiled into the kPipe kernels only
    // (the launcher picks them for bit 32), so the default H >= 128 kernels carry no second softmax.
    const bool fold8 = kPipe && (p.pipelined & 32) != 0;
    // Ping-pong: consumer c issues a GEMM block only after the other consumer's bar.arrive on
    // barrier 1 + c (256 = this warpgroup's 128 syncing threads + the other's 128 arriving).
    // Overlapped loop: blocks {S(0)}, {S(j), PV(j-1)} for j = 1..n-1, {PV(n-1)}: n+1 per consumer.
    // Sequential loop: blocks {S(j)}, {PV(j)}: 2n per consumer. Consumer 1 opens with one arrive for
    // consumer 0 and skips its last one, so every sync is matched within the work tile.
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
    if constexpr (kPipe && H <= 128) {
      if (use_pipeline) {
        // Intra-warpgroup overlap (FA3): the softmax of tile it runs on the CUDA cores while the
        // tensor cores still run the previous tile's P V:
        //   issue S(it) = Q K(it)^T; issue T = P(it-1) V(it-1); wait S; softmax(it) while T is in
        //   flight; wait T; O = O * alpha(it-1) + T; release stage it-1; pack P(it).
        // Same arithmetic, same order as the sequential loop: bit-identical output.
        // Registers at the peak: O, T (H/2 each), S (BN/2), P (BN/8): 208 at H = 128, so H = 256
        // keeps the sequential loop.
        float sc[BN / 2];
        uint32_t pa[BN / 32][4];
        float a_prev0 = 1.f, a_prev1 = 1.f;
        // Diagnostic bit 16 (timing only, WRONG results): no exp2 in the softmax (P = the exp2
        // argument); leaving the MUFU work out and timing the rest says what the exp2 costs.
        const bool diag_no_exp = (p.pipelined & 16) != 0;
        auto issue_qk = [&](int stage) {
          const uint32_t k_lo = k_lo0 + stage * kKStep;
#pragma unroll
          for (int i = 0; i < BN / 2; ++i) reg_fence(sc[i]);
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < Cfg::kStepsQK; ++kk) {  // 32 bytes of each row per k-step
            const int chunk = (kk * 32) / SWQK, within = (kk * 32) % SWQK;
            const uint64_t da = desc_from_lo<SWQK>(q_lo + ((chunk * BM * SWQK + within) >> 4));
            const uint64_t db = desc_from_lo<SWQK>(k_lo + ((chunk * BN * SWQK + within) >> 4));
            if constexpr (kExact) Wgmma<BN>::ss_bf16(sc, da, db, kk > 0 ? 1 : 0);
            else Wgmma<BN>::ss(sc, da, db, kk > 0 ? 1 : 0);
          }
          wgmma_commit();
        };
        auto softmax_tile = [&](int stage, int n, float& a0, float& a1) {
#pragma unroll
          for (int i = 0; i < BN / 2; ++i) reg_fence(sc[i]);
          if constexpr (!kExact) scale_by_keys<BN>(sc, sKs + stage * BN, tq);
          mask_boundary(sc, n);
          if (diag_no_exp) sm.template step<true>(sc, a0, a1);
          else if (fold8) sm.template step<false, true>(sc, a0, a1);
          else sm.step(sc, a0, a1);
        };
        float ot[H / 2];
        // P(j) V(j) into the tile accumulator ot (two-level: finish_pv adds it to O in fp32).
        auto issue_pv = [&](int stage) {
          const uint32_t v_lo = v_lo0 + stage * kVStep;
#pragma unroll
          for (int i = 0; i < H / 2; ++i) reg_fence(ot[i]);
#pragma unroll
          for (int kk = 0; kk < BN / 32; ++kk)
#pragma unroll
            for (int i = 0; i < 4; ++i) reg_fence(pa[kk][i]);
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < BN / 32; ++kk) {
            const uint64_t dv = desc_from_lo<SWV>(v_lo + ((kk * 32) >> 4));
            Wgmma<H>::rs(ot, pa[kk], dv, kk > 0 ? 1 : 0);
          }
          wgmma_commit();
        };
        auto finish_pv = [&](float a0, float a1) { add_tile_to_o<H>(o, ot, a0, a1); };
        // Prologue: tile 0. (sp, php): the previous key tile's stage and phase; (s, ph): this one's.
        int sp = s_first, s = s_first;
        uint32_t php = ph_first, ph = ph_first;
        mbar_wait(&bar_k[s], ph);
        pp_sync();
        issue_qk(s);
        pp_arrive(false);
        wgmma_wait<0>();
        if (n_tiles == 1) release_q();
        softmax_tile(s, slot[2], a_prev0, a_prev1);
        pack_p<BN>(sc, pa);
        for (int it = 1; it < n_tiles; ++it) {
          advance(s, ph);
          mbar_wait(&bar_k[s], ph);
          mbar_wait(&bar_v[sp], php);
          pp_sync();
          issue_qk(s);
          issue_pv(sp);
          pp_arrive(false);
          wgmma_wait<1>();  // S(it) done; PV(it-1) may still run
          if (it == n_tiles - 1) release_q();
          float a0, a1;
          softmax_tile(s, slot[2] + it, a0, a1);
          wgmma_wait<0>();
          finish_pv(a_prev0, a_prev1);
          mbar_arrive(&bar_empty[sp]);
          pack_p<BN>(sc, pa);
          a_prev0 = a0;
          a_prev1 = a1;
          advance(sp, php);
        }
        {  // Epilogue of the loop: the last tile's P V (sp == s now).
          mbar_wait(&bar_v[sp], php);
          pp_sync();
          issue_pv(sp);
          pp_arrive(true);
          wgmma_wait<0>();
          finish_pv(a_prev0, a_prev1);
          mbar_arrive(&bar_empty[sp]);
        }
      }
    }
    int s = s_first;
    uint32_t phase = ph_first;
#ifdef JAX_FA4_FWD_TRACE
    const bool trace_on = t == 0 && blockIdx.x == kTraceCta && wi == (int)blockIdx.x;
#endif
    for (int it = 0; it < (use_pipeline ? 0 : n_tiles); ++it, advance(s, phase)) {
      const int n = slot[2] + it;
      float sc[BN / 2];
      JAX_FA4_TRACE(it, 0);
      mbar_wait(&bar_k[s], phase);
      JAX_FA4_TRACE(it, 1);
      const uint32_t k_lo = k_lo0 + s * kKStep;
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) reg_fence(sc[i]);
      // Whether this key tile needs the per-element mask, worked out before Q K^T is issued: its
      // shared-memory and constant loads then wait under the wgmma instead of after it (~150-190
      // cycles of a ~3400-cycle tile on an H100, scripts/trace_fwd.py).
      const bool full = tile_full(n);
      if (kExact || !p.qk_promote) {
        pp_sync();
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < Cfg::kStepsQK; ++kk) {  // 32 bytes of each row per k-step
          const int chunk = (kk * 32) / SWQK, within = (kk * 32) % SWQK;
          const uint64_t da = desc_from_lo<SWQK>(q_lo + ((chunk * BM * SWQK + within) >> 4));
          const uint64_t db = desc_from_lo<SWQK>(k_lo + ((chunk * BN * SWQK + within) >> 4));
          if constexpr (kExact) Wgmma<BN>::ss_bf16(sc, da, db, kk > 0 ? 1 : 0);
          else Wgmma<BN>::ss(sc, da, db, kk > 0 ? 1 : 0);
        }
        wgmma_commit();
        pp_arrive(false);
        JAX_FA4_TRACE(it, 2);
        wgmma_wait<0>();
        JAX_FA4_TRACE(it, 3);
      } else {
        pp_sync();  // (the promoted Q K^T counts as one block)
        // Experimental (JAX_FA4_SM90_QK_PROMOTE=1): every 32-wide k-step into a fresh accumulator,
        // summed in fp32 on the CUDA cores, to measure how much of the score error comes from the
        // fp8 wgmma accumulator across k-steps (DeepSeek-V3's promotion, at interval 32).
        float st[BN / 2];
#pragma unroll
        for (int kk = 0; kk < H / 32; ++kk) {
          const int chunk = (kk * 32) / SWQK, within = (kk * 32) % SWQK;
          const uint64_t da = desc_from_lo<SWQK>(q_lo + ((chunk * BM * SWQK + within) >> 4));
          const uint64_t db = desc_from_lo<SWQK>(k_lo + ((chunk * BN * SWQK + within) >> 4));
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
        pp_arrive(false);
      }
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) reg_fence(sc[i]);
      if (it == n_tiles - 1) release_q();

      // FP8 scores: per-key scale of K (one FMUL per element: a per-tile scale would push small keys
      // of a tile with an outlier key into e4m3's subnormals). Then the mask on boundary tiles only.
      if constexpr (!kExact) scale_by_keys<BN>(sc, sKs + s * BN, tq);
      if (!full) mask_rows(sc, n);
      JAX_FA4_TRACE(it, 4);
      float alpha0, alpha1;
#ifdef JAX_FA4_FWD_TRACE
      sm.tr = (trace_on && it < kTraceTiles) ? &g_fwd_trace[cw][it][5] : nullptr;
#endif
      if (fold8) sm.template step<false, true>(sc, alpha0, alpha1);
      else sm.step(sc, alpha0, alpha1);
      uint32_t pa[BN / 32][4];
      pack_p<BN>(sc, pa);
      JAX_FA4_TRACE(it, 7);
      mbar_wait(&bar_v[s], phase);
      JAX_FA4_TRACE(it, 8);
      const uint32_t v_lo = v_lo0 + s * kVStep;
      // Two-level accumulation: this tile's P V goes to a fresh wgmma accumulator, which is then
      // added in fp32 (fused with the online-softmax rescale: O = O * alpha + tile, one FFMA,
      // the same count as the plain rescale). The fp8 wgmma accumulator keeps far fewer bits
      // than fp32 (HOPPER_KERNELS.md section 3); accumulating O across hundreds of tiles in it
      // drifted by 1e-4..1e-3 relative on the first GPU run.
      // H = 256 does it in two N = 128 halves so the tile accumulator fits the register budget; so
      // does H = 128 with three consumers (160 registers: O 64 + P 16 + a 32-register half tile).
      constexpr int NSPLIT = (H == 256 || (H == 128 && kCons == 3)) ? 2 : 1;
      constexpr int HN = H / NSPLIT;
      pp_sync();  // the P V block: both halves at H = 256
      // H = 128 with three consumers: both halves issued back to back (two 32-register tile
      // accumulators, S being dead by now), then the first half's O update runs on the CUDA cores
      // while the tensor cores finish the second half. H = 256 cannot hold two 64-register halves.
      constexpr bool kBothHalves = H == 128 && kCons == 3;
      if constexpr (kBothHalves) {
        float ot0[HN / 2], ot1[HN / 2];
#pragma unroll
        for (int i = 0; i < HN / 2; ++i) {
          reg_fence(ot0[i]);
          reg_fence(ot1[i]);
        }
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 32; ++kk)
          Wgmma<HN>::rs(ot0, pa[kk], desc_from_lo<SWV>(v_lo + ((kk * 32) >> 4)), kk > 0 ? 1 : 0);
        wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < BN / 32; ++kk)
          Wgmma<HN>::rs(ot1, pa[kk], desc_from_lo<SWV>(v_lo + ((HN * SWV + kk * 32) >> 4)), kk > 0 ? 1 : 0);
        wgmma_commit();
        wgmma_wait<1>();
        add_tile_to_o<HN>(o, ot0, alpha0, alpha1);
        wgmma_wait<0>();  // (no ping-pong arrive: ping-pong is for two consumers)
        JAX_FA4_TRACE(it, 9);
        add_tile_to_o<HN>(o + HN / 2, ot1, alpha0, alpha1);
      }
#pragma unroll
      for (int h = 0; h < (kBothHalves ? 0 : NSPLIT); ++h) {
        float ot[HN / 2];
#pragma unroll
        for (int i = 0; i < HN / 2; ++i) reg_fence(ot[i]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 32; ++kk) {
          const uint64_t dv = desc_from_lo<SWV>(v_lo + ((h * HN * SWV + kk * 32) >> 4));
          Wgmma<HN>::rs(ot, pa[kk], dv, kk > 0 ? 1 : 0);
        }
        wgmma_commit();
        if (h == NSPLIT - 1) pp_arrive(it == n_tiles - 1);
        wgmma_wait<0>();
        if (h == NSPLIT - 1) JAX_FA4_TRACE(it, 9);
        add_tile_to_o<HN>(o + h * (HN / 2), ot, alpha0, alpha1);
      }
      mbar_arrive(&bar_empty[s]);  // per thread: an arrive releases only its own reads
      JAX_FA4_TRACE(it, 10);
    }
    sm.finish();
    {
      const WorkTile we = Sched::get(p, slot[3]);
      const int rws[2] = {we.m0 + row_in_tile, we.m0 + row_in_tile + 8};
      epilogue<H, BN>(p, o, sm.m, sm.l, sm.rf, rws, we.b, we.n_head, we.kh, we.q_len, tq);
    }
    if (n_tiles > 0) {
      g += n_tiles;
      ++q_loads;
    }
    }  // work tiles
  }
}

}  // namespace jax_fa4::sm90
