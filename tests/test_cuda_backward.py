"""The Hopper (sm_90a) CUDA backward kernel against the accuracy contract (NUMERICS.md section 4).

Each case draws fresh random inputs (a new seed per run, printed), runs the CUDA forward (for O and
lse, as training does) and the CUDA backward, and checks dQ, dK, dV against float64 gradients on
the dequantized MX inputs, with the jnp recipe (on the CPU backend, where XLA keeps every e4m3
rounding) and bf16 attention as the contract's yardsticks; outputs are poisoned before each run.
Then: rows past the lengths exactly zero, deterministic mode bitwise reproducible, jax.grad through
dot_product_attention on the GPU default backend within the contract, jit/vmap, bad input.
Skipped where the kernels are not available (no extension or no compute-capability 9.0 GPU).
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from contract import _bf16, assert_contract, make_do, make_qkv
# Shared with the forward's GPU tests: availability, the op module, the mask of the float64 truth.
from test_cuda_forward import _cuda_available, _keep, _ops, kernel_switches
from jax_fa4 import mx, reference


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _cuda_available(), reason="jax_fa4 CUDA kernels unavailable "
                                 "(needs the _jax_fa4_cuda extension and a Hopper GPU)")]

_SEED = int(os.environ.get("JAX_FA4_TEST_SEED", np.random.SeedSequence().entropy % (2**31)))
print(f"test_cuda_backward seed: {_SEED}")


# ---------------------------------------------------------------------------------------------
# float64 truth through BLAS, one (batch, head) at a time (reference.truth_backward's arithmetic).

def _truth64_grads(qd, kd, vd, do, *, scale, is_causal, window, q_len, kv_len):
  q, k, v, g = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (qd, kd, vd, do))
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  keep = _keep(B, T, S, is_causal, window, q_len, kv_len)
  dq = np.zeros_like(q)
  dk = np.zeros_like(k)
  dv = np.zeros_like(v)
  for b in range(B):
    for n in range(N):
      kh = n // G
      s = np.where(keep[b, 0], (q[b, :, n] @ k[b, :, kh].T) * scale, -np.inf)
      m = s.max(-1, keepdims=True)
      m = np.where(np.isneginf(m), 0.0, m)
      e = np.exp(s - m)
      l = e.sum(-1, keepdims=True)
      p = e / np.where(l > 0, l, 1.0)
      o = p @ v[b, :, kh]
      delta = (o * g[b, :, n]).sum(-1, keepdims=True)
      ds = p * (g[b, :, n] @ v[b, :, kh].T - delta)
      dq[b, :, n] = ds @ k[b, :, kh] * scale
      dk[b, :, kh] += ds.T @ q[b, :, n] * scale
      dv[b, :, kh] += p.T @ g[b, :, n]
  return dq, dk, dv


def test_truth64_grads_match_reference_truth():
  q, k, v = make_qkv("normal", 2, 17, 40, 4, 2, 64, seed=_SEED)
  do = make_do("varying", 2, 17, 4, 64, seed=_SEED)
  ql, kl = np.array([17, 9], np.int32), np.array([33, 40], np.int32)
  want = reference.truth_backward(q, k, v, do, scale=0.125, is_causal=True, window=(5, None),
                                  q_seqlen=ql, kv_seqlen=kl)
  got = _truth64_grads(q, k, v, do, scale=0.125, is_causal=True, window=(5, None), q_len=ql, kv_len=kl)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Cases: (B, T, S, N, K, H, causal, window, kind, do_kind, lengths or None)

CASES = [
    (1, 256, 256, 2, 1, 128, False, None, "normal", "normal", None),
    (1, 256, 256, 2, 2, 128, True, None, "channel_outliers", "varying", None),
    (1, 256, 256, 4, 2, 128, False, None, "token_outliers", "normal", None),
    (1, 256, 256, 2, 1, 128, False, None, "tiny", "varying", None),
    (1, 256, 256, 4, 1, 128, True, None, "token_outliers", "varying", None),
    (2, 113, 200, 4, 1, 64, True, None, "normal", "varying", ((113, 50), (200, 31))),
    (1, 200, 300, 2, 1, 256, False, None, "normal", "normal", None),
    (1, 256, 256, 2, 2, 256, True, (40, None), "channel_outliers", "varying", None),
    (1, 300, 300, 2, 1, 128, False, (64, 32), "normal", "normal", None),
    (1, 1, 1, 1, 1, 64, False, None, "normal", "normal", None),
    (1, 31, 1023, 2, 1, 128, False, None, "normal", "varying", None),
    (1, 1023, 31, 2, 2, 64, True, None, "token_outliers", "normal", None),
    (3, 130, 200, 2, 1, 128, True, None, "normal", "normal", ((130, 7, 0), (200, 0, 64))),
    (1, 100, 300, 2, 1, 128, True, None, "channel_outliers", "normal", None),
    (1, 128, 192, 8, 1, 64, False, None, "normal", "varying", None),
    (1, 128, 2048, 2, 1, 128, False, None, "normal", "normal", None),
    (1, 160, 160, 2, 1, 256, False, (None, 20), "tiny", "normal", None),
]


def _ids(c):
  B, T, S, N, K, H, causal, window, kind, do_kind, lens = c
  return (f"B{B}-T{T}-S{S}-N{N}-K{K}-H{H}-{'causal' if causal else 'full'}-w{window}-{kind}-do_{do_kind}"
          + ("-ragged" if lens else ""))


def _recipe_grads(ops, rlse, delta_r, kw):
  """reference.mx_backward on the CPU backend (see tests/test_cuda_forward.py::_recipe)."""
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    args = jax.device_put((ops["q_h"], ops["q_t"], ops["k_h"], ops["k_s"], ops["v_h"], ops["do_h"],
                           ops["do_t"], rlse, delta_r), cpu)
    return [np.asarray(g) for g in reference.mx_backward(*args, **kw)[:3]]


def _run_case(case, seed, deterministic=False):
  B, T, S, N, K, H, causal, window, kind, do_kind, lens = case
  q, k, v = make_qkv(kind, B, T, S, N, K, H, seed=seed)
  do = make_do(do_kind, B, T, N, H, seed=seed + 1)
  if lens is None:
    ql, kl = np.full((B,), T, np.int32), np.full((B,), S, np.int32)
  else:
    ql, kl = np.asarray(lens[0], np.int32), np.asarray(lens[1], np.int32)
  qj, kj, vj, doj = (jnp.asarray(x) for x in (q, k, v, do))
  qm, km, vm = mx.quantize(qj, 3), mx.quantize(kj, 3), mx.quantize(vj, 1)
  ops = dict(q_h=qm, q_t=mx.quantize(qj, 1), k_h=km, k_s=mx.quantize(kj, 1), v_h=mx.quantize(vj, 3),
             do_h=mx.quantize(doj, 3), do_t=mx.quantize(doj, 1))
  scale = 1.0 / np.sqrt(H)
  kw = dict(scale=scale, is_causal=causal, window=window)
  ql_j, kl_j = jnp.asarray(ql), jnp.asarray(kl)
  o, lse = _ops().forward_mx(qm, km, vm, ql_j, kl_j, out_dtype=jnp.float32, **kw)
  delta = jnp.sum(o * doj, axis=-1)
  # Poison: free NaN buffers of the outputs' sizes so the kernel's outputs likely reuse them.
  jax.block_until_ready((jnp.full((B, T, N, H), jnp.nan), jnp.full((B, S, K, H), jnp.nan),
                         jnp.full((B, S, K, H), jnp.nan)))
  grads = [np.asarray(g) for g in _ops().backward(ops["q_h"], ops["k_h"], ops["v_h"], ops["do_h"], lse,
                                                   delta, ql_j, kl_j, deterministic=deterministic, **kw)]
  # The recipe with its own forward's O and lse (as in training).
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    ro, rlse = reference.mx_forward(*jax.device_put((qm, km, vm), cpu), q_seqlen=jnp.asarray(ql),
                                    kv_seqlen=jnp.asarray(kl), **kw)
    delta_r = jnp.sum(ro * jax.device_put(doj, cpu), axis=-1)
  rkw = dict(kw, q_seqlen=jnp.asarray(ql), kv_seqlen=jnp.asarray(kl))
  rgrads = _recipe_grads(ops, rlse, delta_r, rkw)
  tkw = dict(kw, q_len=ql, kv_len=kl)
  truth = _truth64_grads(qm.dequantize(), km.dequantize(), vm.dequantize(), do, **tkw)
  bf16 = _truth64_grads(_bf16(q), _bf16(k), _bf16(v), _bf16(do), **tkw)
  return dict(grads=grads, rgrads=rgrads, truth=truth, bf16=bf16, ql=ql, kl=kl)


_RESULTS = {}


def _case_result(case):
  if case not in _RESULTS:
    _RESULTS[case] = _run_case(case, _SEED + CASES.index(case))
  return _RESULTS[case]


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_backward_rows_and_finiteness(case):
  r = _case_result(case)
  dq, dk, dv = r["grads"]
  for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
    assert np.all(np.isfinite(g)), f"non-finite {name}"
  for b in range(case[0]):
    L, Lk = int(r["ql"][b]), int(r["kl"][b])
    assert np.all(dq[b, L:] == 0), f"batch {b}: dq rows >= q_len={L} not zero"
    assert np.all(dk[b, Lk:] == 0) and np.all(dv[b, Lk:] == 0), f"batch {b}: dk/dv rows >= kv_len={Lk} not zero"


@pytest.mark.parametrize("tensor", ["dq", "dk", "dv"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_backward_contract(case, tensor):
  r = _case_result(case)
  i = ("dq", "dk", "dv").index(tensor)
  e, er, eb = assert_contract(tensor, r["grads"][i], r["rgrads"][i], r["bf16"][i], r["truth"][i],
                              seed=_SEED + CASES.index(case))
  print(f"{_ids(case)} {tensor}: kernel {e:.3e} recipe {er:.3e} (x{e / max(er, 1e-30):.2f}) bf16 {eb:.3e}")


def test_deterministic_is_bitwise_reproducible():
  case = (1, 512, 2048, 4, 2, 128, True, None, "normal", "varying", None)
  a = _run_case(case, _SEED, deterministic=True)["grads"]
  b = _run_case(case, _SEED, deterministic=True)["grads"]
  for name, x, y in zip(("dq", "dk", "dv"), a, b):
    np.testing.assert_array_equal(x, y, err_msg=name)
  c = _run_case(case, _SEED, deterministic=False)["grads"]
  for name, x, y in zip(("dq", "dk", "dv"), a, c):
    np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-6 * np.abs(x).max(), err_msg=name)


def test_grad_through_dot_product_attention():
  """jax.grad on the GPU default backend (the CUDA kernels) vs float64 gradients, the xla recipe
  (on the CPU backend) as the yardstick."""
  import jax_fa4
  from jax_fa4 import backends
  B, T, S, N, K, H = 2, 192, 256, 4, 2, 128
  q, k, v = make_qkv("token_outliers", B, T, S, N, K, H, seed=_SEED + 100)
  w = make_do("varying", B, T, N, H, seed=_SEED + 101)
  kw = dict(is_causal=True, key_value_seq_lengths=jnp.array([256, 100], jnp.int32))
  assert backends.resolve(None, q_shape=q.shape, k_shape=k.shape, head_dim=H, num_heads=N, num_kv_heads=K,
                          has_bias=False, has_mask=False, window=None, is_causal=True,
                          out_dtype="float32") == "cuda"

  def loss(impl):
    return lambda q, k, v: jnp.sum(jax_fa4.dot_product_attention(q, k, v, implementation=impl, **kw) * w)

  got = [np.asarray(g) for g in jax.jit(jax.grad(loss(None), (0, 1, 2)))(*map(jnp.asarray, (q, k, v)))]
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    rec = [np.asarray(g) for g in jax.grad(loss("xla"), (0, 1, 2))(*jax.device_put((q, k, v), cpu))]
  qm, km, vm = mx.quantize(jnp.asarray(q), 3), mx.quantize(jnp.asarray(k), 3), mx.quantize(jnp.asarray(v), 1)
  tkw = dict(scale=H ** -0.5, is_causal=True, window=None, q_len=np.full((B,), T, np.int32),
             kv_len=np.array([256, 100], np.int32))
  truth = _truth64_grads(qm.dequantize(), km.dequantize(), vm.dequantize(), w, **tkw)
  bf16 = _truth64_grads(_bf16(q), _bf16(k), _bf16(v), _bf16(w), **tkw)
  for name, g, r, b, t in zip(("dq", "dk", "dv"), got, rec, bf16, truth):
    assert_contract(name, g, r, b, t)


def test_backward_jit_and_vmap():
  B, T, S, N, K, H = 1, 96, 160, 2, 1, 64
  q, k, v = make_qkv("normal", 2 * B, T, S, N, K, H, seed=_SEED + 7)
  do = make_do("normal", 2 * B, T, N, H, seed=_SEED + 8)
  q, k, v, do = (jnp.asarray(x).reshape((2, B) + x.shape[1:]) for x in (q, k, v, do))
  ql, kl = jnp.full((2, B), T, jnp.int32), jnp.array([[S], [77]], jnp.int32)

  # The kernel's inputs are made once per example and stacked, so the comparison is of the backward
  # alone: XLA may sum delta = rowsum(O dO) in another order inside a vmapped jit, and dS's
  # cancellation makes that visible (seen on the H200), which is not what this test is about.
  def prep(q, k, v, do, ql, kl):
    qm, km, vm = mx.quantize(q, 3), mx.quantize(k, 3), mx.quantize(v, 1)
    o, lse = _ops().forward_mx(qm, km, vm, ql, kl, scale=0.125, out_dtype=jnp.float32)
    return qm, km, mx.quantize(v, 3), mx.quantize(do, 3), lse, jnp.sum(o * do, -1), ql, kl

  per = [prep(q[i], k[i], v[i], do[i], ql[i], kl[i]) for i in range(2)]
  stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *per)
  bwd = lambda *a: _ops().backward(*a, scale=0.125, deterministic=True)
  batched = jax.jit(jax.vmap(bwd))(*stacked)
  for i in range(2):
    each = jax.jit(bwd)(*per[i])
    for x, y in zip(batched, each):
      np.testing.assert_array_equal(np.asarray(x[i]), np.asarray(y))


def _deterministic_case(H):
  """The backward's operands of a 5 x 5-tile GQA case (causal, a window, ragged lengths)."""
  B, T, S, N, K = 2, 300, 520, 4, 2  # 5 query tiles x 5 key tiles, GQA
  q, k, v = make_qkv("normal", B, T, S, N, K, H, seed=_SEED + 11)
  do = make_do("varying", B, T, N, H, seed=_SEED + 12)
  q, k, v, do = (jnp.asarray(x) for x in (q, k, v, do))
  ql, kl = jnp.array([300, 257], jnp.int32), jnp.array([520, 390], jnp.int32)
  qm, km, vm = mx.quantize(q, 3), mx.quantize(k, 3), mx.quantize(v, 1)
  kw = dict(scale=H ** -0.5, is_causal=True, window=(200, None))
  o, lse = _ops().forward_mx(qm, km, vm, ql, kl, out_dtype=jnp.float32, **kw)
  return (qm, km, mx.quantize(v, 3), mx.quantize(do, 3), lse, jnp.sum(o * do, -1), ql, kl), kw


