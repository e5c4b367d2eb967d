"""jax_fa4.dot_product_attention: jax.nn's conventions, transformations, MX inputs, bad input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from contract import assert_contract, make_do, make_qkv, rel_err, truth_and_bf16
from jax_fa4 import backends, mx, reference as R

# Kernels that implementation=None may pick here: the ones held to the contract in this file.
KERNELS = [b for b in ("cpu", "cuda") if backends.get(b).default and backends.get(b).available()
           and jax.default_backend() == backends.get(b).platform]


def _arrays(kind="normal", B=2, T=33, S=47, N=4, K=2, H=64, dtype=jnp.float32, seed=0):
  q, k, v = make_qkv(kind, B, T, S, N, K, H, seed)
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def test_xla_backend_is_the_recipe_bit_for_bit():
  q, k, v = _arrays()
  o, lse = jax_fa4.dot_product_attention(q, k, v, is_causal=True, implementation="xla",
                                         return_residual=True)
  ro, rlse = R.mx_forward(mx.quantize(q, 3), mx.quantize(k, 3), mx.quantize(v, 1), scale=0.125,
                          is_causal=True, q_seqlen=jnp.full((2,), 33, jnp.int32),
                          kv_seqlen=jnp.full((2,), 47, jnp.int32))
  np.testing.assert_array_equal(np.asarray(o), np.asarray(ro))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(rlse))


@pytest.mark.parametrize("impl", ["xla"] + KERNELS)
@pytest.mark.parametrize("opts", [dict(), dict(is_causal=True), dict(local_window_size=(4, 2)),
                                  dict(local_window_size=3, is_causal=True)])
def test_same_conventions_as_jax_nn(impl, opts):
  # jax.nn on the dequantized MX values: the masks, scale and layouts must agree exactly, so
  # the lse (from the unrounded P) agrees to fp32 rounding and O differs only by P's rounding.
  q, k, v = _arrays()
  o, lse = jax_fa4.dot_product_attention(q, k, v, implementation=impl, return_residual=True, **opts)
  qd, kd, vd = mx.quantize(q, 3).dequantize(), mx.quantize(k, 3).dequantize(), mx.quantize(v, 1).dequantize()
  ro, rlse = jax.nn.dot_product_attention(qd, kd, vd, implementation="xla", return_residual=True,
                                          **opts)
  assert o.shape == ro.shape and o.dtype == ro.dtype and lse.shape == rlse.shape == (2, 33, 4)
  assert rel_err(lse, rlse) < 1e-5
  assert rel_err(o, ro) < 0.03


def test_rank3_inputs_and_dtypes():
  q, k, v = _arrays(B=1, dtype=jnp.bfloat16)
  o = jax_fa4.dot_product_attention(q[0], k[0], v[0])
  assert o.shape == q.shape[1:] and o.dtype == jnp.bfloat16
  o4 = jax_fa4.dot_product_attention(q, k, v)
  np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(o4[0], np.float32))
  for dt in (jnp.float16, jnp.float32):
    assert jax_fa4.dot_product_attention(*(x.astype(dt) for x in (q, k, v))).dtype == dt


@pytest.mark.parametrize("impl", ["xla"] + KERNELS)
@pytest.mark.parametrize("kind,do_kind", [("normal", "normal"), ("channel_outliers", "varying"),
                                          ("token_outliers", "normal"), ("tiny", "varying")])
def test_contract_through_the_public_function(impl, kind, do_kind):
  B, T, S, N, K, H = 2, 50, 70, 4, 2, 64
  q, k, v = make_qkv(kind, B, T, S, N, K, H, seed=11)
  do = make_do(do_kind, B, T, N, H, seed=12)
  lens = dict(query_seq_lengths=jnp.array([50, 31], jnp.int32),
              key_value_seq_lengths=jnp.array([70, 45], jnp.int32))
  f = lambda impl_: (lambda a, b, c: jax_fa4.dot_product_attention(
      a, b, c, is_causal=True, implementation=impl_, return_residual=True, **lens))
  args = tuple(map(jnp.asarray, (q, k, v)))
  cot = (jnp.asarray(do), jnp.zeros((B, T, N), jnp.float32))
  outs = {}
  for name in {impl, "xla"}:
    (o, lse), vjp = jax.vjp(f(name), *args)
    outs[name] = (o, lse) + vjp(cot)
  ref = truth_and_bf16(q, k, v, do, scale=H ** -0.5, is_causal=True,
                       q_seqlen=np.array([50, 31]), kv_seqlen=np.array([70, 45]))
  for i, name in enumerate(["o", "lse", "dq", "dk", "dv"]):
    assert_contract(name, outs[impl][i], outs["xla"][i], ref["bf16"][i], ref["truth"][i])


def test_jit_vmap_grad():
  H = 64
  q, k, v = _arrays(dtype=jnp.bfloat16, H=H)
  loss = lambda q, k, v: jnp.sum(jax_fa4.dot_product_attention(q, k, v, is_causal=True)
                                 .astype(jnp.float32) ** 2)
  g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  assert [x.dtype for x in g] == [jnp.bfloat16] * 3
  assert all(bool(jnp.all(jnp.isfinite(x.astype(jnp.float32)))) for x in g)
  g_eager = jax.grad(loss)(q, k, v)
  if jax.default_backend() == "cpu":
    # CPU kernels and XLA:CPU are deterministic and fuse identically: jit == eager, bitwise.
    np.testing.assert_array_equal(np.asarray(g[0], np.float32), np.asarray(g_eager, np.float32))
  else:
    # XLA:GPU fuses (and orders reductions) differently under jit; hold the jitted gradient to
    # the contract with the eager one as the recipe.
    qf, kf, vf = (np.asarray(x, np.float32) for x in (q, k, v))
    o = np.asarray(jax_fa4.dot_product_attention(q, k, v, is_causal=True), np.float32)
    ref = truth_and_bf16(qf, kf, vf, 2 * o, scale=H ** -0.5, is_causal=True)
    assert_contract("dq", g[0], g_eager, ref["bf16"][2], ref["truth"][2])
  # vmap over a new leading axis equals a loop over it.
  qs, ks, vs = (jnp.stack([x, 2 * x]) for x in (q, k, v))
  gv = jax.jit(jax.vmap(jax.grad(loss)))(qs, ks, vs)
  for i in range(2):
    np.testing.assert_array_equal(np.asarray(gv[i], np.float32),
                                  np.asarray(jax.grad(loss)(qs[i], ks[i], vs[i]), np.float32))
  ov = jax.vmap(lambda a, b, c: jax_fa4.dot_product_attention(a, b, c))(qs, ks, vs)
  np.testing.assert_array_equal(np.asarray(ov[1], np.float32),
                                np.asarray(jax_fa4.dot_product_attention(qs[1], ks[1], vs[1]),
                                           np.float32))


def test_length_zero_gives_zero_output_and_neg_inf_lse_without_nan():
  q, k, v = _arrays()
  lens = dict(query_seq_lengths=jnp.array([0, 33], jnp.int32),
              key_value_seq_lengths=jnp.array([47, 0], jnp.int32))
  o, lse = jax_fa4.dot_product_attention(q, k, v, return_residual=True, **lens)
  assert (np.asarray(o) == 0).all() and np.isneginf(np.asarray(lse)).all()
  g = jax.grad(lambda q, k, v: jnp.sum(jax_fa4.dot_product_attention(q, k, v, **lens)),
               argnums=(0, 1, 2))(q, k, v)
  assert all((np.asarray(x) == 0).all() for x in g)


def test_mx_inputs_are_used_as_they_are():
  q, k, v = _arrays()
  qm, km, vm = mx.quantize(q, 3), mx.quantize(k, 3), mx.quantize(v, 1)
  o_mx = jax_fa4.dot_product_attention(qm, km, vm, is_causal=True)
  o_f = jax_fa4.dot_product_attention(q, k, v, is_causal=True)
  assert o_mx.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(o_mx, np.float32),
                                np.asarray(o_f.astype(jnp.bfloat16), np.float32))
  # Mixed: float query, MX key/value; MX operands are constants for differentiation.
  gq, gk = jax.grad(lambda a, b: jnp.sum(jax_fa4.dot_product_attention(a, b, vm)
                                         .astype(jnp.float32)), argnums=(0, 1))(q, km)
  assert gq.dtype == jnp.float32 and float(jnp.abs(gq).max()) > 0
  assert isinstance(gk, mx.MXArray) and not np.asarray(gk.data.astype(jnp.float32)).any()


def test_bias_and_mask_run_on_the_recipe():
  q, k, v = _arrays(B=1, N=2, K=2)
  rng = np.random.default_rng(5)
  bias = jnp.asarray(rng.standard_normal((1, 2, 33, 47)), jnp.float32)
  mask = jnp.asarray(rng.random((1, 1, 33, 47)) > 0.3)
  o = jax_fa4.dot_product_attention(q, k, v, bias, mask)
  ro = jax.nn.dot_product_attention(q, k, v, bias, mask)
  assert rel_err(o, ro) < 0.05
  db = jax.grad(lambda b: jnp.sum(jax_fa4.dot_product_attention(q, k, v, b, mask) ** 2))(bias)
  rdb = jax.grad(lambda b: jnp.sum(jax.nn.dot_product_attention(q, k, v, b, mask) ** 2))(bias)
  assert db.shape == bias.shape and rel_err(db, rdb) < 0.1
  # A bias broadcast over heads gets its gradient summed over them.
  db1 = jax.grad(lambda b: jnp.sum(jax_fa4.dot_product_attention(q, k, v, b) ** 2))(bias[:, :1])
  assert db1.shape == (1, 1, 33, 47)
  if "cpu" in KERNELS:
    with pytest.raises(NotImplementedError, match="bias is not supported by implementation='cpu'"):
      jax_fa4.dot_product_attention(q, k, v, bias, implementation="cpu")


def _resolve_default(**over):
  features = dict(q_shape=(2, 33, 4, 64), k_shape=(2, 47, 2, 64), head_dim=64, num_heads=4,
                  num_kv_heads=2, has_bias=False, has_mask=False, window=None, is_causal=False,
                  out_dtype="float32")
  features.update(over)
  return backends.resolve(None, **features)


def test_default_implementation_picks_a_kernel_when_one_serves():
  assert _resolve_default() == (KERNELS[0] if KERNELS else "xla")
  assert _resolve_default(has_bias=True) == "xla"
  assert _resolve_default(head_dim=48, q_shape=(2, 33, 4, 48), k_shape=(2, 47, 2, 48)) == "xla"


# ---- bad input: a clear exception naming the argument and its value, before anything runs ----

def _bad(**over):
  q, k, v = _arrays(B=2, T=8, S=8, N=4, K=2, H=64)
  args = dict(query=q, key=k, value=v)
  args.update(over)
  return args


@pytest.mark.parametrize("over,exc,pattern", [
    (dict(key=jnp.ones((2, 8, 2, 32))), ValueError, r"key.shape=\(2, 8, 2, 32\) and value.shape"),
    (dict(key=jnp.ones((2, 8, 2, 32)), value=jnp.ones((2, 8, 2, 32))), ValueError,
     r"key head_dim=32 must equal query head_dim=64"),
    (dict(key=jnp.ones((2, 8, 3, 64)), value=jnp.ones((2, 8, 3, 64))), ValueError,
     r"N=4 must be a multiple of .* K=3"),
    (dict(key=jnp.ones((3, 8, 2, 64)), value=jnp.ones((3, 8, 2, 64))), ValueError,
     r"key.shape=\(3, 8, 2, 64\) has batch 3"),
    (dict(query=jnp.ones((2, 8, 4, 64), jnp.int32)), TypeError, r"query.dtype=int32"),
    (dict(query=jnp.ones((2, 8, 4, 64), jnp.float16)), TypeError, r"query.dtype=float16, key.dtype"),
    (dict(query=jnp.ones((8, 64))), ValueError, r"query.shape=\(8, 64\) must be BTNH"),
    (dict(query_seq_lengths=jnp.array([9, 1], jnp.int32)), ValueError,
     r"query_seq_lengths=\[9, 1\] must lie in \[0, 8\]"),
    (dict(key_value_seq_lengths=jnp.array([-1, 1], jnp.int32)), ValueError,
     r"key_value_seq_lengths=\[-1, 1\] must lie in \[0, 8\]"),
    (dict(query_seq_lengths=jnp.array([1, 1, 1], jnp.int32)), ValueError,
     r"query_seq_lengths.shape=\(3,\) must be \(2,\)"),
    (dict(query_seq_lengths=jnp.array([1, 1], jnp.int64) if jax.config.jax_enable_x64
          else np.array([1.0, 1.0], np.float32)), TypeError, r"query_seq_lengths.dtype="),
    (dict(local_window_size=(-1, 2)), ValueError, r"local_window_size=\(-1, 2\) must have left >= 0"),
    (dict(local_window_size=(1, 2, 3)), ValueError, r"local_window_size=\(1, 2, 3\) must be"),
    (dict(local_window_size="big"), ValueError, r"local_window_size='big' must be"),
    (dict(bias=jnp.ones((2, 4, 8))), ValueError, r"bias.shape=\(2, 4, 8\) must be 4D"),
    (dict(bias=jnp.ones((2, 3, 8, 8))), ValueError, r"bias.shape=\(2, 3, 8, 8\) is not broadcastable"),
    (dict(mask=jnp.ones((1, 1, 8, 8), jnp.float32)), TypeError, r"mask.dtype=float32 must be bool"),
    (dict(implementation="cudnn"), ValueError, r"implementation='cudnn' must be one of"),
    (dict(scale=float("nan")), ValueError, r"scale=nan must be a finite"),
    (dict(deterministic="yes"), TypeError, r"deterministic='yes' must be a bool"),
])
def test_bad_input_raises_naming_the_argument(over, exc, pattern):
  with pytest.raises(exc, match=pattern):
    jax_fa4.dot_product_attention(**_bad(**over))


def test_bad_mx_inputs():
  q, k, v = _arrays(B=2, T=8, S=8, N=4, K=2, H=64)
  with pytest.raises(ValueError, match=r"value.axis=3: an MXArray value must be blocked along"):
    jax_fa4.dot_product_attention(q, k, mx.quantize(v, 3))
  km = mx.quantize(k, 3)
  with pytest.raises(ValueError, match=r"key.scale.shape=\(2, 8, 2, 1\) does not match"):
    jax_fa4.dot_product_attention(q, mx.MXArray(km.data, km.scale[..., :1], 3), v)


def test_unavailable_explicit_backend_raises():
  q, k, v = _arrays(B=2, T=8, S=8, N=4, K=2, H=64)
  here = [b for b in ("cpu", "cuda", "cuda_fp8") if backends.get(b).available()
          and jax.default_backend() == backends.get(b).platform]
  for name in ("cuda", "cuda_fp8"):
    if name not in here:
      with pytest.raises(RuntimeError, match=f"implementation='{name}'"):
        jax_fa4.dot_product_attention(q, k, v, implementation=name)
  for b in here:
    with pytest.raises(ValueError, match=r"head_dim=48 must be one of \(64, 128, 256\)"):
      qq, kk, vv = _arrays(B=1, T=8, S=8, N=2, K=2, H=48)
      jax_fa4.dot_product_attention(qq, kk, vv, implementation=b)


def test_deterministic_gradients_are_reproducible():
  """deterministic=True: the default backend's gradients, bitwise equal from call to call (the CUDA
  backward orders its dQ adds; tests/test_cuda_backward.py covers the kernel itself)."""
  rng = np.random.default_rng(3)
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((1, 40, 2, 64), (1, 56, 1, 64), (1, 56, 1, 64)))
  grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jax_fa4.dot_product_attention(
      q, k, v, is_causal=True, deterministic=True) ** 2), (0, 1, 2)))
  a, b = grad(q, k, v), grad(q, k, v)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_cuda_grid_limits_are_refused_before_launch():
  # The V preparation's grid holds one row per (kv head, 64-column block): past 65535 rows the CUDA
  # backend must decline the call by name rather than fail in the launcher.
  from jax_fa4 import _cuda_ops as co
  assert co.unsupported_reason((1, 8, 16, 128), (1, 8, 16, 128)) is None
  assert co.unsupported_reason((1, 8, 20000, 128), (1, 8, 20000, 128)) is None  # 40000 rows
  msg = co.unsupported_reason((1, 8, 16384, 256), (1, 8, 16384, 256))  # 65536 rows
  assert msg is not None and "K=16384" in msg and "head_dim/64=4" in msg
