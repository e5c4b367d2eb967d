// XLA FFI handlers of the CUDA kernels. Every handler accepts rank >= its logical rank and folds
// all leading dimensions into the batch, so jax.vmap (vmap_method="broadcast_all") works. Handlers
// validate shapes and dtypes, return ffi::Error (never abort) and check every launch. They only
// enqueue work on XLA's stream (no allocation, no synchronisation), so they are command-buffer
// (CUDA graph) compatible.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/launch.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_fa4::cuda {
namespace {

using Dims = ffi::AnyBuffer::Dimensions;

std::string dims_str(Dims d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? "," : "") + std::to_string(d[i]);
  return s + "]";
}

// Product of the leading dims of `d` that precede its last `trailing` dims.
int64_t lead(Dims d, size_t trailing) {
  int64_t n = 1;
  for (size_t i = 0; i + trailing < d.size(); ++i) n *= d[i];
  return n;
}

ffi::Error check_rank(Dims d, size_t min_rank, const char* name) {
  if (d.size() < min_rank)
    return ffi::Error::InvalidArgument(std::string(name) + " has rank " + std::to_string(d.size()) +
                                       ", needs at least " + std::to_string(min_rank) + ": " + dims_str(d));
  return ffi::Error::Success();
}

ffi::Error cuda_error(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + " failed: " + cudaGetErrorString(e));
}

bool float_type_of(ffi::DataType t, FloatType* out) {
  switch (t) {
    case ffi::DataType::F32: *out = FloatType::kF32; return true;
    case ffi::DataType::BF16: *out = FloatType::kBF16; return true;
    case ffi::DataType::F16: *out = FloatType::kF16; return true;
    default: return false;
  }
}

#define JAX_FA4_RETURN_IF_ERROR(expr)      \
  do {                                     \
    ffi::Error _e = (expr);                \
    if (!_e.success()) return _e;          \
  } while (0)

// ---------------------------------------------------------------------------------------------
// quantize: x [..., L, inner] (f32/bf16/f16) -> data [..., L, inner] e4m3, scale [..., ceil(L/32), inner] u8.
ffi::Error QuantizeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> data,
                        ffi::Result<ffi::Buffer<ffi::U8>> scale) {
  FloatType ft;
  if (!float_type_of(x.element_type(), &ft)) return ffi::Error::InvalidArgument("quantize: x must be f32, bf16 or f16");
  if (data->element_type() != ffi::DataType::F8E4M3FN)
    return ffi::Error::InvalidArgument("quantize: data output must be float8_e4m3fn");
  Dims d = x.dimensions();
  JAX_FA4_RETURN_IF_ERROR(check_rank(d, 2, "quantize: x"));
  const int64_t L = d[d.size() - 2], inner = d[d.size() - 1], outer = lead(d, 2);
  if (data->element_count() != x.element_count() ||
      scale->element_count() != outer * ((L + 31) / 32) * inner)
    return ffi::Error::InvalidArgument("quantize: output sizes do not match x " + dims_str(d));
  if (L > INT32_MAX || inner > INT32_MAX) return ffi::Error::InvalidArgument("quantize: axis too long");
  return cuda_error(launch_quantize_mx(x.untyped_data(), ft, static_cast<uint8_t*>(data->untyped_data()),
                                       scale->typed_data(), outer, (int)L, (int)inner, stream),
                    "jax_fa4 quantize kernel");
}

