"""The CPU FFI kernels (csrc/cpu) against the jnp recipe and float64 truth (NUMERICS.md 4).

Order: MX helpers bit-exact with jnp/ml_dtypes; structured attention with a known answer; the
accuracy contract for O, lse, dQ, dK, dV over distributions, masks, GQA, head dims and lengths;
ragged/empty lengths (outputs written everywhere, exact zeros, no NaN); jit, vmap and
multi-dim batches; bad input returning an error instead of aborting.
"""
import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from contract import assert_contract, make_do, make_qkv, mx_inputs, truth_and_bf16
from jax_fa4 import mx, reference as R

_cpu_ops = pytest.importorskip("jax_fa4._cpu_ops")
pytestmark = pytest.mark.skipif(not _cpu_ops.available(),
                                reason=f"CPU extension not built: {_cpu_ops.import_error()}")


def _ext():
  return _cpu_ops._ext


def _window(wl, wr):
  if wl < 0 and wr < 0:
    return None
  return (None if wl < 0 else wl, None if wr < 0 else wr)


def _mx_bwd_inputs(q, k, v, do):
  q, k, v, do = (jnp.asarray(x) for x in (q, k, v, do))
  return dict(q_h=mx.quantize(q, 3), q_t=mx.quantize(q, 1), k_h=mx.quantize(k, 3),
              k_s=mx.quantize(k, 1), v_h=mx.quantize(v, 3), do_h=mx.quantize(do, 3),
              do_t=mx.quantize(do, 1))


def _bwd_args(ops, lse, delta):
  return (ops["q_h"], ops["q_t"], ops["k_h"], ops["k_s"], ops["v_h"], ops["do_h"], ops["do_t"],
          lse, delta)


# ---------------------------------------------------------------------------------------------
# MX helpers: bit-exact with ml_dtypes / jax_fa4.mx.

def _e4m3_probe_values():
  rng = np.random.default_rng(0)
  vals = ml_dtypes.finfo(ml_dtypes.float8_e4m3fn)
  grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  grid = grid[np.isfinite(grid)]
  mids = (grid[:, None] + grid[None, :]).ravel() / 2  # every midpoint (ties) and more
  near = np.concatenate([np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))])
  rand = (rng.standard_normal(200_000) * 2.0 ** rng.integers(-14, 10, 200_000)).astype(np.float32)
  edge = np.array([0.0, -0.0, 448.0, -448.0, 449.0, 464.0, 479.0, 1e30, 2.0**-10, 2.0**-9 * 0.5,
                   2.0**-9 * 1.5, 2.0**-6 * (1 - 2.0**-5), float(vals.tiny)], np.float32)
  return np.concatenate([grid, mids.astype(np.float32), near.astype(np.float32), rand, edge])


def test_f32_to_e4m3_bit_exact():
  x = _e4m3_probe_values()
  got = np.frombuffer(_ext()._f32_to_e4m3(x.tobytes()), np.uint8)
  want = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
  np.testing.assert_array_equal(got, want)
  # saturation of out-of-range values, NaN kept NaN
  got = np.frombuffer(_ext()._f32_to_e4m3(np.array([np.inf, -np.inf, -1e9, np.nan], np.float32).tobytes()), np.uint8)
  assert list(got[:3]) == [0x7E, 0xFE, 0xFE] and (got[3] & 0x7F) == 0x7F


def test_vectorized_e4m3_rounding_bit_exact():
  x = _e4m3_probe_values()
  got = np.frombuffer(_ext()._round_e4m3(x.tobytes()), np.float32)
  want = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_e4m3_to_f32_all_bytes():
  b = np.arange(256, dtype=np.uint8)
  got = np.frombuffer(_ext()._e4m3_to_f32(b.tobytes()), np.float32)
  want = b.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  np.testing.assert_array_equal(got[~np.isnan(got)], want[~np.isnan(want)])


