// XLA FFI handlers (platform "cpu") of the MXFP8 attention kernels in mx_attention_cpu.h.
//
// Targets (registered by jax_fa4/_cpu_ops.py from the capsules of module_cpu.cc):
//   jax_fa4_mx_fwd: (q, q_scale, k, k_scale, v, v_scale, q_seqlen, kv_seqlen) -> (o, lse)
//   jax_fa4_mx_bwd: (q_h, q_h_scale, q_t, q_t_scale, k_h, k_h_scale, k_s, k_s_scale, v_h,
//                    v_h_scale, do_h, do_h_scale, do_t, do_t_scale, lse, delta, q_seqlen,
//                    kv_seqlen) -> (dq, dk, dv)
// attrs of both: scale (f32), is_causal (bool), window_left (s64), window_right (s64).
// Every dimension before the last three (two for lse/delta, none for the seqlens) is one
// flattened batch. Bad shapes or dtypes return ffi::Error (InvalidArgument); nothing aborts.
#include <cstdint>
#include <string>
#include <vector>

#include "cpu/mx_attention_cpu.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_fa4 {
namespace cpu {
namespace {

using Dimensions = ffi::AnyBuffer::Dimensions;

std::string dims_str(Dimensions d) {
  std::string s = "(";
  for (size_t i = 0; i < d.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(d[i]);
  }
  if (d.size() == 1) s += ",";
  return s + ")";
}

std::string vec_str(const std::vector<int64_t>& d) {
  std::string s = "(";
  for (size_t i = 0; i < d.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(d[i]);
  }
  if (d.size() == 1) s += ",";
  return s + ")";
}

bool same(Dimensions d, const std::vector<int64_t>& want) {
  if (d.size() != want.size()) return false;
  for (size_t i = 0; i < want.size(); ++i)
    if (d[i] != want[i]) return false;
  return true;
}

// The flattened batch prefix of a [..., X, Y, Z] operand.
std::vector<int64_t> prefix(Dimensions d, size_t trailing) {
  return std::vector<int64_t>(d.begin(), d.end() - trailing);
}
std::vector<int64_t> with(std::vector<int64_t> p, std::initializer_list<int64_t> tail) {
  p.insert(p.end(), tail.begin(), tail.end());
  return p;
}
int64_t product(const std::vector<int64_t>& p) {
  int64_t n = 1;
  for (int64_t x : p) n *= x;
  return n;
}

ffi::Error bad(const std::string& msg) {
  return ffi::Error::InvalidArgument("jax_fa4 cpu kernel: " + msg);
}

ffi::Error check_e4m3(const ffi::AnyBuffer& x, const char* name) {
  if (x.element_type() != ffi::DataType::F8E4M3FN)
    return bad(std::string(name) + ".dtype must be float8_e4m3fn (FFI dtype code " +
               std::to_string(static_cast<int>(x.element_type())) + " given)");
  return ffi::Error::Success();
}

template <typename Buf>
ffi::Error check_shape(const Buf& x, const char* name, const std::vector<int64_t>& want) {
  if (!same(x.dimensions(), want))
    return bad(std::string(name) + ".shape=" + dims_str(x.dimensions()) + " must be " +
               vec_str(want));
  return ffi::Error::Success();
}

#define JFA_RETURN_IF_ERROR(expr)   \
  do {                              \
    ffi::Error _e = (expr);         \
    if (_e.failure()) return _e;    \
  } while (0)

// Decodes [..., T, N, H] of q and [..., S, K, H] of k and checks the head structure.
ffi::Error decode_dims(const ffi::AnyBuffer& q, const char* qname, const ffi::AnyBuffer& k,
                       const char* kname, Dims* d, std::vector<int64_t>* batch) {
  Dimensions qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() < 3)
    return bad(std::string(qname) + ".shape=" + dims_str(qd) + " must be [..., T, N, H]");
  *batch = prefix(qd, 3);
  const size_t r = qd.size();
  d->T = qd[r - 3];
  d->N = qd[r - 2];
  d->H = qd[r - 1];
  if (kd.size() != r)
    return bad(std::string(kname) + ".shape=" + dims_str(kd) + " must have rank " +
               std::to_string(r) + " like " + qname + ".shape=" + dims_str(qd));
  if (!same(Dimensions(kd.begin(), r - 3), *batch))
    return bad(std::string(kname) + ".shape=" + dims_str(kd) + " and " + qname + ".shape=" +
               dims_str(qd) + " must share the batch dims");
  d->S = kd[r - 3];
  d->K = kd[r - 2];
  if (kd[r - 1] != d->H)
    return bad(std::string(kname) + ".shape=" + dims_str(kd) + ": head dim must be H=" +
               std::to_string(d->H) + " like " + qname);
  if (d->H % 32 != 0 || d->H < 32 || d->H > 256)
    return bad("head dim H=" + std::to_string(d->H) + " must be a multiple of 32 in [32, 256]");
  if (d->K < 1 || d->N % d->K != 0)
    return bad("num_heads N=" + std::to_string(d->N) + " must be a multiple of num_kv_heads K=" +
               std::to_string(d->K));
  d->batch = product(*batch);
  return ffi::Error::Success();
}

ffi::Error check_mask_attrs(int64_t window_left, int64_t window_right) {
  if (window_left < -1) return bad("window_left=" + std::to_string(window_left) + " must be >= -1");
  if (window_right < -1)
    return bad("window_right=" + std::to_string(window_right) + " must be >= -1");
  return ffi::Error::Success();
}

// The fields ForwardArgs and BackwardArgs share: sizes, lengths, softmax scale and mask.
template <typename Args>
void fill_common(Args& a, const Dims& d, ffi::Buffer<ffi::S32>& q_seqlen, ffi::Buffer<ffi::S32>& kv_seqlen,
                 float scale, bool is_causal, int64_t window_left, int64_t window_right) {
  a.d = d;
  a.q_seqlen = q_seqlen.typed_data();
  a.kv_seqlen = kv_seqlen.typed_data();
  a.scale = scale;
  a.mask.is_causal = is_causal;
  a.mask.window_left = window_left;
  a.mask.window_right = window_right;
}

ffi::Error MxFwdImpl(ffi::AnyBuffer q, ffi::Buffer<ffi::U8> q_scale, ffi::AnyBuffer k,
                     ffi::Buffer<ffi::U8> k_scale, ffi::AnyBuffer v, ffi::Buffer<ffi::U8> v_scale,
                     ffi::Buffer<ffi::S32> q_seqlen, ffi::Buffer<ffi::S32> kv_seqlen, float scale,
                     bool is_causal, int64_t window_left, int64_t window_right,
                     ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> lse) {
  JFA_RETURN_IF_ERROR(check_e4m3(q, "q"));
  JFA_RETURN_IF_ERROR(check_e4m3(k, "k"));
  JFA_RETURN_IF_ERROR(check_e4m3(v, "v"));
  Dims d;
  std::vector<int64_t> batch;
  JFA_RETURN_IF_ERROR(decode_dims(q, "q", k, "k", &d, &batch));
  const int64_t H32 = d.H / 32, Sb = (d.S + 31) / 32;
  JFA_RETURN_IF_ERROR(check_shape(q_scale, "q_scale", with(batch, {d.T, d.N, H32})));
  JFA_RETURN_IF_ERROR(check_shape(k_scale, "k_scale", with(batch, {d.S, d.K, H32})));
  JFA_RETURN_IF_ERROR(check_shape(v, "v", with(batch, {d.S, d.K, d.H})));
  JFA_RETURN_IF_ERROR(check_shape(v_scale, "v_scale", with(batch, {Sb, d.K, d.H})));
  JFA_RETURN_IF_ERROR(check_shape(q_seqlen, "q_seqlen", batch));
  JFA_RETURN_IF_ERROR(check_shape(kv_seqlen, "kv_seqlen", batch));
  JFA_RETURN_IF_ERROR(check_shape(*o, "o", with(batch, {d.T, d.N, d.H})));
  JFA_RETURN_IF_ERROR(check_shape(*lse, "lse", with(batch, {d.T, d.N})));
  JFA_RETURN_IF_ERROR(check_mask_attrs(window_left, window_right));

  ForwardArgs a;
  fill_common(a, d, q_seqlen, kv_seqlen, scale, is_causal, window_left, window_right);
  a.q = static_cast<const uint8_t*>(q.untyped_data());
  a.q_scale = q_scale.typed_data();
  a.k = static_cast<const uint8_t*>(k.untyped_data());
  a.k_scale = k_scale.typed_data();
  a.v = static_cast<const uint8_t*>(v.untyped_data());
  a.v_scale = v_scale.typed_data();
  a.o = o->typed_data();
  a.lse = lse->typed_data();
  if (!mx_attention_forward(a))
    return ffi::Error::Internal("jax_fa4 cpu kernel: out of memory in the forward pass");
  return ffi::Error::Success();
}

ffi::Error MxBwdImpl(ffi::AnyBuffer q_h, ffi::Buffer<ffi::U8> q_h_scale, ffi::AnyBuffer q_t,
                     ffi::Buffer<ffi::U8> q_t_scale, ffi::AnyBuffer k_h,
                     ffi::Buffer<ffi::U8> k_h_scale, ffi::AnyBuffer k_s,
                     ffi::Buffer<ffi::U8> k_s_scale, ffi::AnyBuffer v_h,
                     ffi::Buffer<ffi::U8> v_h_scale, ffi::AnyBuffer do_h,
                     ffi::Buffer<ffi::U8> do_h_scale, ffi::AnyBuffer do_t,
                     ffi::Buffer<ffi::U8> do_t_scale, ffi::Buffer<ffi::F32> lse,
                     ffi::Buffer<ffi::F32> delta, ffi::Buffer<ffi::S32> q_seqlen,
                     ffi::Buffer<ffi::S32> kv_seqlen, float scale, bool is_causal,
                     int64_t window_left, int64_t window_right, ffi::ResultBuffer<ffi::F32> dq,
                     ffi::ResultBuffer<ffi::F32> dk, ffi::ResultBuffer<ffi::F32> dv) {
  JFA_RETURN_IF_ERROR(check_e4m3(q_h, "q_h"));
  JFA_RETURN_IF_ERROR(check_e4m3(q_t, "q_t"));
  JFA_RETURN_IF_ERROR(check_e4m3(k_h, "k_h"));
  JFA_RETURN_IF_ERROR(check_e4m3(k_s, "k_s"));
  JFA_RETURN_IF_ERROR(check_e4m3(v_h, "v_h"));
  JFA_RETURN_IF_ERROR(check_e4m3(do_h, "do_h"));
  JFA_RETURN_IF_ERROR(check_e4m3(do_t, "do_t"));
  Dims d;
  std::vector<int64_t> batch;
  JFA_RETURN_IF_ERROR(decode_dims(q_h, "q_h", k_h, "k_h", &d, &batch));
  const int64_t H32 = d.H / 32, Tb = (d.T + 31) / 32, Sb = (d.S + 31) / 32;
  const auto qshape = with(batch, {d.T, d.N, d.H}), kshape = with(batch, {d.S, d.K, d.H});
  JFA_RETURN_IF_ERROR(check_shape(q_h_scale, "q_h_scale", with(batch, {d.T, d.N, H32})));
  JFA_RETURN_IF_ERROR(check_shape(q_t, "q_t", qshape));
  JFA_RETURN_IF_ERROR(check_shape(q_t_scale, "q_t_scale", with(batch, {Tb, d.N, d.H})));
  JFA_RETURN_IF_ERROR(check_shape(k_h_scale, "k_h_scale", with(batch, {d.S, d.K, H32})));
  JFA_RETURN_IF_ERROR(check_shape(k_s, "k_s", kshape));
  JFA_RETURN_IF_ERROR(check_shape(k_s_scale, "k_s_scale", with(batch, {Sb, d.K, d.H})));
  JFA_RETURN_IF_ERROR(check_shape(v_h, "v_h", kshape));
  JFA_RETURN_IF_ERROR(check_shape(v_h_scale, "v_h_scale", with(batch, {d.S, d.K, H32})));
  JFA_RETURN_IF_ERROR(check_shape(do_h, "do_h", qshape));
  JFA_RETURN_IF_ERROR(check_shape(do_h_scale, "do_h_scale", with(batch, {d.T, d.N, H32})));
  JFA_RETURN_IF_ERROR(check_shape(do_t, "do_t", qshape));
  JFA_RETURN_IF_ERROR(check_shape(do_t_scale, "do_t_scale", with(batch, {Tb, d.N, d.H})));
  JFA_RETURN_IF_ERROR(check_shape(lse, "lse", with(batch, {d.T, d.N})));
  JFA_RETURN_IF_ERROR(check_shape(delta, "delta", with(batch, {d.T, d.N})));
  JFA_RETURN_IF_ERROR(check_shape(q_seqlen, "q_seqlen", batch));
  JFA_RETURN_IF_ERROR(check_shape(kv_seqlen, "kv_seqlen", batch));
  JFA_RETURN_IF_ERROR(check_shape(*dq, "dq", qshape));
  JFA_RETURN_IF_ERROR(check_shape(*dk, "dk", kshape));
  JFA_RETURN_IF_ERROR(check_shape(*dv, "dv", kshape));
  JFA_RETURN_IF_ERROR(check_mask_attrs(window_left, window_right));

  auto u8 = [](const ffi::AnyBuffer& b) { return static_cast<const uint8_t*>(b.untyped_data()); };
  BackwardArgs a;
  fill_common(a, d, q_seqlen, kv_seqlen, scale, is_causal, window_left, window_right);
  a.q_h = u8(q_h);
  a.q_h_scale = q_h_scale.typed_data();
  a.q_t = u8(q_t);
  a.q_t_scale = q_t_scale.typed_data();
  a.k_h = u8(k_h);
  a.k_h_scale = k_h_scale.typed_data();
  a.k_s = u8(k_s);
  a.k_s_scale = k_s_scale.typed_data();
  a.v_h = u8(v_h);
  a.v_h_scale = v_h_scale.typed_data();
  a.do_h = u8(do_h);
  a.do_h_scale = do_h_scale.typed_data();
  a.do_t = u8(do_t);
  a.do_t_scale = do_t_scale.typed_data();
  a.lse = lse.typed_data();
  a.delta = delta.typed_data();
  a.dq = dq->typed_data();
  a.dk = dk->typed_data();
  a.dv = dv->typed_data();
  if (!mx_attention_backward(a))
    return ffi::Error::Internal("jax_fa4 cpu kernel: out of memory in the backward pass");
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cpu
}  // namespace jax_fa4

// Target jax_fa4_mx_fwd (platform "cpu").
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFa4MxFwdCpu, jax_fa4::cpu::MxFwdImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // q: e4m3 [..., T, N, H]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // q_scale: [..., T, N, H/32]
                                  .Arg<ffi::AnyBuffer>()         // k: e4m3 [..., S, K, H]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // k_scale: [..., S, K, H/32]
                                  .Arg<ffi::AnyBuffer>()         // v: e4m3 [..., S, K, H]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // v_scale: [..., ceil(S/32), K, H]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_seqlen: [...]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_seqlen: [...]
                                  .Attr<float>("scale")          // softmax scale (f32)
                                  .Attr<bool>("is_causal")       // top-left aligned causal mask
                                  .Attr<int64_t>("window_left")  // -1 = unbounded
                                  .Attr<int64_t>("window_right")  // -1 = unbounded
                                  .Ret<ffi::Buffer<ffi::F32>>()  // o: [..., T, N, H]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse: [..., T, N]
);