// ---------------------------------------------------------------------------------------------
// prep_rows: x [..., L, NH, HD] -> out [..., L, NH, HD] e4m3 (one scale per row), rs [..., NH, L_pad] f32.
ffi::Error PrepRowsCommon(cudaStream_t stream, ffi::AnyBuffer x, int float_type, const uint8_t* xs,
                          int64_t xs_count, ffi::AnyBuffer out, ffi::Buffer<ffi::F32> rs) {
  Dims d = x.dimensions();
  JAX_FA4_RETURN_IF_ERROR(check_rank(d, 3, "prep_rows: x"));
  const int64_t L = d[d.size() - 3], NH = d[d.size() - 2], HD = d[d.size() - 1], B = lead(d, 3);
  if (HD != 64 && HD != 128 && HD != 256)
    return ffi::Error::InvalidArgument("prep_rows: head dim " + std::to_string(HD) + " not in {64,128,256}");
  Dims rd = rs.dimensions();
  JAX_FA4_RETURN_IF_ERROR(check_rank(rd, 2, "prep_rows: rs"));
  const int64_t L_pad = rd[rd.size() - 1];
  if (L_pad < L || rd[rd.size() - 2] != NH || lead(rd, 2) != B)
    return ffi::Error::InvalidArgument("prep_rows: rs " + dims_str(rd) + " does not match x " + dims_str(d));
  if (out.element_type() != ffi::DataType::F8E4M3FN || out.element_count() != x.element_count())
    return ffi::Error::InvalidArgument("prep_rows: out must be float8_e4m3fn shaped like x");
  if (xs != nullptr && xs_count != B * L * NH * (HD / 32))
    return ffi::Error::InvalidArgument("prep_rows: scale has the wrong size for x " + dims_str(d));
  if (B * L_pad * NH > INT32_MAX) return ffi::Error::InvalidArgument("prep_rows: too many rows");
  return cuda_error(launch_prep_rows(x.untyped_data(), float_type, xs, static_cast<uint8_t*>(out.untyped_data()),
                                     rs.typed_data(), (int)B, (int)L, (int)NH, (int)HD, (int)L_pad, stream),
                    "jax_fa4 prep_rows kernel");
}

ffi::Error PrepRowsMxImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> xs,
                          ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> rs) {
  if (x.element_type() != ffi::DataType::F8E4M3FN)
    return ffi::Error::InvalidArgument("prep_rows_mx: x must be float8_e4m3fn");
  return PrepRowsCommon(stream, x, -1, xs.typed_data(), (int64_t)xs.element_count(), *out, *rs);
}

ffi::Error PrepRowsFloatImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                             ffi::Result<ffi::Buffer<ffi::F32>> rs) {
  FloatType ft;
  if (!float_type_of(x.element_type(), &ft))
    return ffi::Error::InvalidArgument("prep_rows_float: x must be f32, bf16 or f16");
  return PrepRowsCommon(stream, x, (int)ft, nullptr, 0, *out, *rs);
}

// ---------------------------------------------------------------------------------------------
// exact_rows: x [..., HD] (e4m3 with scale [..., HD/32], or f32/bf16/f16) -> out [..., HD] bf16,
// the dequantized MX values blocked along the last axis (the exact-score path's Q and K).
ffi::Error ExactRowsCommon(cudaStream_t stream, ffi::AnyBuffer x, int float_type, const uint8_t* xs,
                           int64_t xs_count, ffi::AnyBuffer out) {
  Dims d = x.dimensions();
  JAX_FA4_RETURN_IF_ERROR(check_rank(d, 1, "exact_rows: x"));
  const int64_t HD = d[d.size() - 1], n = (int64_t)x.element_count();
  if (HD % 32 != 0)
    return ffi::Error::InvalidArgument("exact_rows: last axis " + std::to_string(HD) + " is not a multiple of 32");
  if (out.element_type() != ffi::DataType::BF16 || (int64_t)out.element_count() != n)
    return ffi::Error::InvalidArgument("exact_rows: out must be bfloat16 shaped like x " + dims_str(d));
  if (xs != nullptr && xs_count != n / 32)
    return ffi::Error::InvalidArgument("exact_rows: scale has the wrong size for x " + dims_str(d));
  return cuda_error(launch_exact_rows(x.untyped_data(), float_type, xs, out.untyped_data(), n, stream),
                    "jax_fa4 exact_rows kernel");
}

ffi::Error ExactRowsMxImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> xs,
                           ffi::Result<ffi::AnyBuffer> out) {
  if (x.element_type() != ffi::DataType::F8E4M3FN)
    return ffi::Error::InvalidArgument("exact_rows_mx: x must be float8_e4m3fn");
  return ExactRowsCommon(stream, x, -1, xs.typed_data(), (int64_t)xs.element_count(), *out);
}

ffi::Error ExactRowsFloatImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out) {
  FloatType ft;
  if (!float_type_of(x.element_type(), &ft))
    return ffi::Error::InvalidArgument("exact_rows_float: x must be f32, bf16 or f16");
  return ExactRowsCommon(stream, x, (int)ft, nullptr, 0, *out);
}