def test_e8m0_scale_rule_matches_mx():
  rng = np.random.default_rng(1)
  # Exclude amax < 448 * 2**-126, where XLA's subnormal flushing changes the rule's result.
  amax = np.abs(rng.standard_normal(100_000) * 2.0 ** rng.integers(-110, 120, 100_000)).astype(np.float32)
  amax = amax[amax >= np.float32(448.0 * 2.0**-126)]
  amax = np.concatenate([amax, np.float32([0.0, 448.0, 448.0 * 2**10, 1.0, np.inf, np.nan,
                                           np.float32(3.4e38)])])
  got = np.frombuffer(_ext()._e8m0_from_amax(amax.tobytes()), np.uint8)
  want = np.asarray(mx.scale_bytes_from_amax(jnp.asarray(amax)))
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("along_rows", [True, False])
def test_dS_quantization_matches_mx(along_rows):
  # The kernels' in-tile MX quantization of dS is bit-exact with jax_fa4.mx.quantize.
  rng = np.random.default_rng(2)
  rows, cols = 64, 96
  x = (rng.standard_normal((rows, cols)) * 10.0 ** rng.uniform(-6, 3, (rows, 1))).astype(np.float32)
  x[:, 40:48] = 0.0
  x[5] *= 1e4
  x[:32, :32] = 0.0  # an all-zero block
  got = np.frombuffer(_ext()._mx_qdq(x.tobytes(), rows, cols, along_rows), np.float32)
  want = np.asarray(mx.quantize(jnp.asarray(x), 1 if along_rows else 0).dequantize())
  np.testing.assert_array_equal(got.reshape(rows, cols), want)


# ---------------------------------------------------------------------------------------------
# Structured attention with a known answer.

def test_one_hot_attention_is_exact():
  # Query i matches key 3i with logit 64; others are 0: P is one-hot, O = the chosen value row.
  T, S, H = 8, 40, 64
  q = np.zeros((1, T, 1, H), np.float32)
  k = np.zeros((1, S, 1, H), np.float32)
  for i in range(T):
    q[0, i, 0, i] = 8.0
    k[0, 3 * i + 1, 0, i] = 8.0
  v = np.random.default_rng(0).standard_normal((1, S, 1, H)).astype(np.float32)
  qm, km, vm = mx_inputs(q, k, v)
  o, lse = _cpu_ops.forward(qm, km, vm, scale=1.0)
  vd = np.asarray(vm.dequantize())
  np.testing.assert_array_equal(np.asarray(o)[0, :, 0], vd[0, 1:3 * T + 1:3, 0])
  np.testing.assert_allclose(np.asarray(lse), 64.0, rtol=1e-7)


