// Launcher of the sm_90a backward kernel. dQ is accumulated in fp32 one chunk of (batches, kv
// heads) at a time (bwd_dq_epilogue.cuh says why): per chunk it zeroes the accumulator, builds no
// new maps (the dQ map describes one chunk; Q and dO's describe the whole tensors; the kernel reads
// K and V as MX itself), launches one CTA per (128-key tile, kv head x column chunk, batch) of the
// chunk, and then writes the chunk's dQ * scale in the gradient's dtype. Key tiles are the fastest
// grid index, or under a causal mask the slowest: key tile j sees only the query tiles from j on,
// so the heaviest tiles of every head go first and the light ones fill the GPU's tail, which each
// chunk's launch has (a model of one CTA per SM, in launch order: 4 chunks at B=2, T=8192, N=16
// cost 1.17x one launch in key-tile-fastest order and 1.006x in key-tile-slowest order; measured on
// an H100: 1.14x before, 1.01x now, and the causal backward 5% faster even in one launch). Either
// way tile j - 1 of a head launches before its tile j, which the deterministic dQ order waits on.
#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdlib>
#include "cuda/bwd_dq_epilogue.cuh"
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

// Launches the epilogue over the chunk (batches [b0, b0 + nb), kv heads [kh0, kh0 + nkh)). The
// accumulator's rows are always chunk_kh kv heads long (the dQ map and p.dq_N say so), a last,
// partial chunk fills the first nkh of them.
cudaError_t dq_epilogue(const BwdArgs& a, int b0, int nb, int kh0, int nkh, cudaStream_t stream) {
  const int group = a.N / a.Kh;
  const int acc_row = a.chunk_kh * group * a.H, row_len = nkh * group * a.H;
  const int64_t rows = (int64_t)nb * a.T;
  const int64_t out_row = (int64_t)a.N * a.H, out_batch = (int64_t)a.T * a.N * a.H;
  const int64_t start = (int64_t)b0 * out_batch + (int64_t)kh0 * group * a.H;
  const int64_t groups = rows * (row_len / 8);
  const int threads = 256;
  const int64_t want = (groups + threads - 1) / threads;
  const int blocks = (int)(want < 8192 ? (want > 0 ? want : 1) : 8192);  // grid-stride beyond
  switch (a.dq_type) {
    case FloatType::kF32:
      sm90::dq_epilogue_kernel<float><<<blocks, threads, 0, stream>>>(
          a.dq_acc, acc_row, static_cast<float*>(a.dq) + start, rows, row_len, a.T, out_row, out_batch, a.scale);
      break;
    case FloatType::kBF16:
      sm90::dq_epilogue_kernel<__nv_bfloat16><<<blocks, threads, 0, stream>>>(
          a.dq_acc, acc_row, static_cast<__nv_bfloat16*>(a.dq) + start, rows, row_len, a.T, out_row, out_batch,
          a.scale);
      break;
    case FloatType::kF16:
      sm90::dq_epilogue_kernel<__half><<<blocks, threads, 0, stream>>>(
          a.dq_acc, acc_row, static_cast<__half*>(a.dq) + start, rows, row_len, a.T, out_row, out_batch, a.scale);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <int H, bool kDQWG>
cudaError_t launch_h(const BwdArgs& a, BwdParams& p, cudaStream_t stream) {
  using Cfg = BwdTileConfig<H>;
  constexpr int kSmem = kDQWG ? Cfg::kDQWGSmemBytes : Cfg::kSmemBytes;
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
  // The dQ accumulator of one chunk as fp32 elements [chunk_b, T, dq_N, H]: the writer's reduce-add
  // box is 32 columns (128 bytes, the 128B swizzle's row) x BM rows; rows past T are dropped by the
  // TMA unit.
  CUtensorMap tm_dq;
  {
    const cuuint64_t dims[4] = {(cuuint64_t)a.H, (cuuint64_t)a.T, (cuuint64_t)p.dq_N, (cuuint64_t)a.chunk_b};
    const cuuint64_t str[3] = {(cuuint64_t)p.dq_N * a.H * 4, (cuuint64_t)a.H * 4, (cuuint64_t)a.T * p.dq_N * a.H * 4};
    const cuuint32_t box[4] = {32, (cuuint32_t)Cfg::kBlockM, 1, 1};
    if (auto e = make_map(&tm_dq, a.dq_acc, dims, str, box, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_DATA_TYPE_FLOAT32);
        e != cudaSuccess)
      return e;
  }
  if (cudaError_t e = set_max_smem_once<sm90::bwd_sm90_kernel<H, kDQWG>>(kSmem); e != cudaSuccess) return e;
  const int n_tiles = (a.S + Cfg::kBlockN - 1) / Cfg::kBlockN;
  if ((int64_t)a.Kh * Cfg::kChunks > 65535) return cudaErrorInvalidValue;
  // The key tile is the grid's y index under a causal mask (a 65535 limit, S < 8.4M keys); else x.
  p.tiles_slowest = a.causal && n_tiles <= 65535 ? 1 : 0;
  const size_t acc_bytes = sizeof(float) * (size_t)a.chunk_b * a.T * p.dq_N * a.H;
  for (int b0 = 0; b0 < a.B; b0 += a.chunk_b)
    for (int kh0 = 0; kh0 < a.Kh; kh0 += a.chunk_kh) {
      const int nb = a.B - b0 < a.chunk_b ? a.B - b0 : a.chunk_b;
      const int nkh = a.Kh - kh0 < a.chunk_kh ? a.Kh - kh0 : a.chunk_kh;
      if (cudaError_t e = cudaMemsetAsync(a.dq_acc, 0, acc_bytes, stream); e != cudaSuccess) return e;
      p.b0 = b0;
      p.kh0 = kh0;
      const dim3 grid = p.tiles_slowest ? dim3(nkh * Cfg::kChunks, n_tiles, nb) : dim3(n_tiles, nkh * Cfg::kChunks, nb);
      sm90::bwd_sm90_kernel<H, kDQWG><<<grid, sm90::kThreads, kSmem, stream>>>(tm_q, tm_do, tm_dq, p);
      if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
      if (cudaError_t e = dq_epilogue(a, b0, nb, kh0, nkh, stream); e != cudaSuccess) return e;
    }
  return cudaSuccess;
}

}  // namespace

cudaError_t launch_bwd_sm90(const BwdArgs& a, cudaStream_t stream) {
  if (a.Kh <= 0 || a.N % a.Kh != 0 || a.T_pad % kBwdBlockM != 0 || a.T_pad < a.T) return cudaErrorInvalidValue;
  if (a.B > 65535) return cudaErrorInvalidValue;
  // The kernel reads K and V 16 bytes at a time (rows are H >= 64 bytes); the TMA maps of the bf16
  // copies it replaced needed 16-byte aligned bases as well.
  if ((reinterpret_cast<uintptr_t>(a.k8) | reinterpret_cast<uintptr_t>(a.v8)) % 16 != 0) return cudaErrorInvalidValue;
  // One dQ chunk when dQ is fp32: the output is its own accumulator (scaled in place at the end).
  if (a.chunk_b < 1 || a.chunk_kh < 1 || (a.dq_type == FloatType::kF32 && (a.chunk_b != a.B || a.chunk_kh != a.Kh ||
                                                                            a.dq_acc != a.dq)))
    return cudaErrorInvalidValue;
  const int num_m_blocks = (a.T + kBwdBlockM - 1) / kBwdBlockM;
  if (a.B == 0 || a.T == 0 || a.N == 0 || a.S == 0) return cudaSuccess;  // Python returns zeros
  if (a.deterministic) {
    if (cudaError_t e = cudaMemsetAsync(a.sem, 0, sizeof(int32_t) * (size_t)a.B * a.N * bwd_column_chunks(a.H) * num_m_blocks, stream);
        e != cudaSuccess)
      return e;
  }
  BwdParams p{};
  p.B = a.B; p.T = a.T; p.S = a.S; p.N = a.N; p.Kh = a.Kh; p.H = a.H;
  p.k8 = a.k8; p.ks = a.ks; p.v8 = a.v8; p.vs = a.vs;
  p.group = a.N / a.Kh;
  p.dq_N = a.chunk_kh * p.group;
  p.T_pad = a.T_pad;
  p.num_m_blocks = num_m_blocks;
  p.lse2 = a.lse2; p.delta = a.delta; p.q_len = a.q_len; p.kv_len = a.kv_len;
  p.dq = a.dq_acc; p.dk = a.dk; p.dv = a.dv; p.sem = a.sem;
  p.dkv_type = static_cast<int>(a.dkv_type);
  p.deterministic = a.deterministic ? 1 : 0;
  p.scale = a.scale;
  p.scale_log2 = a.scale * 1.4426950408889634f;
  p.mask = sm90::make_mask_params(a.window_left, a.window_right, a.causal);
  // JAX_FA4_SM90_BWD_DQWG=1 (read per launch; H <= 128): the dQ-warpgroup kernel, in which
  // warpgroup 0 computes dQ and the consumers no longer meet at a barrier per query tile
  // (tile_config.cuh). Built and checked with ptxas only, never run on a GPU yet: off by default
  // until a GPU run has tested and timed it (docs/HOPPER_BACKWARD.md, "The dQ warpgroup").
  const char* dw = std::getenv("JAX_FA4_SM90_BWD_DQWG");
  const bool dqwg = dw != nullptr && dw[0] == '1';
  switch (a.H) {
    case 64: return dqwg ? launch_h<64, true>(a, p, stream) : launch_h<64, false>(a, p, stream);
    case 128: return dqwg ? launch_h<128, true>(a, p, stream) : launch_h<128, false>(a, p, stream);
    case 256: return launch_h<256, false>(a, p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace jax_fa4::cuda