// ---------------------------------------------------------------------------------------------
// prep_v: v [..., S, Kh, HD] e4m3, vscale [..., ceil(S/32), Kh, HD] u8, kv_len [...] s32
//   -> vt [..., Kh, HD, S_pad] e4m3, vs [..., Kh, HD] f32.
ffi::Error PrepVImpl(cudaStream_t stream, ffi::AnyBuffer v, ffi::Buffer<ffi::U8> vscale,
                     ffi::Buffer<ffi::S32> kv_len, ffi::Result<ffi::AnyBuffer> vt,
                     ffi::Result<ffi::Buffer<ffi::F32>> vs) {
  if (v.element_type() != ffi::DataType::F8E4M3FN || vt->element_type() != ffi::DataType::F8E4M3FN)
    return ffi::Error::InvalidArgument("prep_v: v and vt must be float8_e4m3fn");
  Dims d = v.dimensions();
  JAX_FA4_RETURN_IF_ERROR(check_rank(d, 3, "prep_v: v"));
  const int64_t S = d[d.size() - 3], Kh = d[d.size() - 2], HD = d[d.size() - 1], B = lead(d, 3);
  Dims td = vt->dimensions();
  JAX_FA4_RETURN_IF_ERROR(check_rank(td, 3, "prep_v: vt"));
  const int64_t S_pad = td[td.size() - 1];
  if (HD != 64 && HD != 128 && HD != 256)
    return ffi::Error::InvalidArgument("prep_v: head dim " + std::to_string(HD) + " must be 64, 128 or 256");
  if (S_pad % kSeqPad != 0 || S_pad < S || td[td.size() - 2] != HD || td[td.size() - 3] != Kh ||
      lead(td, 3) != B)
    return ffi::Error::InvalidArgument("prep_v: vt " + dims_str(td) + " does not match v " + dims_str(d));
  if ((int64_t)vscale.element_count() != B * ((S + 31) / 32) * Kh * HD)
    return ffi::Error::InvalidArgument("prep_v: vscale has the wrong size for v " + dims_str(d));
  if ((int64_t)kv_len.element_count() != B)
    return ffi::Error::InvalidArgument("prep_v: kv_len has " + std::to_string(kv_len.element_count()) +
                                       " elements, v has batch " + std::to_string(B));
  if ((int64_t)vs->element_count() != B * Kh * HD) return ffi::Error::InvalidArgument("prep_v: vs has the wrong size");
  if (B > 65535 || Kh * (HD / 64) > 65535) return ffi::Error::InvalidArgument("prep_v: grid too large");
  return cuda_error(launch_prep_v(static_cast<const uint8_t*>(v.untyped_data()), vscale.typed_data(),
                                  kv_len.typed_data(), static_cast<uint8_t*>(vt->untyped_data()), vs->typed_data(),
                                  (int)B, (int)S, (int)Kh, (int)HD, (int)S_pad, stream),
                    "jax_fa4 prep_v kernels");
}