@pytest.mark.parametrize("causal", [False, True])
def test_uniform_attention_is_the_mean(causal):
  # q = 0: every logit is 0, P = 1 exactly (also after rounding): O = mean of the allowed rows.
  rng = np.random.default_rng(1)
  T, S = 70, 90
  q = np.zeros((2, T, 2, 64), np.float32)
  k = rng.standard_normal((2, S, 1, 64)).astype(np.float32)
  v = rng.standard_normal((2, S, 1, 64)).astype(np.float32)
  qm, km, vm = mx_inputs(q, k, v)
  o, lse = _cpu_ops.forward(qm, km, vm, scale=0.125, is_causal=causal)
  vd = np.asarray(vm.dequantize(), np.float64)
  n = np.arange(1, T + 1) if causal else np.full(T, S)
  want = np.stack([vd[:, :n[i]].mean(axis=1) for i in range(T)], axis=1)  # [B, T, 1, H]
  np.testing.assert_allclose(np.asarray(o), np.broadcast_to(want, o.shape), rtol=2e-6, atol=1e-7)
  np.testing.assert_allclose(np.asarray(lse), np.broadcast_to(np.log(n)[None, :, None], lse.shape),
                             rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# The accuracy contract, forward and backward, vs the recipe and float64 truth.

def _run_contract(kind="normal", do_kind="normal", B=1, T=113, S=113, N=2, K=1, H=64,
                  causal=False, wl=-1, wr=-1, q_seqlen=None, kv_seqlen=None, seed=0):
  q, k, v = make_qkv(kind, B, T, S, N, K, H, seed=seed)
  do = make_do(do_kind, B, T, N, H, seed=seed + 1)
  scale = 1.0 / np.sqrt(H)
  window = _window(wl, wr)
  ql = None if q_seqlen is None else jnp.asarray(q_seqlen, jnp.int32)
  kl = None if kv_seqlen is None else jnp.asarray(kv_seqlen, jnp.int32)
  mask_kw = dict(scale=scale, is_causal=causal, window=window, q_seqlen=ql, kv_seqlen=kl)
  kern_kw = dict(scale=scale, is_causal=causal, window_left=wl, window_right=wr)

  qm, km, vm = mx_inputs(q, k, v)
  o, lse = _cpu_ops.forward(qm, km, vm, ql, kl, **kern_kw)
  ro, rlse = R.mx_forward(qm, km, vm, **mask_kw)
  ref = truth_and_bf16(q, k, v, do, **mask_kw)
  truth, bf16 = ref["truth"], ref["bf16"]
  assert np.isfinite(np.asarray(o)).all()
  assert not np.isnan(np.asarray(lse)).any()
  assert_contract("o", o, ro, bf16[0], truth[0])
  assert_contract("lse", lse, rlse, bf16[1], truth[1])

  ops = _mx_bwd_inputs(q, k, v, do)
  do32 = jnp.asarray(do)
  # Each pipeline uses its own forward's O (for delta) and lse, as in training.
  delta_k = jnp.sum(o * do32, axis=-1)
  delta_r = jnp.sum(ro * do32, axis=-1)
  grads = _cpu_ops.backward(*_bwd_args(ops, lse, delta_k), ql, kl, **kern_kw)
  rgrads = R.mx_backward(*_bwd_args(ops, rlse, delta_r), **mask_kw)[:3]
  for name, g, rg, bg, tg in zip(("dq", "dk", "dv"), grads, rgrads, bf16[2:], truth[2:]):
    assert np.isfinite(np.asarray(g)).all(), name
    assert_contract(name, g, rg, bg, tg)
  return o, lse, grads


KIND_CASES = [
    dict(kind="normal"),
    dict(kind="channel_outliers"),
    dict(kind="token_outliers"),
    dict(kind="tiny"),
    dict(kind="normal", do_kind="varying"),
    dict(kind="token_outliers", do_kind="varying", causal=True),
]


@pytest.mark.parametrize("case", KIND_CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_contract_distributions(case):
  _run_contract(**case)


@pytest.mark.parametrize("H", [64, 128, 256])
def test_contract_head_dims(H):
  _run_contract(H=H, causal=(H == 128), kind="channel_outliers")


@pytest.mark.parametrize("N,K", [(2, 2), (4, 2), (8, 1)])
def test_contract_gqa(N, K):
  _run_contract(N=N, K=K, kind="token_outliers", do_kind="varying")


@pytest.mark.parametrize("T,S", [(1, 1), (1, 31), (31, 1), (1, 1023), (1023, 1), (31, 113),
                                 (113, 31), (1023, 1023)])
def test_contract_lengths(T, S):
  N = 1 if T * S > 100_000 else 2
  _run_contract(T=T, S=S, N=N, K=1, H=64, causal=(T == 1023 and S == 1023))


@pytest.mark.parametrize("T,S", [(113, 113), (31, 113), (113, 31)])
def test_contract_causal_t_ne_s(T, S):
  _run_contract(T=T, S=S, causal=True, kind="normal", do_kind="varying")


@pytest.mark.parametrize("wl,wr,causal", [(16, -1, True), (8, 8, False), (0, 0, False),
                                          (-1, 3, False), (40, 0, True)])
def test_contract_windows(wl, wr, causal):
  _run_contract(wl=wl, wr=wr, causal=causal, kind="token_outliers")


# ---------------------------------------------------------------------------------------------
# Ragged and empty lengths: outputs written everywhere, masked entries exactly zero, no NaN.

@pytest.mark.parametrize("causal", [False, True])
def test_ragged_lengths_including_zero(causal):
  ql = [70, 0, 45, 100]
  kl = [100, 30, 0, 1]
  o, lse, (dq, dk, dv) = _run_contract(B=4, T=100, S=100, N=2, K=1, H=64, causal=causal,
                                       q_seqlen=ql, kv_seqlen=kl, kind="token_outliers")
  o, lse, dq, dk, dv = (np.asarray(x) for x in (o, lse, dq, dk, dv))
  for b in range(4):
    dead_rows = (np.arange(100) >= ql[b]) | (kl[b] == 0)
    assert (o[b][dead_rows] == 0).all() and np.isneginf(lse[b][dead_rows]).all()
    assert np.isfinite(lse[b][~dead_rows]).all()
    assert (dq[b][np.arange(100) >= ql[b]] == 0).all()
    dead_keys = (np.arange(100) >= kl[b]) | (ql[b] == 0)
    assert (dk[b][dead_keys] == 0).all() and (dv[b][dead_keys] == 0).all()


def test_lengths_are_clamped():
  q, k, v = make_qkv("normal", 2, 40, 50, 2, 1, 64)
  qm, km, vm = mx_inputs(q, k, v)
  o1, l1 = _cpu_ops.forward(qm, km, vm, jnp.array([1000, -5], jnp.int32),
                            jnp.array([77, 50], jnp.int32), scale=0.1)
  o2, l2 = _cpu_ops.forward(qm, km, vm, jnp.array([40, 0], jnp.int32),
                            jnp.array([50, 50], jnp.int32), scale=0.1)
  np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
  np.testing.assert_array_equal(np.asarray(l1), np.asarray(l2))


def test_window_excluding_every_key():
  # A window that excludes every key of some rows (right=-1-window far to the left via T > S):
  # those rows are fully masked.
  q, k, v = make_qkv("normal", 1, 64, 16, 1, 1, 64)
  qm, km, vm = mx_inputs(q, k, v)
  o, lse = _cpu_ops.forward(qm, km, vm, scale=0.1, window_left=4, window_right=0)
  o, lse = np.asarray(o), np.asarray(lse)
  assert (o[0, 20:] == 0).all() and np.isneginf(lse[0, 20:]).all()
  assert np.isfinite(lse[0, :20]).all()


def test_empty_sequences():
  for T, S in ((0, 10), (10, 0)):
    q, k, v = make_qkv("normal", 1, max(T, 1), max(S, 1), 1, 1, 64)
    q, k, v = q[:, :T], k[:, :S], v[:, :S]
    qm, km, vm = mx_inputs(q, k, v)
    o, lse = _cpu_ops.forward(qm, km, vm, scale=0.1)
    assert o.shape == (1, T, 1, 64) and (np.asarray(o) == 0).all()
    assert np.isneginf(np.asarray(lse)).all()
    ops = _mx_bwd_inputs(q, k, v, q)
    dq, dk, dv = _cpu_ops.backward(*_bwd_args(ops, lse, jnp.zeros_like(lse)), scale=0.1)
    assert dq.shape == q.shape and dk.shape == k.shape
    assert all((np.asarray(x) == 0).all() for x in (dq, dk, dv))


# ---------------------------------------------------------------------------------------------
# Transformations: jit, vmap (batched and broadcast operands), several batch dims.

def test_jit_matches_eager():
  q, k, v = make_qkv("normal", 2, 50, 60, 2, 1, 64)
  qm, km, vm = mx_inputs(q, k, v)
  f = jax.jit(lambda a, b, c, ql: _cpu_ops.forward(a, b, c, ql, scale=0.125, is_causal=True))
  ql = jnp.array([50, 20], jnp.int32)
  o1, l1 = f(qm, km, vm, ql)
  o2, l2 = _cpu_ops.forward(qm, km, vm, ql, scale=0.125, is_causal=True)
  np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
  np.testing.assert_array_equal(np.asarray(l1), np.asarray(l2))


def test_vmap_forward_and_backward():
  V, B, T, S, N, K, H = 3, 2, 40, 50, 2, 1, 64
  q, k, v = make_qkv("normal", V * B, T, S, N, K, H)
  do = make_do("normal", V * B, T, N, H)
  rs = lambda x: jnp.asarray(x).reshape((V, B) + x.shape[1:])
  q, k, v, do = rs(q), rs(k), rs(v), rs(do)
  ql = jnp.array([[40, 10], [0, 40], [33, 7]], jnp.int32)
  kl = jnp.array([[50, 50], [25, 1], [0, 49]], jnp.int32)

  def fwd(q_, k_, v_, ql_, kl_):
    return _cpu_ops.forward(mx.quantize(q_, 3), mx.quantize(k_, 3), mx.quantize(v_, 1), ql_, kl_,
                            scale=0.125, is_causal=True)

  def bwd(q_, k_, v_, do_, ql_, kl_):
    o_, lse_ = fwd(q_, k_, v_, ql_, kl_)
    ops = _mx_bwd_inputs(q_, k_, v_, do_)
    return _cpu_ops.backward(*_bwd_args(ops, lse_, jnp.sum(o_ * do_, -1)), ql_, kl_, scale=0.125,
                             is_causal=True)

  got_f = jax.vmap(fwd)(q, k, v, ql, kl)
  got_b = jax.jit(jax.vmap(bwd))(q, k, v, do, ql, kl)
  for i in range(V):
    want_f = fwd(q[i], k[i], v[i], ql[i], kl[i])
    want_b = bwd(q[i], k[i], v[i], do[i], ql[i], kl[i])
    for g, w in zip(got_f + got_b, want_f + want_b):
      np.testing.assert_array_equal(np.asarray(g[i]), np.asarray(w))
  # Only q batched: k, v and the lengths are broadcast (vmap_method="broadcast_all").
  got = jax.vmap(lambda q_: fwd(q_, k[0], v[0], ql[0], kl[0]))(q)
  for i in range(V):
    want = fwd(q[i], k[0], v[0], ql[0], kl[0])
    np.testing.assert_array_equal(np.asarray(got[0][i]), np.asarray(want[0]))


def test_several_batch_dims_flatten():
  q, k, v = make_qkv("normal", 6, 20, 30, 2, 2, 64)
  qm, km, vm = mx_inputs(q, k, v)
  o, lse = _cpu_ops.forward(qm, km, vm, scale=0.1)
  r = lambda x: x.reshape((2, 3) + x.shape[1:])
  q2, k2, v2 = mx_inputs(r(q), r(k), r(v))
  o2, lse2 = _cpu_ops.forward(q2, k2, v2, scale=0.1)
  np.testing.assert_array_equal(np.asarray(o2).reshape(o.shape), np.asarray(o))
  np.testing.assert_array_equal(np.asarray(lse2).reshape(lse.shape), np.asarray(lse))


def _in_threads(run, n=4):
  """run() called from n threads at once; their results."""
  out = [None] * n

  def work(i):
    out[i] = run()

  ts = [threading.Thread(target=work, args=(i,)) for i in range(n)]
  for t in ts:
    t.start()
  for t in ts:
    t.join()
  return out


def test_concurrent_calls_from_threads():
  q, k, v = make_qkv("normal", 2, 130, 130, 2, 1, 64)
  qm, km, vm = mx_inputs(q, k, v)
  run = lambda: np.asarray(_cpu_ops.forward(qm, km, vm, scale=0.1)[0])
  want = run()
  for x in _in_threads(run):
    np.testing.assert_array_equal(x, want)


_DETERMINISM_CHILD = """
import sys, zlib
import jax.numpy as jnp, numpy as np
sys.path.insert(0, {tests!r})
from contract import make_do, make_qkv
from jax_fa4 import _cpu_ops, mx
from test_cpu_kernels import _bwd_args, _mx_bwd_inputs
q, k, v = make_qkv("normal", 2, 300, 520, 4, 2, 64, seed=7)
do = jnp.asarray(make_do("normal", 2, 300, 4, 64, seed=8))
ops = _mx_bwd_inputs(q, k, v, do)
for causal in (False, True):
  o, lse = _cpu_ops.forward(ops["q_h"], ops["k_h"], mx.quantize(jnp.asarray(v), 1), scale=0.1,
                            is_causal=causal)
  g = _cpu_ops.backward(*_bwd_args(ops, lse, jnp.sum(o * do, -1)), scale=0.1, is_causal=causal)
  print(_cpu_ops._ext.num_threads(), causal, *(zlib.crc32(np.asarray(x).tobytes()) for x in g))
"""


def test_backward_is_bitwise_the_same_on_any_thread_count():
  # Several key tiles add to each block of dQ: the kernel adds them in key-tile order (a turn per
  # block), so dQ, dK and dV are bitwise the same whichever threads ran which tiles, as
  # dot_product_attention(deterministic=...) promises for this backend. With lock-ordered adds
  # dQ differed from run to run.
  import jax_fa4
  tests = os.path.dirname(os.path.abspath(__file__))
  # The child imports the jax_fa4 this process imported (an installed wheel or a source tree with
  # its built extension), not whatever the working directory holds.
  pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(jax_fa4.__file__)))
  path = os.pathsep.join(filter(None, [pkg_root, os.environ.get("PYTHONPATH")]))
  runs = {}
  for threads in (1, 3, 7):
    env = dict(os.environ, JAX_FA4_CPU_THREADS=str(threads), JAX_PLATFORMS="cpu", PYTHONPATH=path)
    r = subprocess.run([sys.executable, "-c", _DETERMINISM_CHILD.format(tests=tests)], env=env,
                       capture_output=True, text=True, timeout=300, cwd=tests)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [l.split() for l in r.stdout.splitlines() if l.strip()]
    assert [l[0] for l in lines] == [str(threads)] * 2, lines  # the pool ran that many threads
    runs[threads] = [l[1:] for l in lines]
  assert runs[1] == runs[3] == runs[7], runs