// Target jax_fa4_mx_bwd (platform "cpu").
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFa4MxBwdCpu, jax_fa4::cpu::MxBwdImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // q_h: e4m3 [..., T, N, H]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // q_h_scale: [..., T, N, H/32]
                                  .Arg<ffi::AnyBuffer>()         // q_t: e4m3 [..., T, N, H]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // q_t_scale: [..., ceil(T/32), N, H]
                                  .Arg<ffi::AnyBuffer>()         // k_h: e4m3 [..., S, K, H]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // k_h_scale: [..., S, K, H/32]
                                  .Arg<ffi::AnyBuffer>()         // k_s: e4m3 [..., S, K, H]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // k_s_scale: [..., ceil(S/32), K, H]
                                  .Arg<ffi::AnyBuffer>()         // v_h: e4m3 [..., S, K, H]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // v_h_scale: [..., S, K, H/32]
                                  .Arg<ffi::AnyBuffer>()         // do_h: e4m3 [..., T, N, H]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // do_h_scale: [..., T, N, H/32]
                                  .Arg<ffi::AnyBuffer>()         // do_t: e4m3 [..., T, N, H]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // do_t_scale: [..., ceil(T/32), N, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lse: [..., T, N]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // delta = rowsum(o * dO): [..., T, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_seqlen: [...]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_seqlen: [...]
                                  .Attr<float>("scale")          // softmax scale (f32)
                                  .Attr<bool>("is_causal")       // top-left aligned causal mask
                                  .Attr<int64_t>("window_left")  // -1 = unbounded
                                  .Attr<int64_t>("window_right")  // -1 = unbounded
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dq: [..., T, N, H]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dk: [..., S, K, H]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dv: [..., S, K, H]
);