// ---------------------------------------------------------------------------------------------
// fwd: q8 [..., T, N, H], qs [..., N, T], k8 [..., S, Kh, H], ks [..., Kh, S_pad], vt [..., Kh, H, S_pad],
//      vs [..., Kh, H], q_len [...], kv_len [...]  ->  o [..., T, N, H] (f32/bf16/f16), lse [..., T, N] f32.
// q8 and k8 e4m3: FP8 scores, with their row scales qs and ks. q8 and k8 bf16 (the dequantized MX
// values): exact scores, and qs, ks must be empty.
ffi::Error FwdImpl(cudaStream_t stream, ffi::AnyBuffer q8, ffi::Buffer<ffi::F32> qs, ffi::AnyBuffer k8,
                   ffi::Buffer<ffi::F32> ks, ffi::AnyBuffer vt, ffi::Buffer<ffi::F32> vs,
                   ffi::Buffer<ffi::S32> q_len, ffi::Buffer<ffi::S32> kv_len, float scale, int64_t causal,
                   int64_t window_left, int64_t window_right, ffi::Result<ffi::AnyBuffer> o,
                   ffi::Result<ffi::Buffer<ffi::F32>> lse) {
  const bool exact = q8.element_type() == ffi::DataType::BF16;
  const ffi::DataType qk_type = exact ? ffi::DataType::BF16 : ffi::DataType::F8E4M3FN;
  if (q8.element_type() != qk_type || k8.element_type() != qk_type || vt.element_type() != ffi::DataType::F8E4M3FN)
    return ffi::Error::InvalidArgument("fwd: q8 and k8 must both be float8_e4m3fn or both bfloat16, "
                                       "vt float8_e4m3fn");
  FloatType ot;
  if (!float_type_of(o->element_type(), &ot)) return ffi::Error::InvalidArgument("fwd: o must be f32, bf16 or f16");
  Dims qd = q8.dimensions(), kd = k8.dimensions(), vd = vt.dimensions();
  JAX_FA4_RETURN_IF_ERROR(check_rank(qd, 3, "fwd: q8"));
  JAX_FA4_RETURN_IF_ERROR(check_rank(kd, 3, "fwd: k8"));
  JAX_FA4_RETURN_IF_ERROR(check_rank(vd, 3, "fwd: vt"));
  const int64_t T = qd[qd.size() - 3], N = qd[qd.size() - 2], H = qd[qd.size() - 1], B = lead(qd, 3);
  const int64_t S = kd[kd.size() - 3], Kh = kd[kd.size() - 2];
  const int64_t S_pad = vd[vd.size() - 1];
  if (kd[kd.size() - 1] != H || lead(kd, 3) != B || vd[vd.size() - 2] != H || vd[vd.size() - 3] != Kh ||
      lead(vd, 3) != B)
    return ffi::Error::InvalidArgument("fwd: q8 " + dims_str(qd) + ", k8 " + dims_str(kd) + ", vt " + dims_str(vd) +
                                       " do not agree");
  if (H != 64 && H != 128 && H != 256)
    return ffi::Error::InvalidArgument("fwd: head dim " + std::to_string(H) + " not in {64,128,256}");
  if (Kh <= 0 || N % Kh != 0)
    return ffi::Error::InvalidArgument("fwd: query heads " + std::to_string(N) + " not a multiple of kv heads " +
                                       std::to_string(Kh));
  if (S_pad % kSeqPad != 0 || S_pad < S) return ffi::Error::InvalidArgument("fwd: vt's S_pad is wrong");
  const int64_t qs_want = exact ? 0 : B * N * T, ks_want = exact ? 0 : B * Kh * S_pad;
  if ((int64_t)qs.element_count() != qs_want || (int64_t)ks.element_count() != ks_want ||
      (int64_t)vs.element_count() != B * Kh * H || (int64_t)q_len.element_count() != B ||
      (int64_t)kv_len.element_count() != B)
    return ffi::Error::InvalidArgument("fwd: a scale or length buffer has the wrong size");
  if ((int64_t)o->element_count() != B * T * N * H || (int64_t)lse->element_count() != B * T * N)
    return ffi::Error::InvalidArgument("fwd: o or lse has the wrong size");
  if (T > INT32_MAX || S > INT32_MAX || B > 65535 || N > 65535)
    return ffi::Error::InvalidArgument("fwd: sizes exceed the kernel's grid");
  FwdArgs a{};
  a.B = (int)B; a.T = (int)T; a.S = (int)S; a.N = (int)N; a.Kh = (int)Kh; a.H = (int)H; a.S_pad = (int)S_pad;
  a.exact_scores = exact;
  a.q8 = static_cast<const uint8_t*>(q8.untyped_data());
  a.qs = exact ? nullptr : qs.typed_data();
  a.k8 = static_cast<const uint8_t*>(k8.untyped_data());
  a.ks = exact ? nullptr : ks.typed_data();
  a.vt = static_cast<const uint8_t*>(vt.untyped_data());
  a.vs = vs.typed_data();
  a.q_len = q_len.typed_data();
  a.kv_len = kv_len.typed_data();
  a.o = o->untyped_data();
  a.out_type = ot;
  a.lse = lse->typed_data();
  a.scale = scale;
  a.causal = causal != 0;
  a.window_left = window_left;
  a.window_right = window_right;
  return cuda_error(launch_fwd_sm90(a, stream), "jax_fa4 sm90 forward kernel");
}