def test_concurrent_backward_calls_from_threads():
  # Backward items wait for their dQ turns; calls from several threads share the pool, and each
  # must finish with its own ordered result.
  q, k, v = make_qkv("normal", 2, 200, 330, 2, 1, 64)
  do = make_do("normal", 2, 200, 2, 64)
  ops = _mx_bwd_inputs(q, k, v, do)
  o, lse = _cpu_ops.forward(ops["q_h"], ops["k_h"], mx.quantize(jnp.asarray(v), 1), scale=0.1,
                            is_causal=True)
  args = _bwd_args(ops, lse, jnp.sum(o * jnp.asarray(do), -1))
  run = lambda: [np.asarray(x) for x in _cpu_ops.backward(*args, scale=0.1, is_causal=True)]
  want = run()
  for got in _in_threads(run):
    for g, w in zip(got, want):
      np.testing.assert_array_equal(g, w)


# ---------------------------------------------------------------------------------------------
# Special values and bad input.

def test_nan_block_propagates_only_where_used():
  q, k, v = make_qkv("normal", 1, 64, 64, 1, 1, 64)
  k[0, 10, 0, 5] = np.nan  # key 10 is NaN: rows that attend to it must be NaN
  qm, km, vm = mx_inputs(q, k, v)
  o, lse = _cpu_ops.forward(qm, km, vm, scale=0.1, is_causal=True)
  o, lse = np.asarray(o), np.asarray(lse)
  assert np.isfinite(o[0, :10]).all() and np.isfinite(lse[0, :10]).all()
  assert np.isnan(o[0, 10:]).all() and np.isnan(lse[0, 10:]).all()