@pytest.mark.parametrize("H", [64, 128, 256])
def test_deterministic_all_head_dims_and_dkv_dtypes(H):
  """deterministic=True is bitwise reproducible at every head dim (H = 256 runs two column-chunk
  CTAs per key tile, each chunk with its own order counters), and dK / dV requested in bf16 / fp16
  are the fp32 results rounded once (they are summed in registers, in a fixed order)."""
  args, kw = _deterministic_case(H)
  a = [np.asarray(x) for x in _ops().backward(*args, deterministic=True, **kw)]
  b = [np.asarray(x) for x in _ops().backward(*args, deterministic=True, **kw)]
  for name, x, y in zip(("dq", "dk", "dv"), a, b):
    np.testing.assert_array_equal(x, y, err_msg=name)
  c = [np.asarray(x) for x in _ops().backward(*args, deterministic=False, **kw)]
  for name, x, y in zip(("dq", "dk", "dv"), a, c):
    np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-6 * np.abs(x).max(), err_msg=name)
  for dt in (jnp.bfloat16, jnp.float16):
    g = _ops().backward(*args, deterministic=True, dkv_dtype=dt, **kw)
    assert g[0].dtype == jnp.float32 and g[1].dtype == dt and g[2].dtype == dt
    np.testing.assert_array_equal(np.asarray(g[0]), a[0], err_msg="dq")
    for name, x, y in (("dk", g[1], a[1]), ("dv", g[2], a[2])):
      np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)),
                                    np.asarray(jnp.asarray(y).astype(dt).astype(jnp.float32)), err_msg=name)