// ---------------------------------------------------------------------------------------------
// bwd: q, dout [..., T, N, H] bf16 (exact dequantized MX values); k8, v8 [..., S, Kh, H] e4m3 with
// their E8M0 scale bytes ks, vs [..., S, Kh, H/32] (MX blocked along H: the kernel dequantizes them
// into shared memory, so no bf16 copy of K or V is made); lse2, delta [..., N, T_pad] f32
// -> dq [..., T, N, H] f32 / bf16 / f16 (dS K * scale; may alias q), dk, dv [..., S, Kh, H] f32 /
// bf16 / f16 (both alike), sem [..., N, column chunks, ceil(T/64)] scratch, dq_acc scratch: the fp32
// accumulator of one dQ chunk of dq_chunk_kh kv heads and as many batches as it holds (unused, any
// size, when dq is f32: dq is then its own accumulator).
ffi::Error BwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k8, ffi::Buffer<ffi::U8> ks,
                   ffi::AnyBuffer v8, ffi::Buffer<ffi::U8> vs, ffi::AnyBuffer dout, ffi::Buffer<ffi::F32> lse2,
                   ffi::Buffer<ffi::F32> delta, ffi::Buffer<ffi::S32> q_len, ffi::Buffer<ffi::S32> kv_len,
                   float scale, int64_t causal, int64_t window_left, int64_t window_right, int64_t deterministic,
                   int64_t dq_chunk_kh, ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                   ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::Buffer<ffi::S32>> sem,
                   ffi::Result<ffi::Buffer<ffi::F32>> dq_acc) {
  for (const ffi::AnyBuffer* x : {&q, &dout})
    if (x->element_type() != ffi::DataType::BF16)
      return ffi::Error::InvalidArgument("bwd: q and dout must be bfloat16 (exact MX values)");
  for (const ffi::AnyBuffer* x : {&k8, &v8})
    if (x->element_type() != ffi::DataType::F8E4M3FN)
      return ffi::Error::InvalidArgument("bwd: k8 and v8 must be float8_e4m3fn (MX data blocked along H)");
  Dims qd = q.dimensions(), kd = k8.dimensions(), ld = lse2.dimensions();
  JAX_FA4_RETURN_IF_ERROR(check_rank(qd, 3, "bwd: q"));
  JAX_FA4_RETURN_IF_ERROR(check_rank(kd, 3, "bwd: k8"));
  JAX_FA4_RETURN_IF_ERROR(check_rank(ld, 2, "bwd: lse2"));
  const int64_t T = qd[qd.size() - 3], N = qd[qd.size() - 2], H = qd[qd.size() - 1], B = lead(qd, 3);
  const int64_t S = kd[kd.size() - 3], Kh = kd[kd.size() - 2];
  const int64_t T_pad = ld[ld.size() - 1];
  if (kd[kd.size() - 1] != H || lead(kd, 3) != B || v8.element_count() != k8.element_count() ||
      dout.element_count() != q.element_count())
    return ffi::Error::InvalidArgument("bwd: q " + dims_str(qd) + " and k8 " + dims_str(kd) +
                                       " (v8, dout alike) do not agree");
  if (H != 64 && H != 128 && H != 256)
    return ffi::Error::InvalidArgument("bwd: head dim " + std::to_string(H) + " not in {64,128,256}");
  if ((int64_t)ks.element_count() != (int64_t)k8.element_count() / 32 ||
      (int64_t)vs.element_count() != (int64_t)v8.element_count() / 32)
    return ffi::Error::InvalidArgument("bwd: ks / vs must hold one scale byte per 32 elements of k8 / v8 " +
                                       dims_str(kd));
  if (Kh <= 0 || N % Kh != 0)
    return ffi::Error::InvalidArgument("bwd: query heads " + std::to_string(N) + " not a multiple of kv heads " +
                                       std::to_string(Kh));
  if (T_pad % kBwdBlockM != 0 || T_pad < T || (int64_t)lse2.element_count() != B * N * T_pad ||
      (int64_t)delta.element_count() != B * N * T_pad)
    return ffi::Error::InvalidArgument("bwd: lse2 / delta must be [B, N, T_pad], T_pad a multiple of 64 >= T");
  if ((int64_t)q_len.element_count() != B || (int64_t)kv_len.element_count() != B)
    return ffi::Error::InvalidArgument("bwd: q_len and kv_len must have B entries");
  if ((int64_t)dq->element_count() != B * T * N * H || (int64_t)dk->element_count() != B * S * Kh * H ||
      (int64_t)dv->element_count() != B * S * Kh * H ||
      (int64_t)sem->element_count() != B * N * bwd_column_chunks((int)H) * ((T + kBwdBlockM - 1) / kBwdBlockM))
    return ffi::Error::InvalidArgument("bwd: an output has the wrong size");
  FloatType dkv_type, dq_type;
  if (!float_type_of(dk->element_type(), &dkv_type) || dv->element_type() != dk->element_type())
    return ffi::Error::InvalidArgument("bwd: dk and dv must both be f32, bf16 or f16");
  if (!float_type_of(dq->element_type(), &dq_type))
    return ffi::Error::InvalidArgument("bwd: dq must be f32, bf16 or f16");
  // dQ chunks: dq_chunk_kh kv heads by as many batches as dq_acc holds (all of them at most).
  int64_t chunk_b = B, chunk_kh = Kh;
  if (dq_type != FloatType::kF32 && B > 0 && T > 0 && N > 0) {
    if (dq_chunk_kh < 1 || dq_chunk_kh > Kh)
      return ffi::Error::InvalidArgument("bwd: dq_chunk_kh " + std::to_string(dq_chunk_kh) + " not in [1, " +
                                         std::to_string(Kh) + "]");
    chunk_kh = dq_chunk_kh;
    const int64_t per_batch = T * chunk_kh * (N / Kh) * H;
    chunk_b = (int64_t)dq_acc->element_count() / per_batch;
    if (chunk_b < 1)
      return ffi::Error::InvalidArgument("bwd: dq_acc holds " + std::to_string(dq_acc->element_count()) +
                                         " values, less than one batch of a dQ chunk (" + std::to_string(per_batch) +
                                         ")");
    if (chunk_b > B) chunk_b = B;
  }
  if (T > INT32_MAX || S > INT32_MAX - 128 || B > 65535 || Kh * ((H + 127) / 128) > 65535 /* kv heads x column chunks */)
    return ffi::Error::InvalidArgument("bwd: sizes exceed the kernel's grid");
  BwdArgs a{};
  a.B = (int)B; a.T = (int)T; a.S = (int)S; a.N = (int)N; a.Kh = (int)Kh; a.H = (int)H; a.T_pad = (int)T_pad;
  a.q = q.untyped_data();
  a.k8 = static_cast<const uint8_t*>(k8.untyped_data());
  a.ks = ks.typed_data();
  a.v8 = static_cast<const uint8_t*>(v8.untyped_data());
  a.vs = vs.typed_data();
  a.dout = dout.untyped_data();
  a.lse2 = lse2.typed_data();
  a.delta = delta.typed_data();
  a.q_len = q_len.typed_data();
  a.kv_len = kv_len.typed_data();
  a.dq = dq->untyped_data();
  a.dq_type = dq_type;
  a.dq_acc = dq_type == FloatType::kF32 ? static_cast<float*>(dq->untyped_data()) : dq_acc->typed_data();
  a.chunk_b = (int)chunk_b;
  a.chunk_kh = (int)chunk_kh;
  a.dk = dk->untyped_data();
  a.dv = dv->untyped_data();
  a.dkv_type = dkv_type;
  a.sem = sem->typed_data();
  a.scale = scale;
  a.causal = causal != 0;
  a.deterministic = deterministic != 0;
  a.window_left = window_left;
  a.window_right = window_right;
  return cuda_error(launch_bwd_sm90(a, stream), "jax_fa4 sm90 backward kernel");
}

}  // namespace
}  // namespace jax_fa4::cuda

