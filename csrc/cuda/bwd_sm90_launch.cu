// Launcher of the sm_90a backward kernel: zeroes the dQ accumulator (and the deterministic-order
// counters), builds the TMA tensor maps (Q, dO, dQ; the kernel reads K and V as MX itself) and
// launches one CTA per (128-key tile, kv head x column chunk, batch), key tiles fastest so that
// tile j - 1 is resident before tile j waits on it.
#include <cuda.h>
#include <cuda_runtime.h>
#include "cuda/bwd_sm90_kernel.cuh"
#include "cuda/launch.h"
#include "cuda/tma_map.h"

#ifdef JAX_FA4_BWD_TRACE
// Measurement builds: copies the phase timestamps of the last traced launch (module_cuda.cc).
extern "C" int jax_fa4_bwd_trace(unsigned long long* host) {
  return (int)cudaMemcpyFromSymbol(host, jax_fa4::sm90::g_bwd_trace, sizeof(jax_fa4::sm90::g_bwd_trace));
}
#endif

namespace jax_fa4::cuda {
namespace {

using sm90::BwdParams;
using sm90::BwdTileConfig;

static_assert(kBwdBlockM == BwdTileConfig<128>::kBlockM, "launch.h and tile_config.cuh disagree on BM");
static_assert(bwd_column_chunks(64) == BwdTileConfig<64>::kChunks && bwd_column_chunks(128) == BwdTileConfig<128>::kChunks &&
                  bwd_column_chunks(256) == BwdTileConfig<256>::kChunks,
              "launch.h and tile_config.cuh disagree on the column chunks");

template <int H>
cudaError_t launch_h(const BwdArgs& a, BwdParams& p, cudaStream_t stream) {
  using Cfg = BwdTileConfig<H>;
  constexpr cuuint64_t RB = Cfg::kRowBytes;  // bf16 rows, described as bytes
  CUtensorMap tm_q, tm_do;
  auto rows_map = [&](CUtensorMap* m, const void* base, int L, int heads, int box_rows) {
    const cuuint64_t dims[4] = {RB, (cuuint64_t)L, (cuuint64_t)heads, (cuuint64_t)a.B};
    const cuuint64_t str[3] = {(cuuint64_t)heads * RB, RB, (cuuint64_t)L * heads * RB};
    const cuuint32_t box[4] = {(cuuint32_t)Cfg::kSw, (cuuint32_t)box_rows, 1, 1};
    return make_map(m, base, dims, str, box, swizzle_of(Cfg::kSw));
  };
  if (auto e = rows_map(&tm_q, a.q, a.T, a.N, Cfg::kBlockM); e != cudaSuccess) return e;
  if (auto e = rows_map(&tm_do, a.dout, a.T, a.N, Cfg::kBlockM); e != cudaSuccess) return e;
  // dQ as fp32 elements [B, T, N, H]: the writer's reduce-add box is 32 columns (128 bytes, the
  // 128B swizzle's row) x BM rows; rows past T are dropped by the TMA unit.
  CUtensorMap tm_dq;
  {
    const cuuint64_t dims[4] = {(cuuint64_t)a.H, (cuuint64_t)a.T, (cuuint64_t)a.N, (cuuint64_t)a.B};
    const cuuint64_t str[3] = {(cuuint64_t)a.N * a.H * 4, (cuuint64_t)a.H * 4, (cuuint64_t)a.T * a.N * a.H * 4};
    const cuuint32_t box[4] = {32, (cuuint32_t)Cfg::kBlockM, 1, 1};
    if (auto e = make_map(&tm_dq, a.dq, dims, str, box, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_DATA_TYPE_FLOAT32);
        e != cudaSuccess)
      return e;
  }
  if (cudaError_t e = set_max_smem_once<sm90::bwd_sm90_kernel<H>>(Cfg::kSmemBytes); e != cudaSuccess) return e;
  const int n_tiles = (a.S + Cfg::kBlockN - 1) / Cfg::kBlockN;
  if ((int64_t)a.Kh * Cfg::kChunks > 65535) return cudaErrorInvalidValue;
  dim3 grid(n_tiles, a.Kh * Cfg::kChunks, a.B);
  sm90::bwd_sm90_kernel<H><<<grid, sm90::kThreads, Cfg::kSmemBytes, stream>>>(tm_q, tm_do, tm_dq, p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_bwd_sm90(const BwdArgs& a, cudaStream_t stream) {
  if (a.Kh <= 0 || a.N % a.Kh != 0 || a.T_pad % kBwdBlockM != 0 || a.T_pad < a.T) return cudaErrorInvalidValue;
  if (a.B > 65535) return cudaErrorInvalidValue;
  // The kernel reads K and V 16 bytes at a time (rows are H >= 64 bytes); the TMA maps of the bf16
  // copies it replaced needed 16-byte aligned bases as well.
  if ((reinterpret_cast<uintptr_t>(a.k8) | reinterpret_cast<uintptr_t>(a.v8)) % 16 != 0) return cudaErrorInvalidValue;
  const int num_m_blocks = (a.T + kBwdBlockM - 1) / kBwdBlockM;
  if (a.B == 0 || a.T == 0 || a.N == 0 || a.S == 0) return cudaSuccess;  // Python returns zeros
  if (cudaError_t e = cudaMemsetAsync(a.dq, 0, sizeof(float) * (size_t)a.B * a.T * a.N * a.H, stream); e != cudaSuccess)
    return e;
  if (a.deterministic) {
    if (cudaError_t e = cudaMemsetAsync(a.sem, 0, sizeof(int32_t) * (size_t)a.B * a.N * bwd_column_chunks(a.H) * num_m_blocks, stream);
        e != cudaSuccess)
      return e;
  }
  BwdParams p{};
  p.B = a.B; p.T = a.T; p.S = a.S; p.N = a.N; p.Kh = a.Kh; p.H = a.H;
  p.k8 = a.k8; p.ks = a.ks; p.v8 = a.v8; p.vs = a.vs;
  p.group = a.N / a.Kh;
  p.T_pad = a.T_pad;
  p.num_m_blocks = num_m_blocks;
  p.lse2 = a.lse2; p.delta = a.delta; p.q_len = a.q_len; p.kv_len = a.kv_len;
  p.dq = a.dq; p.dk = a.dk; p.dv = a.dv; p.sem = a.sem;
  p.dkv_type = static_cast<int>(a.dkv_type);
  p.deterministic = a.deterministic ? 1 : 0;
  p.scale = a.scale;
  p.scale_log2 = a.scale * 1.4426950408889634f;
  p.mask = sm90::make_mask_params(a.window_left, a.window_right, a.causal);
  switch (a.H) {
    case 64: return launch_h<64>(a, p, stream);
    case 128: return launch_h<128>(a, p, stream);
    case 256: return launch_h<256>(a, p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace jax_fa4::cuda