@pytest.mark.parametrize("H", [64, 128, 256])
def test_raw_bf16_cotangent_is_bitwise_the_mx_path(H):
  """dO given as the bf16 cotangent (what jax.grad through dot_product_attention passes; its
  bf16 copy for the kernel is made from the floats in one pass, _exact_rows_float) gives the
  gradients of dO given as mx.quantize(do, 3), bit for bit, and so does a float32 cotangent. Awkward T (a partial last query tile), GQA, ragged lengths, and blocks that
  stress the scale: zeros, tiny (1e-30) and huge (1e20) values, one nonzero element, a NaN."""
  B, T, S, N, K = 2, 113, 200, 4, 2
  q, k, v = make_qkv("normal", B, T, S, N, K, H, seed=_SEED + 21)
  do = make_do("varying", B, T, N, H, seed=_SEED + 22)
  do[0, 3, 1, :32] = 0.0
  do[0, 4, 2, 32:64] *= 1e-30
  do[1, 5, 0, :32] *= 1e20
  do[1, 6, 3, :32] = 0.0
  do[1, 6, 3, 17] = -3.0
  do[1, 50, 1, H - 32:] = np.nan  # a row inside batch 1's q_len
  q, k, v = (jnp.asarray(x) for x in (q, k, v))
  dob = jnp.asarray(do, jnp.bfloat16)
  ql, kl = jnp.array([113, 90], jnp.int32), jnp.array([200, 131], jnp.int32)
  qm, km, vm = mx.quantize(q, 3), mx.quantize(k, 3), mx.quantize(v, 1)
  kw = dict(scale=H ** -0.5, is_causal=True, window=None, deterministic=True)
  o, lse = _ops().forward_mx(qm, km, vm, ql, kl, out_dtype=jnp.float32, scale=kw["scale"], is_causal=True)
  delta = jnp.sum(o * dob.astype(jnp.float32), -1)
  common = (lse, delta, ql, kl)
  want = [np.asarray(x) for x in _ops().backward(qm, km, mx.quantize(v, 3), mx.quantize(dob, 3), *common, **kw)]
  assert np.isfinite(want[0][0]).all() and np.isnan(want[0][1]).any()  # the NaN block reaches batch 1 only
  for do_in in (dob, dob.astype(jnp.float32)):
    jax.block_until_ready((jnp.full((B, T, N, H), jnp.nan), jnp.full((B, S, K, H), jnp.nan)))  # poison
    got = [np.asarray(x) for x in _ops().backward(qm, km, mx.quantize(v, 3), do_in, *common, **kw)]
    for name, x, y in zip(("dq", "dk", "dv"), got, want):
      np.testing.assert_array_equal(x, y, err_msg=f"{name} (do {do_in.dtype})")


