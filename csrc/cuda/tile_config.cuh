// Tile sizes of the sm_90a MXFP8 forward kernel, with the reason for each limit.
// Device-only constants: no XLA or nanobind types here.
#pragma once
#include <cstdint>

namespace jax_fa4::sm90 {

// Warp roles. One CTA = 3 warpgroups: the producer issues TMA loads, two consumers each own 64
// query rows (wgmma's M is fixed at 64 per warpgroup, so 2 consumers give a 128-row Q tile).
enum class WarpRole : int { kProducer = 0, kConsumer0 = 1, kConsumer1 = 2 };

constexpr int kWarpgroupThreads = 128;
constexpr int kNumConsumerWG = 2;
constexpr int kThreads = (1 + kNumConsumerWG) * kWarpgroupThreads;  // 384

// The registers a CTA of `threads` threads holds, and setmaxnreg redistributes: each thread's entry
// allocation under __launch_bounds__(threads, 1) is 65536 / threads rounded down to the 8-register
// granule (168 at 384 threads, 128 at 512, 96 at 640).
constexpr int cta_register_pool(int threads) { return threads * ((65536 / threads) / 8 * 8); }

// Registers after setmaxnreg: 24 for the producer (it only runs one elected TMA thread) and 240
// for the consumers: 128*24 + 256*240 = 64512, all of a 384-thread CTA's pool, so one CTA fits.
constexpr int kProducerRegs = 24;
constexpr int kConsumerRegs = 240;
static_assert(kWarpgroupThreads * kProducerRegs + kNumConsumerWG * kWarpgroupThreads * kConsumerRegs <=
                  cta_register_pool(kThreads),
              "register split exceeds the CTA's register pool");

// Key tile size (the N of QK^T and the K of PV). Register budget per consumer thread:
// O accumulator = 64*H/128 fp32, S accumulator = 64*BN/128 fp32, P = 64*BN/128/4 words.
//   H<=128: BN=128 -> O 64 + S 64 + P 16 = 144 registers.
//   H=256 : BN=128 would need O 128 + S 64 + P 16 = 208 plus addressing: too close to 240, so
//           BN=64 -> O 128 + S 32 + P 8 = 168.
// kQKBytes: bytes per Q/K element in shared memory. 1 = e4m3 (the FP8 score path); 2 = bf16 holding
// the dequantized MX values exactly (the exact-score path: Q K^T on bf16 wgmma, fp32-exact sums).
// Either way one wgmma k-step consumes 32 bytes of a row (k32 e4m3 or k16 bf16), so the swizzled
// layout, the descriptors and their per-step advance are the same code with rows kQKBytes*H long.
//
// kCons: consumer warpgroups per CTA (query rows = 64 * kCons): 2, or 3 (FA3's 192-row tile; the
// launcher's default for exact scores at H <= 128): the softmax of a key tile is a latency chain run
// by one warp per scheduler per consumer (docs/HOPPER_FORWARD.md, "Where the time goes"), so a third
// consumer gives each scheduler a third chain to interleave. Registers then: 128*24 + 384*160 =
// 64512; the sequential loop needs O 32 + S 64 + P 16 = 112 at H = 64, and O 64 + S 64 + P 16 = 144
// at H = 128 with P V in two N = 64 halves, both in flight once S is dead (O 64 + P 16 + 2 x 32;
// fwd_sm90_mainloop.cuh).
// kCons = 4 (opt-in, JAX_FA4_SM90_CONSUMERS=4; exact scores at H = 64 only; built, not yet run on a
// GPU): a fourth chain per scheduler. 640 threads leave each at most 96 registers at entry (65536 /
// 640, in 8-register granules): a pool of 61440, of which 128 x 24 + 512 x 112 = 60416; 112 hold
// O 32 + S 32 + P 8 with BN = 64 keys per tile (BN = 128 would need S 64 + P 16: 112 before any
// addressing). ptxas: no spills in the sequential loop (the overlapped loop spills 108 bytes).
template <int H, int kQKBytes = 1, int kCons = kNumConsumerWG> struct TileConfig {
  static_assert(H == 64 || H == 128 || H == 256, "head dim must be 64, 128 or 256");
  static_assert(kQKBytes == 1 || kQKBytes == 2, "Q/K elements are e4m3 (1 byte) or bf16 (2 bytes)");
  static_assert(kCons == 2 || (kCons == 3 && H <= 128) || (kCons == 4 && H == 64 && kQKBytes == 2),
                "3 consumer warpgroups fit the register file at H <= 128 only, 4 at H = 64 with exact scores");
  static constexpr int kBM = 64 * kCons;  // query rows per CTA
  static constexpr int kThreads = (1 + kCons) * kWarpgroupThreads;
  static constexpr int kConsumerRegs = kCons == kNumConsumerWG ? sm90::kConsumerRegs : kCons == 3 ? 160 : 112;
  static_assert(kWarpgroupThreads * kProducerRegs + kCons * kWarpgroupThreads * kConsumerRegs <=
                    cta_register_pool(kThreads),
                "register split exceeds the CTA's register pool");
  static constexpr int kHeadDim = H;
  static constexpr int kRowBytesQK = H * kQKBytes;  // one Q or K row in shared memory
  static constexpr int kStepsQK = kRowBytesQK / 32;  // wgmma k-steps of Q K^T
  static constexpr int kBlockN = (H == 256 || kCons == 4) ? 64 : 128;
  // Shared memory per stage: K tile BN*H*kQKBytes bytes + V^T tile H*BN bytes + BN fp32 key scales.
  // Stages: enough to keep 2 tiles in flight ahead of the consumers; bounded by 227 KB
  // (H = 256 exact: 64 KB Q + 3 x 48 KB stages = 208 KB).
  static constexpr int kStages = (H == 64) ? 4 : 3;
  // Swizzle width of the Q and K tiles: 128B swizzle needs rows of >= 128 bytes, so longer rows
  // (H=256 e4m3, H>=128 bf16) are split into 128-byte column chunks; 64-byte rows (H=64 e4m3) use
  // the 64B swizzle.
  static constexpr int kSwQK = (kRowBytesQK >= 128) ? 128 : 64;
  static constexpr int kChunksQK = kRowBytesQK / kSwQK;
  // Swizzle of the V^T tile: its rows are BN keys (bytes) long.
  static constexpr int kSwV = kBlockN;  // 128 or 64
  static constexpr int kQBytes = kBM * kRowBytesQK;
  static constexpr int kKBytes = kBlockN * kRowBytesQK;
  static constexpr int kVBytes = H * kBlockN;
  // Per consumer thread, 16 bytes for its work tile's coordinates (fwd_sm90_mainloop.cuh says why).
  static constexpr int kSlotBytes = kCons * kWarpgroupThreads * 16;
  static constexpr int kSmemBytes = 1024 /*alignment slack*/ + kQBytes + kStages * (kKBytes + kVBytes) +
                                    kStages * kBlockN * 4 + 256 /*barriers*/ + kSlotBytes;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory budget of one SM exceeded");
  static_assert(kBlockN % 32 == 0, "wgmma fp8 consumes 32 keys per instruction");
  static_assert(kRowBytesQK % 32 == 0, "a Q K^T wgmma k-step consumes 32 bytes of each row");
  static_assert(kRowBytesQK % kSwQK == 0, "Q/K rows must be whole swizzle chunks");
  static_assert(H <= 256, "the PV wgmma has N = H and N <= 256");
  static_assert(kQBytes % 1024 == 0 && kKBytes % 1024 == 0 && kVBytes % 1024 == 0,
                "swizzled tiles must stay 1024-byte aligned");
};

// The key-scale and V^T buffers are padded to a multiple of this along S, so that every key tile
// (BN <= 128) is in bounds and padded keys are exact zeros rather than garbage.
constexpr int kSeqPad = 128;


// ---- backward (bwd_sm90_kernel.cuh) ----
// One CTA = BN = 128 keys of one (batch, kv head): the consumers dequantize K and V (MX in global
// memory) into bf16 tiles once, the producer warpgroup streams (Q, dO, lse, delta) tiles of BM = 64
// queries; each consumer owns 64 keys (wgmma M = 64).
// Every product runs on bf16 wgmma over exact dequantized MX values (bwd_wgmma_ops.cuh).
// Registers per consumer thread: dK and dV accumulators 64*HV/128 fp32 each, S^T and dP^T
// 64*BM/128 each, dQ 64*64/128: HV = 128, BM = 64 -> 64 + 64 + 32 + 32 + 32 = 224 at the peak, so
// HV (the dK/dV/dQ column chunk one CTA accumulates) is capped at 128: H = 256 runs two column
// chunks in separate CTAs, each recomputing S and dP over all 256 columns.
template <int H> struct BwdTileConfig {
  static_assert(H == 64 || H == 128 || H == 256, "head dim must be 64, 128 or 256");
  static constexpr int kBlockN = 64 * kNumConsumerWG;  // 128 keys per CTA
  static constexpr int kBlockM = 64;                   // queries per streamed tile
  static constexpr int kHV = H < 128 ? H : 128;        // output columns per CTA
  static constexpr int kChunks = H / kHV;              // column chunks (CTAs) per key tile
  static constexpr int kRowBytes = 2 * H;              // a bf16 row
  static constexpr int kSw = 128;                      // 128B swizzle: rows are >= 128 bytes
  static constexpr int kAtoms = kRowBytes / kSw;       // 64-column swizzle atoms per row
  // dQ = dS K per consumer: N = 64 columns. With HV = 128 the two consumers split the columns (each
  // contracts all 128 keys); with HV = 64 they split the keys and both add their partial dQ.
  static constexpr bool kSplitKeysDQ = kHV < 128;
  static constexpr int kKBytes = kBlockN * kRowBytes;  // K tile (V the same)
  static constexpr int kQBytes = kBlockM * kRowBytes;  // Q tile (dO the same)
  static constexpr int kDSBytes = kBlockN * kBlockM * 2;  // dS^T tile, bf16
  // Stages of the (Q, dO, lse, delta) ring. H = 256: K + V = 128 KB, one stage 64.5 KB, two dS
  // buffers 32 KB: only one stage fits in 227 KB (its reload overlaps the dQ product only).
  static constexpr int kStages = (H == 256) ? 1 : 2;
  // dQ leaves the CTA through shared memory: each consumer stores its 64 x 64 fp32 dQ tile
  // (128B-swizzled, two 32-column halves) and a producer-warpgroup thread adds it to global dQ
  // with TMA reduce-add (L2 does the fp32 adds, in whole lines), so the consumers issue no atomics:
  // measured on an H200, the register-to-global fp32 atomics were ~20% of the consumers' stall
  // samples (LSU queue full, address registers held). H = 256 has no 32 KB left: atomics there.
  static constexpr int kDQBytes = kNumConsumerWG * kBlockM * 64 * 4;
  static constexpr int kStageBytes = 2 * kQBytes + 2 * kBlockM * 4;
  // The consumers' warps swap the MX scale bytes of dS's 32-key blocks (bwd_sm90_kernel.cuh): per
  // warp BM bytes as BM / 2 u16x2 words of 4 bytes.
  static constexpr int kXchgBytes = kNumConsumerWG * 4 * (kBlockM / 2) * 4;
  static constexpr int kBaseSmemBytes = 1024 /*alignment slack*/ + 2 * kKBytes + kStages * kStageBytes + 2 * kDSBytes +
                                        kXchgBytes + 256 /*barriers*/;
  static constexpr bool kDQViaSmem = kBaseSmemBytes + kDQBytes <= 227 * 1024;
  // Layout: K, V, the stages' Q and dO tiles, two dS^T buffers, the dQ tiles, then the lse / delta
  // rows and the scale-byte exchange (the small rows last, so every swizzled tile keeps its 1024-byte
  // alignment).
  static constexpr int kSmemBytes = kBaseSmemBytes + (kDQViaSmem ? kDQBytes : 0);
  static_assert(kSmemBytes <= 227 * 1024, "backward shared memory exceeds one SM");
  static_assert(kHV % 64 == 0 && H % kHV == 0, "column chunks are whole 64-column swizzle atoms");
  static_assert(kBlockM * 2 == kSw, "a dS^T row (BM bf16) must be exactly one 128-byte swizzle row");
  static_assert(kKBytes % 1024 == 0 && kQBytes % 1024 == 0 && kDSBytes % 1024 == 0,
                "swizzled tiles must stay 1024-byte aligned");
  static_assert(kBlockM * 4 % 16 == 0, "lse / delta rows are bulk copies of 16-byte multiples");
  static_assert(kDQBytes % 1024 == 0, "dQ tiles must stay 1024-byte aligned");
  static_assert(H == 256 || kDQViaSmem, "H <= 128 is meant to take the TMA reduce-add path of dQ");

  // ---- The dQ-warpgroup variant (bwd_sm90_kernel<H, true>, opt-in, H <= 128): warpgroup 0 also
  // computes dQ = dS K from the consumers' dS^T tiles, so the consumers neither meet at barrier 1
  // before dQ (which keeps them in lock-step: docs/HOPPER_BACKWARD.md, "Where the time goes") nor
  // spend the dQ issue, wait and store of every query tile. Registers (ptxas, nvcc 13.0): the CTA's
  // pool is 384 x 168 = 64512 (__launch_bounds__(384, 1), 8-register granules).
  //   H = 64: the consumers' peak (dK + dV + S^T + dP^T) is 128 + addressing; warpgroup 0 holds
  //     one 64-column pass (32 accumulators) and needs 64 (at 56 ptxas drops every setmaxnreg of
  //     the kernel without a warning): 128 x 64 + 256 x 216 = 63488, no spills.
  //   H = 128: the peak is 192 + addressing and needs 224 (the default kernel spills 384 bytes at
  //     216), which leaves 56 for warpgroup 0: too few for a 64-column pass (ptxas drops
  //     setmaxnreg), enough for 32-column passes (16 accumulators): 128 x 56 + 256 x 224 = 64512.
  //     ptxas then spills 5 consumer registers inside the masked-tile branch only (none on full
  //     tiles) and a few of warpgroup 0's loop scalars.
  static constexpr bool kDQWGFits = H <= 128;
  static constexpr int kDQWGPassN = H == 64 ? 64 : 32;                // dQ columns per pass
  static constexpr int kDQWGProducerRegs = H == 64 ? 64 : 56;
  static constexpr int kDQWGConsumerRegs = H == 64 ? 216 : 224;
  static_assert(kWarpgroupThreads * kDQWGProducerRegs + kNumConsumerWG * kWarpgroupThreads * kDQWGConsumerRegs <=
                    cta_register_pool(kThreads),
                "the dQ warpgroup's register split exceeds the CTA's register pool");
  // Extra shared memory: a second scale-byte exchange buffer (the consumers no longer meet at
  // barrier 1 between query tiles, so a warp may write tile it + 1's words while its partner still
  // reads tile it's) and the dS^T full / empty mbarriers (in the 256-byte barrier area).
  static constexpr int kDQWGSmemBytes = kSmemBytes + kXchgBytes;
  static_assert(!kDQWGFits || kDQWGSmemBytes <= 227 * 1024, "the dQ-warpgroup variant exceeds one SM's shared memory");
};

}  // namespace jax_fa4::sm90
