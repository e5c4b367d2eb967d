// The forward kernel's tile scheduler: which (query tile, head, batch) a CTA works on, and in what order.
// Device-only: no XLA or nanobind types here.
#pragma once
#include "cuda/fwd_sm90_params.cuh"
#include "cuda/mask.cuh"
#include "cuda/tile_config.cuh"

namespace jax_fa4::sm90 {

// One unit of work: BM query rows of one (batch, head) against the key tiles [n_lo, n_lo + n_tiles).
struct WorkTile {
  int m0, n_head, b, kh, q_len, kv_len, n_lo, n_tiles;
};

// Work index t -> tile. The (head, batch) pairs are cut into sections of p.sched_section pairs whose
// K and V fit in L2 together (the launcher sizes them); a section's tiles run one after another, and
// inside a section the heaviest (last) query tiles of every pair come first: under causal masks the
// longest tiles start first and the short ones fill the tail (longest-processing-time order), while
// the CTAs running at the same time still share a few pairs' K/V in L2. A CTA takes t = blockIdx.x,
// blockIdx.x + gridDim.x, ...: one tile when the grid covers the work, a persistent loop when the grid
// is one CTA per SM.
template <int BM, int BN>
struct FwdTileScheduler {
  // From the parameters (constant bank) rather than a product held in a register: the overlapped
  // loop at H = 128 has none to spare.
  __device__ __forceinline__ static int num_work(const FwdParams& p) { return p.num_work; }

  __device__ __forceinline__ static WorkTile get(const FwdParams& p, int t) {
    const int M = p.num_m_blocks, pairs = p.N * p.B, L = p.sched_section;
    const int sec = t / (L * M);             // every section before the last is full
    const int first = sec * L;
    const int len = min(L, pairs - first);   // the last section may be shorter
    const int within = t - first * M;
    const int r = within / len;
    const int pair = first + (within - r * len);
    WorkTile w;
    w.m0 = (M - 1 - r) * BM;
    w.n_head = pair % p.N;
    w.b = pair / p.N;
    w.kh = w.n_head / p.group;
    w.q_len = min(max(p.q_len[w.b], 0), p.T);
    w.kv_len = min(max(p.kv_len[w.b], 0), p.S);
    int n_hi;
    tile_range<BM, BN>(w.m0, w.q_len, w.kv_len, p.mask, w.n_lo, n_hi);
    w.n_tiles = n_hi - w.n_lo;
    return w;
  }
};

}  // namespace jax_fa4::sm90