@pytest.mark.parametrize("H", [64, 128, 256])
def test_dq_chunks_are_the_fp32_dq_rounded_once(H):
  """A bf16 / fp16 dQ, accumulated one chunk of (batches, kv heads) at a time and written over the
  kernel's bf16 copy of q, is the float32 dQ rounded once, bit for bit, for every chunking: one
  batch x one kv head, partial last chunks in both axes, the whole problem, the automatic choice.
  Deterministic mode, so both sides add in the same order; GQA, ragged lengths, causal with a
  window, a partial last query tile. dQ aliases q's copy, so a chunk the kernel skipped would show
  q's values, not zeros."""
  B, T, S, N, K = 3, 113, 200, 6, 3
  q, k, v = make_qkv("normal", B, T, S, N, K, H, seed=_SEED + 31)
  do = make_do("varying", B, T, N, H, seed=_SEED + 32)
  q, k, v, do = (jnp.asarray(x) for x in (q, k, v, do))
  ql, kl = jnp.array([113, 60, 1], jnp.int32), jnp.array([200, 131, 31], jnp.int32)
  qm, km, vm = mx.quantize(q, 3), mx.quantize(k, 3), mx.quantize(v, 1)
  kw = dict(scale=H ** -0.5, is_causal=True, window=(90, None))
  o, lse = _ops().forward_mx(qm, km, vm, ql, kl, out_dtype=jnp.float32, **kw)
  args = (qm, km, mx.quantize(v, 3), do, lse, jnp.sum(o * do, -1), ql, kl)
  want = [np.asarray(x) for x in _ops().backward(*args, deterministic=True, **kw)]
  assert want[0].dtype == np.float32 and np.abs(want[0]).max() > 0
  for dt in (jnp.bfloat16, jnp.float16):
    want_dq = np.asarray(jnp.asarray(want[0]).astype(dt).astype(jnp.float32))
    for chunk in ((1, 1), (2, 2), (2, 1), (1, 3), (3, 3), None):
      jax.block_until_ready(jnp.full((B, T, N, H), jnp.nan))  # poison
      got = _ops().backward(*args, deterministic=True, dq_dtype=dt, _dq_chunk=chunk, **kw)
      assert got[0].dtype == dt
      np.testing.assert_array_equal(np.asarray(got[0].astype(jnp.float32)), want_dq,
                                    err_msg=f"dq {jnp.dtype(dt).name} chunk {chunk}")
      for name, x, y in (("dk", got[1], want[1]), ("dv", got[2], want[2])):
        np.testing.assert_array_equal(np.asarray(x), y, err_msg=f"{name} chunk {chunk}")
  # Under jit and vmap (the accumulator gains the vmapped axis: the kernel then takes more batches
  # per chunk), still the fp32 dQ rounded once.
  bwd = lambda *a: _ops().backward(*a, deterministic=True, dq_dtype=jnp.bfloat16, _dq_chunk=(1, 1), **kw)
  stacked = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), args)
  batched = jax.jit(jax.vmap(bwd))(*stacked)
  want_dq = np.asarray(jnp.asarray(want[0]).astype(jnp.bfloat16).astype(jnp.float32))
  for i in range(2):
    np.testing.assert_array_equal(np.asarray(batched[0][i].astype(jnp.float32)), want_dq, err_msg="vmapped dq")