def _raw_fwd(q, qs, k, ks, v, vs, ql, kl, o_shape, lse_shape):
  call = jax.ffi.ffi_call(_cpu_ops.FWD_TARGET,
                          (jax.ShapeDtypeStruct(o_shape, jnp.float32),
                           jax.ShapeDtypeStruct(lse_shape, jnp.float32)),
                          vmap_method="broadcast_all")
  return call(q, qs, k, ks, v, vs, ql, kl, scale=np.float32(0.1), is_causal=False,
              window_left=np.int64(-1), window_right=np.int64(-1))


def _good_raw(T=8, S=8, N=2, K=1, H=64):
  f8 = lambda *s: jnp.zeros(s, jnp.float8_e4m3fn)
  u8 = lambda *s: jnp.zeros(s, jnp.uint8)
  return dict(q=f8(1, T, N, H), qs=u8(1, T, N, H // 32), k=f8(1, S, K, H), ks=u8(1, S, K, H // 32),
              v=f8(1, S, K, H), vs=u8(1, (S + 31) // 32, K, H), ql=jnp.full((1,), T, jnp.int32),
              kl=jnp.full((1,), S, jnp.int32), o_shape=(1, T, N, H), lse_shape=(1, T, N))


@pytest.mark.parametrize("bad", [
    dict(q=jnp.zeros((1, 8, 2, 64), jnp.float32)),              # q not e4m3
    dict(qs=jnp.zeros((1, 8, 2, 3), jnp.uint8)),                # wrong scale shape
    dict(vs=jnp.zeros((1, 8, 1, 64), jnp.uint8)),               # v scale blocked along H
    dict(k=jnp.zeros((1, 8, 3, 64), jnp.float8_e4m3fn),         # N % K != 0
         ks=jnp.zeros((1, 8, 3, 2), jnp.uint8), v=jnp.zeros((1, 8, 3, 64), jnp.float8_e4m3fn),
         vs=jnp.zeros((1, 1, 3, 64), jnp.uint8)),
    dict(ql=jnp.zeros((2,), jnp.int32)),                        # seqlen shape
    dict(lse_shape=(1, 8, 3)),                                  # result shape
])
def test_bad_input_is_an_error_not_an_abort(bad):
  args = _good_raw()
  _raw_fwd(**args)  # the good call works
  args.update(bad)
  with pytest.raises(Exception, match="jax_fa4 cpu kernel"):
    jax.block_until_ready(_raw_fwd(**args))


def test_python_validation_names_the_argument():
  q, k, v = make_qkv("normal", 1, 8, 8, 2, 1, 64)
  qm, km, vm = mx_inputs(q, k, v)
  with pytest.raises(ValueError, match="v.axis"):
    _cpu_ops.forward(qm, km, mx.quantize(jnp.asarray(v), 3), scale=0.1)
  with pytest.raises(ValueError, match="q_seqlen.shape"):
    _cpu_ops.forward(qm, km, vm, jnp.zeros((3,), jnp.int32), scale=0.1)
  with pytest.raises(ValueError, match="window_left"):
    _cpu_ops.forward(qm, km, vm, scale=0.1, window_left=-2)
