// Launcher of the sm_90a forward kernel: builds the TMA tensor maps, picks the tile config by
// head dim, and launches one CTA per (128- or 192-row query tile, query head, batch) in the
// scheduler's order.
#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdint>
#include <cstdlib>
#include "cuda/fwd_sm90_mainloop.cuh"
#include "cuda/launch.h"
#include "cuda/tma_map.h"

#ifdef JAX_FA4_FWD_TRACE
// Measurement builds: copies the phase timestamps of the last traced launch (module_cuda.cc).
extern "C" int jax_fa4_fwd_trace(unsigned long long* host) {
  return (int)cudaMemcpyFromSymbol(host, jax_fa4::sm90::g_fwd_trace, sizeof(jax_fa4::sm90::g_fwd_trace));
}
#endif

namespace jax_fa4::cuda {
namespace {

using sm90::FwdParams;
using sm90::fwd_sm90_kernel;
using sm90::TileConfig;

static_assert(kSeqPad == sm90::kSeqPad, "launch.h and tile_config.cuh disagree on the S padding");

// Short rows: S <= kShortRowsS keys, at most 32 key tiles per work tile. There one CTA per SM (the
// persistent loop) was 2-14% faster than one CTA per work tile in all 16 cases of an H100 run (about
// 16k tokens, N=16, T=S = 512 .. 4096, H 64 and 128, causal and not: scripts/probe_short_rows.py,
// docs/PERFORMANCE.md); at 8192 it was equal without masks and up to 13% slower with them. The grids
// are bitwise equal (test_loop_variants_and_grids_bitwise_equal): the rule changes no result.
constexpr int kShortRowsS = 4096;

template <int H, bool kPipe, bool kExact, int kCons = sm90::kNumConsumerWG>
cudaError_t launch_h(const FwdArgs& a, FwdParams& p, cudaStream_t stream) {
  using Cfg = TileConfig<H, kExact ? 2 : 1, kCons>;
  // Q and K are described as bytes (uint8 maps): RB bytes per row, e4m3 or bf16 alike.
  constexpr cuuint64_t RB = Cfg::kRowBytesQK;
  CUtensorMap tm_q, tm_k, tm_v;
  {  // Q [B, T, N, H]: box = one swizzle-width column chunk of BM rows (query positions).
    const cuuint64_t dims[4] = {RB, (cuuint64_t)a.T, (cuuint64_t)a.N, (cuuint64_t)a.B};
    const cuuint64_t str[3] = {(cuuint64_t)a.N * RB, RB, (cuuint64_t)a.T * a.N * RB};
    const cuuint32_t box[4] = {(cuuint32_t)Cfg::kSwQK, (cuuint32_t)Cfg::kBM, 1, 1};
    if (auto e = make_map(&tm_q, a.q8, dims, str, box, swizzle_of(Cfg::kSwQK)); e != cudaSuccess) return e;
  }
  {  // K [B, S, Kh, H]: box = one column chunk of BN keys.
    const cuuint64_t dims[4] = {RB, (cuuint64_t)a.S, (cuuint64_t)a.Kh, (cuuint64_t)a.B};
    const cuuint64_t str[3] = {(cuuint64_t)a.Kh * RB, RB, (cuuint64_t)a.S * a.Kh * RB};
    const cuuint32_t box[4] = {(cuuint32_t)Cfg::kSwQK, (cuuint32_t)Cfg::kBlockN, 1, 1};
    if (auto e = make_map(&tm_k, a.k8, dims, str, box, swizzle_of(Cfg::kSwQK)); e != cudaSuccess) return e;
  }
  {  // V^T [B, Kh, H, S_pad]: box = BN keys (one swizzle row) x all H columns.
    const cuuint64_t dims[4] = {(cuuint64_t)a.S_pad, (cuuint64_t)H, (cuuint64_t)a.Kh, (cuuint64_t)a.B};
    const cuuint64_t str[3] = {(cuuint64_t)a.S_pad, (cuuint64_t)H * a.S_pad, (cuuint64_t)a.Kh * H * a.S_pad};
    const cuuint32_t box[4] = {(cuuint32_t)Cfg::kBlockN, (cuuint32_t)H, 1, 1};
    if (auto e = make_map(&tm_v, a.vt, dims, str, box, swizzle_of(Cfg::kSwV)); e != cudaSuccess) return e;
  }
  if (cudaError_t e = set_max_smem_once<fwd_sm90_kernel<H, kPipe, kExact, kCons>>(Cfg::kSmemBytes); e != cudaSuccess)
    return e;
  p.num_m_blocks = (a.T + Cfg::kBM - 1) / Cfg::kBM;
  const int64_t num_work = (int64_t)p.num_m_blocks * a.N * a.B;
  if (num_work > INT32_MAX) return cudaErrorInvalidValue;  // the scheduler's work index is an int
  p.num_work = (int)num_work;
  // Scheduler sections: as many (head, batch) pairs as keep their K and V within ~1/3 of L2 (the
  // CTAs running together read them; the rest of L2 serves Q, O and the other sections' tails).
  int l2_bytes = 0, sms = 0, dev = 0;
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  if (cudaError_t e = cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, dev); e != cudaSuccess) return e;
  if (cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev); e != cudaSuccess) return e;
  const int64_t kv_pair_bytes = (int64_t)a.S_pad * H * (Cfg::kRowBytesQK / H + 1);
  const int64_t section = (l2_bytes / 3) / (kv_pair_bytes > 0 ? kv_pair_bytes : 1);
  p.sched_section = (int)(section < 1 ? 1 : section > (int64_t)a.N * a.B ? (int64_t)a.N * a.B : section);
  // Persistent grid: one CTA per SM, each looping over work tiles (the next tile's Q and K/V loads
  // overlap this one's tail). JAX_FA4_SM90_PERSISTENT (read per launch, for measurement and tests):
  // 0 = one CTA per work tile; k >= 2 = at most k CTAs (many tiles per CTA even on small shapes).
  const char* pe = std::getenv("JAX_FA4_SM90_PERSISTENT");
  // Default: one CTA per work tile, dispatched by the hardware in the scheduler's order; on an H100
  // and an H200 (2026-12-05) that was as fast as one CTA per SM without causal masks and 5-15%
  // faster with them at long rows (a static stride over longest-first tiles leaves the SMs unevenly
  // loaded at the end). Short rows (kShortRowsS) take one CTA per SM: a short work tile hides
  // little of its own Q load and setup, which the persistent loop overlaps with the previous tile's.
  const long pv = pe != nullptr ? std::strtol(pe, nullptr, 10) : (a.S <= kShortRowsS ? 1 : 0);
  const int64_t cap = pv == 0 ? num_work : pv >= 2 ? pv : sms;
  const int64_t grid = num_work < cap ? num_work : cap;
  fwd_sm90_kernel<H, kPipe, kExact, kCons>
      <<<(unsigned)grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(tm_q, tm_k, tm_v, p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_fwd_sm90(const FwdArgs& a, cudaStream_t stream) {
  if (a.Kh <= 0 || a.N % a.Kh != 0 || a.S_pad % kSeqPad != 0 || a.S_pad < a.S) return cudaErrorInvalidValue;
  if (a.B == 0 || a.T == 0 || a.N == 0) return cudaSuccess;
  if (a.S == 0) return cudaErrorInvalidValue;  // handled in Python (zero-length keys: O = 0)
  FwdParams p{};
  p.B = a.B; p.T = a.T; p.S = a.S; p.N = a.N; p.Kh = a.Kh; p.H = a.H; p.S_pad = a.S_pad;
  p.group = a.N / a.Kh;
  p.qs = a.qs; p.ks = a.ks; p.vs = a.vs; p.q_len = a.q_len; p.kv_len = a.kv_len;
  p.o = a.o; p.lse = a.lse;
  p.out_dtype = static_cast<sm90::OutDtype>(static_cast<int>(a.out_type));
  p.scale_log2 = a.scale * 1.4426950408889634f;
  p.mask = sm90::make_mask_params(a.window_left, a.window_right, a.causal);
  // Precision experiment switch (see fwd_sm90_mainloop.cuh); read per launch, off by default.
  const char* qp = std::getenv("JAX_FA4_SM90_QK_PROMOTE");
  p.qk_promote = (qp != nullptr && qp[0] == '1') ? 1 : 0;
  // JAX_FA4_SM90_CONSUMERS=<2|3|4>: consumer warpgroups per CTA (4: below, H = 64 exact only). 3 (192 query rows per CTA,
  // tile_config.cuh TileConfig) exists for exact scores at H <= 128 and is their default: on an H200
  // (2026-12-06, scripts/probe_fwd_loops.py --consumers, B=2 T=S=8192 N=16) it was 13% / 5% faster
  // than two consumers at H = 128 (non-causal / causal) and 19% / 18% at H = 64, bitwise equal.
  // Ping-pong (bit 2 below) is for two consumers and is ignored with three. (The FP8-score kernel
  // spilled ~200 bytes per thread at 160 registers: it keeps two consumers.)
  const char* cs = std::getenv("JAX_FA4_SM90_CONSUMERS");
  const bool three = a.exact_scores && a.H <= 128 && (cs == nullptr || cs[0] != '2');
  const char* pl = std::getenv("JAX_FA4_SM90_PIPELINE");
  // JAX_FA4_SM90_PIPELINE=<bits>: 1 overlapped loop, |2 ping-pong, |16 diagnostic (mainloop).
  // Default: the sequential loop, except the overlapped loop at H = 64 with two consumers (7-12%
  // faster there on an H100 and an H200, both score paths; with three consumers the sequential loop
  // was 7-10% faster than the overlapped one). Overlap and ping-pong were 5-15% slower at H = 128 and
  // within noise at H = 256: docs/HOPPER_FORWARD.md, "Loop variants".
  p.pipelined = pl != nullptr ? (int)std::strtol(pl, nullptr, 10) : (a.H == 64 && !three ? 1 : 0);
  if (p.pipelined & 16) p.pipelined |= 1;
  // The kPipe kernels hold the overlapped loop (H <= 128 only: registers) and the bit-32 measurement.
  // (bit 2, ping-pong, also applies to the sequential loop, so H = 256 honours it)
  const bool pipe = (p.pipelined & (1 | 32)) != 0;
  if (a.exact_scores) {
    p.qk_promote = 0;
    switch (a.H) {
      case 64:
        // JAX_FA4_SM90_CONSUMERS=4: four consumers, 64-key tiles, the sequential loop (opt-in; built and
        // read in SASS, not yet run on a GPU: tile_config.cuh).
        if (cs != nullptr && cs[0] == '4') return launch_h<64, false, true, 4>(a, p, stream);
        if (three) return pipe ? launch_h<64, true, true, 3>(a, p, stream) : launch_h<64, false, true, 3>(a, p, stream);
        return pipe ? launch_h<64, true, true>(a, p, stream) : launch_h<64, false, true>(a, p, stream);
      case 128:
        if (three) return launch_h<128, false, true, 3>(a, p, stream);  // (no overlapped loop: registers)
        return pipe ? launch_h<128, true, true>(a, p, stream) : launch_h<128, false, true>(a, p, stream);
      case 256: return launch_h<256, false, true>(a, p, stream);
      default: return cudaErrorInvalidValue;
    }
  }
  switch (a.H) {
    case 64: return pipe ? launch_h<64, true, false>(a, p, stream) : launch_h<64, false, false>(a, p, stream);
    case 128: return pipe ? launch_h<128, true, false>(a, p, stream) : launch_h<128, false, false>(a, p, stream);
    case 256: return launch_h<256, false, false>(a, p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace jax_fa4::cuda