# ---------------------------------------------------------------------------------------------
# The dQ-warpgroup kernel (JAX_FA4_SM90_BWD_DQWG=1, read per launch; H <= 128, opt-in:
# csrc/cuda/tile_config.cuh): warpgroup 0 computes dQ, the consumers no longer meet at a barrier per
# query tile. Its consumers run the default kernel's arithmetic for dK and dV, so those must be the
# default kernel's bits; its dQ is the same products in 32- or 64-column passes (at H = 64 one
# 128-key product per query tile where the default kernel adds two 64-key partials), so dQ may
# differ in summation order only, and meets the contract on its own.

_DQWG_CASES = [c for c in CASES if c[5] in (64, 128)]


@pytest.fixture
def dqwg_on():
  """The switch on for the test (kernel_switches clears jax's caches around it)."""
  with kernel_switches(JAX_FA4_SM90_BWD_DQWG="1"):
    yield


@pytest.mark.parametrize("case", _DQWG_CASES, ids=_ids)
def test_dq_warpgroup_kernel_contract_and_dk_dv_bits(case, request):
  want = _case_result(case)["grads"]  # the default kernel (cached before the switch is set)
  request.getfixturevalue("dqwg_on")
  r = _run_case(case, _SEED + CASES.index(case))  # the same inputs, poisoned outputs
  dq, dk, dv = r["grads"]
  np.testing.assert_array_equal(dk, want[1], err_msg="dk")
  np.testing.assert_array_equal(dv, want[2], err_msg="dv")
  assert np.all(np.isfinite(dq)), "non-finite dq"
  for b in range(case[0]):
    assert np.all(dq[b, int(r["ql"][b]):] == 0), f"batch {b}: dq rows >= q_len not zero"
  e, er, eb = assert_contract("dq", dq, r["rgrads"][0], r["bf16"][0], r["truth"][0], seed=_SEED + CASES.index(case))
  print(f"{_ids(case)} dq (dQ warpgroup): kernel {e:.3e} recipe {er:.3e} (x{e / max(er, 1e-30):.2f})")
  np.testing.assert_allclose(dq, want[0], rtol=1e-4, atol=1e-6 * np.abs(want[0]).max(), err_msg="dq vs default")


