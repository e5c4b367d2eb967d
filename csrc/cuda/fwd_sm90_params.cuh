// Parameters of the sm_90a forward kernel (plain data: shared by the launcher and the kernel).
#pragma once
#include <cstdint>
#include "cuda/mask.cuh"

namespace jax_fa4::sm90 {

enum class OutDtype : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

struct FwdParams {
  int B, T, S, N, Kh, H;  // leading batch dims are folded into B
  int S_pad;              // S rounded up to kSeqPad: the row length of V^T and of the key scales
  int group;              // N / Kh (GQA): query head n reads kv head n / group
  int num_m_blocks;
  int num_work;           // num_m_blocks * N * B work tiles
  int sched_section;      // (head, batch) pairs per scheduler section (fwd_sm90_scheduler.cuh)
  const float* qs;        // [B, N, T]  per-row power-of-two scale of the requantised Q
  const float* ks;        // [B, Kh, S_pad] per-key power-of-two scale of the requantised K (0 past S)
  const float* vs;        // [B, Kh, H] per-column scale of V^T over the whole sequence
  const int32_t* q_len;   // [B] valid query rows (rows past it output 0 and lse -inf)
  const int32_t* kv_len;  // [B] valid keys
  void* o;                // [B, T, N, H] in out_dtype
  float* lse;             // [B, T, N] natural-log log-sum-exp
  OutDtype out_dtype;
  float scale_log2;       // softmax scale * log2(e)
  MaskParams mask;
  int qk_promote;         // experiment: 1 = sum QK^T k-steps in fp32 (env JAX_FA4_SM90_QK_PROMOTE=1)
  int pipelined;          // loop variant bits: 1 overlap (H <= 128), 2 ping-pong, 16 diagnostic (no exp2), 32 "+8" fold
};

}  // namespace jax_fa4::sm90