using namespace jax_fa4::cuda;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFa4CudaQuantize, QuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()               // x [..., L, inner] f32/bf16/f16
                                  .Ret<ffi::AnyBuffer>()               // data, e4m3
                                  .Ret<ffi::Buffer<ffi::U8>>(),        // scale bytes (e8m0)
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFa4CudaPrepRowsMx, PrepRowsMxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()               // x [..., L, NH, HD] e4m3
                                  .Arg<ffi::Buffer<ffi::U8>>()         // x's block scales [..., L, NH, HD/32]
                                  .Ret<ffi::AnyBuffer>()               // requantised rows, e4m3
                                  .Ret<ffi::Buffer<ffi::F32>>(),       // row scales [..., NH, L_pad]
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFa4CudaPrepRowsFloat, PrepRowsFloatImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()               // x [..., L, NH, HD] f32/bf16/f16
                                  .Ret<ffi::AnyBuffer>()               // quantised + requantised rows, e4m3
                                  .Ret<ffi::Buffer<ffi::F32>>(),       // row scales [..., NH, L_pad]
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFa4CudaExactRowsMx, ExactRowsMxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()               // x [..., HD] e4m3
                                  .Arg<ffi::Buffer<ffi::U8>>()         // x's block scales [..., HD/32]
                                  .Ret<ffi::AnyBuffer>(),              // bf16 [..., HD], dequantized
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFa4CudaExactRowsFloat, ExactRowsFloatImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()               // x [..., HD] f32/bf16/f16
                                  .Ret<ffi::AnyBuffer>(),              // bf16 [..., HD], quantized + dequantized
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFa4CudaPrepV, PrepVImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()               // v [..., S, Kh, HD] e4m3
                                  .Arg<ffi::Buffer<ffi::U8>>()         // v's block scales [..., S/32, Kh, HD]
                                  .Arg<ffi::Buffer<ffi::S32>>()        // kv_len [...]
                                  .Ret<ffi::AnyBuffer>()               // vt [..., Kh, HD, S_pad] e4m3
                                  .Ret<ffi::Buffer<ffi::F32>>(),       // vs [..., Kh, HD] column scales
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFa4CudaFwd, FwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()               // q8 [..., T, N, H] e4m3 (or bf16: exact scores)
                                  .Arg<ffi::Buffer<ffi::F32>>()        // qs [..., N, T] (empty for exact scores)
                                  .Arg<ffi::AnyBuffer>()               // k8 [..., S, Kh, H] e4m3 (or bf16)
                                  .Arg<ffi::Buffer<ffi::F32>>()        // ks [..., Kh, S_pad] (empty for exact scores)
                                  .Arg<ffi::AnyBuffer>()               // vt [..., Kh, H, S_pad] e4m3
                                  .Arg<ffi::Buffer<ffi::F32>>()        // vs [..., Kh, H]
                                  .Arg<ffi::Buffer<ffi::S32>>()        // q_len [...]
                                  .Arg<ffi::Buffer<ffi::S32>>()        // kv_len [...]
                                  .Attr<float>("scale")                // softmax scale (fp32)
                                  .Attr<int64_t>("causal")             // 0 / 1
                                  .Attr<int64_t>("window_left")        // -1: unbounded
                                  .Attr<int64_t>("window_right")       // -1: unbounded
                                  .Ret<ffi::AnyBuffer>()               // o [..., T, N, H]
                                  .Ret<ffi::Buffer<ffi::F32>>(),       // lse [..., T, N]
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFa4CudaBwd, BwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()               // q [..., T, N, H] bf16 (q blocked along H, exact)
                                  .Arg<ffi::AnyBuffer>()               // k8 [..., S, Kh, H] e4m3 (k blocked along H)
                                  .Arg<ffi::Buffer<ffi::U8>>()         // ks [..., S, Kh, H/32] k8's scale bytes (E8M0)
                                  .Arg<ffi::AnyBuffer>()               // v8 [..., S, Kh, H] e4m3 (v blocked along H)
                                  .Arg<ffi::Buffer<ffi::U8>>()         // vs [..., S, Kh, H/32] v8's scale bytes (E8M0)
                                  .Arg<ffi::AnyBuffer>()               // dout [..., T, N, H] bf16
                                  .Arg<ffi::Buffer<ffi::F32>>()        // lse2 [..., N, T_pad]
                                  .Arg<ffi::Buffer<ffi::F32>>()        // delta [..., N, T_pad]
                                  .Arg<ffi::Buffer<ffi::S32>>()        // q_len [...]
                                  .Arg<ffi::Buffer<ffi::S32>>()        // kv_len [...]
                                  .Attr<float>("scale")                // softmax scale (fp32)
                                  .Attr<int64_t>("causal")             // 0 / 1
                                  .Attr<int64_t>("window_left")        // -1: unbounded
                                  .Attr<int64_t>("window_right")       // -1: unbounded
                                  .Attr<int64_t>("deterministic")      // 0 / 1: ordered dQ adds
                                  .Attr<int64_t>("dq_chunk_kh")        // kv heads per dQ chunk (bf16/f16 dq)
                                  .Ret<ffi::AnyBuffer>()               // dq [..., T, N, H] f32 / bf16 / f16, * scale
                                  .Ret<ffi::AnyBuffer>()               // dk [..., S, Kh, H] f32 / bf16 / f16
                                  .Ret<ffi::AnyBuffer>()               // dv [..., S, Kh, H], dk's dtype
                                  .Ret<ffi::Buffer<ffi::S32>>()        // sem [..., N, chunks, ceil(T/64)] scratch
                                  .Ret<ffi::Buffer<ffi::F32>>(),       // dq_acc: one dQ chunk's fp32 accumulator
                              {ffi::Traits::kCmdBufferCompatible});