@pytest.mark.parametrize("H", [64, 128])
def test_dq_warpgroup_kernel_deterministic(H, request):
  """deterministic=True stays bitwise reproducible with the dQ warpgroup (its writer takes the
  default kernel's per-tile order counters), under jit and vmap too; dK / dV are the default's bits."""
  args, kw = _deterministic_case(H)
  want = [np.asarray(x) for x in _ops().backward(*args, deterministic=True, **kw)]
  request.getfixturevalue("dqwg_on")
  a = [np.asarray(x) for x in _ops().backward(*args, deterministic=True, **kw)]
  jax.block_until_ready(jnp.full(a[0].shape, jnp.nan))  # poison
  b = [np.asarray(x) for x in _ops().backward(*args, deterministic=True, **kw)]
  for name, x, y in zip(("dq", "dk", "dv"), a, b):
    np.testing.assert_array_equal(x, y, err_msg=name)
  for name, x, y in zip(("dk", "dv"), a[1:], want[1:]):
    np.testing.assert_array_equal(x, y, err_msg=f"{name} vs default")
  print(f"H={H}: deterministic dQ bitwise the default kernel's: {np.array_equal(a[0], want[0])}")
  np.testing.assert_allclose(a[0], want[0], rtol=1e-4, atol=1e-6 * np.abs(want[0]).max(), err_msg="dq vs default")
  bwd = lambda *xs: _ops().backward(*xs, deterministic=True, **kw)
  batched = jax.jit(jax.vmap(bwd))(*jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), args))
  for name, x, y in zip(("dq", "dk", "dv"), batched, a):
    for i in range(2):
      np.testing.assert_array_equal(np.asarray(x[i]), y, err_msg=f"vmapped {name}")


