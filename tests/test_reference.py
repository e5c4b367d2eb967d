"""The jnp recipe against float64 truth: structured cases first, then the distributions."""
import jax.numpy as jnp
import numpy as np
import pytest

from contract import KINDS, make_do, make_qkv, mx_inputs, rel_err, truth_and_bf16
from jax_fa4 import mx, reference as R


def test_one_hot_attention_is_exact():
  # Query i matches key 3i exactly with logit 64; every other logit is 0, so P is one-hot
  # (exp(-64) * 256 rounds to 0 in e4m3) and O must equal the selected value row.
  T, S, H = 8, 32, 32
  q = np.zeros((1, T, 1, H), np.float32)
  k = np.zeros((1, S, 1, H), np.float32)
  for i in range(T):
    q[0, i, 0, i] = 8.0
    k[0, 3 * i, 0, i] = 8.0
  v = np.random.default_rng(0).standard_normal((1, S, 1, H)).astype(np.float32)
  qm, km, vm = mx_inputs(q, k, v)
  o, lse = R.mx_forward(qm, km, vm, scale=1.0)
  vd = np.asarray(vm.dequantize())
  np.testing.assert_allclose(np.asarray(o)[0, :, 0], vd[0, 0:3 * T:3, 0], rtol=1e-6, atol=0)
  np.testing.assert_allclose(np.asarray(lse), 64.0, rtol=1e-6)


def test_uniform_attention_is_the_mean():
  # q = 0: every logit is 0, P = 1 exactly (also after rounding), O = mean of the value rows.
  rng = np.random.default_rng(1)
  q = np.zeros((2, 5, 2, 64), np.float32)
  k = rng.standard_normal((2, 40, 2, 64)).astype(np.float32)
  v = rng.standard_normal((2, 40, 2, 64)).astype(np.float32)
  qm, km, vm = mx_inputs(q, k, v)
  o, lse = R.mx_forward(qm, km, vm, scale=0.125)
  want = np.asarray(vm.dequantize()).mean(axis=1, keepdims=True)
  np.testing.assert_allclose(np.asarray(o), np.broadcast_to(want, o.shape), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(lse), np.log(40.0), rtol=1e-6)


def _exact_inputs(B, T, S, N, K, H, seed):
  """Small integers: exact in e4m3 under ANY power-of-two block scale, in every orientation."""
  rng = np.random.default_rng(seed)
  f = lambda *s: rng.integers(-15, 16, s).astype(np.float32) / 8.0
  return f(B, T, N, H), f(B, S, K, H), f(B, S, K, H), f(B, T, N, H)


@pytest.mark.parametrize("is_causal,window,G", [(False, None, 1), (True, None, 2), (False, (5, 3), 4)])
def test_backward_products_without_rounding_match_float64(is_causal, window, G):
  # With MX-exact inputs and the P/dS rounding switched off, the explicit backward must be
  # exact attention's gradient: this checks every product, transpose, GQA sum and scale.
  B, T, S, K, H = 2, 37, 45, 2, 64
  N = K * G
  q, k, v, do = _exact_inputs(B, T, S, N, K, H, seed=G)
  kw = dict(scale=0.11, is_causal=is_causal, window=window,
            q_seqlen=jnp.array([37, 20], jnp.int32), kv_seqlen=jnp.array([45, 30], jnp.int32))
  qa, ka, va, doa = map(jnp.asarray, (q, k, v, do))
  o, lse = R.mx_forward(mx.quantize(qa, 3), mx.quantize(ka, 3), mx.quantize(va, 1), round_p=False, **kw)
  to, tlse = R.truth_forward(q, k, v, **kw)
  assert rel_err(o, to) < 1e-6 and rel_err(lse, tlse) < 1e-6
  delta = jnp.sum(jnp.asarray(to, jnp.float32) * doa, -1)
  grads = R.mx_backward(mx.quantize(qa, 3), mx.quantize(qa, 1), mx.quantize(ka, 3), mx.quantize(ka, 1),
                        mx.quantize(va, 3), mx.quantize(doa, 3), mx.quantize(doa, 1), lse, delta,
                        round_p=False, **kw)[:3]
  for g, t in zip(grads, R.truth_backward(q, k, v, do, **kw)):
    assert rel_err(g, t) < 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_forward_recipe_error_is_small(kind):
  B, T, S, N, K, H = 1, 64, 96, 4, 2, 128
  q, k, v = make_qkv(kind, B, T, S, N, K, H, seed=7)
  o, lse = R.mx_forward(*mx_inputs(q, k, v), scale=H ** -0.5, is_causal=True)
  ref = truth_and_bf16(q, k, v, scale=H ** -0.5, is_causal=True)["truth"]
  # P keeps 3 mantissa bits (rounding error <= 2**-4 each); averaged over a row the output error
  # is a few percent at most; the lse comes from the unrounded P and is fp32-exact.
  assert rel_err(o, ref[0]) < 0.03
  assert rel_err(lse, ref[1]) < 1e-6


def test_fully_masked_rows_give_zero_and_neg_inf():
  q, k, v = make_qkv("normal", 2, 16, 16, 2, 2, 64)
  o, lse = R.mx_forward(*mx_inputs(q, k, v), scale=0.125, q_seqlen=jnp.array([16, 5], jnp.int32),
                        kv_seqlen=jnp.array([0, 16], jnp.int32))
  o, lse = np.asarray(o), np.asarray(lse)
  assert not np.isnan(o).any()
  assert (o[0] == 0).all() and np.isneginf(lse[0]).all()
  assert (o[1, 5:] == 0).all() and np.isneginf(lse[1, 5:]).all() and np.isfinite(lse[1, :5]).all()


def test_nan_input_propagates_only_where_it_is_used():
  q, k, v = make_qkv("normal", 2, 8, 8, 1, 1, 64)
  v[1, 3, 0, 0] = np.nan
  o, _ = R.mx_forward(*mx_inputs(q, k, v), scale=0.125)
  o = np.asarray(o)
  assert np.isfinite(o[0]).all()          # batch 0 never reads the NaN
  # V is blocked along S: the NaN makes the scale of (keys 0-31, column 0) NaN, and exactly
  # the outputs of column 0 of batch 1 depend on that block.
  assert np.isnan(o[1, :, 0, 0]).all()
  assert np.isfinite(o[1, :, 0, 1:]).all()


@pytest.mark.parametrize("do_kind", ["normal", "varying"])
def test_backward_recipe_error_is_bounded(do_kind):
  B, T, S, N, K, H = 1, 64, 80, 2, 1, 64
  q, k, v = make_qkv("normal", B, T, S, N, K, H, seed=3)
  do = make_do(do_kind, B, T, N, H)
  qa, ka, va, doa = map(jnp.asarray, (q, k, v, do))
  kw = dict(scale=H ** -0.5, is_causal=True)
  o, lse = R.mx_forward(*mx_inputs(q, k, v), **kw)
  delta = jnp.sum(o * doa, -1)
  grads = R.mx_backward(mx.quantize(qa, 3), mx.quantize(qa, 1), mx.quantize(ka, 3), mx.quantize(ka, 1),
                        mx.quantize(va, 3), mx.quantize(doa, 3), mx.quantize(doa, 1), lse, delta, **kw)[:3]
  truth = truth_and_bf16(q, k, v, do, **kw)["truth"][2:]
  for g, t in zip(grads, truth):
    assert rel_err(g, t) < 0.08  # MXFP8 gradients: a few percent (P8, dS8 and dO8 roundings)