def test_backward_bad_input_raises():
  q = mx.quantize(jnp.ones((1, 8, 2, 64)), 3)
  k = mx.quantize(jnp.ones((1, 8, 1, 64)), 3)
  lse = jnp.zeros((1, 8, 2))
  L = jnp.array([8], jnp.int32)
  with pytest.raises(ValueError, match="axis"):
    _ops().backward(mx.quantize(jnp.ones((1, 8, 2, 64)), 1), k, k, q, lse, lse, L, L, scale=0.1)
  with pytest.raises(ValueError, match="lse"):
    _ops().backward(q, k, k, q, lse[..., :1], lse, L, L, scale=0.1)
  with pytest.raises(ValueError, match="window"):
    _ops().backward(q, k, k, q, lse, lse, L, L, scale=0.1, window=(-2, None))
  with pytest.raises(ValueError, match="deterministic"):
    _ops().backward(q, k, k, q, lse, lse, L, L, scale=0.1, deterministic="yes")
  with pytest.raises(ValueError, match="dkv_dtype"):
    _ops().backward(q, k, k, q, lse, lse, L, L, scale=0.1, dkv_dtype=jnp.int8)
  with pytest.raises(ValueError, match="dq_dtype"):
    _ops().backward(q, k, k, q, lse, lse, L, L, scale=0.1, dq_dtype=jnp.int8)
  with pytest.raises(ValueError, match="_dq_chunk"):
    _ops().backward(q, k, k, q, lse, lse, L, L, scale=0.1, dq_dtype=jnp.bfloat16, _dq_chunk=(1, 2))
  with pytest.raises(ValueError, match="do.dtype"):
    _ops().backward(q, k, k, jnp.ones((1, 8, 2, 64), jnp.int32), lse, lse, L, L, scale=0.1)
  with pytest.raises(ValueError, match="do.shape"):
    _ops().backward(q, k, k, jnp.ones((1, 8, 2, 32)), lse, lse, L, L, scale=0.1)
