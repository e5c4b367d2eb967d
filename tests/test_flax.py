"""jax_fa4.flax_attention: the attention_fn for Flax's layers, and the nnx Attention layer.

Accuracy is the NUMERICS.md contract (tests/contract.py): the truth is float64 attention on the
dequantized MX inputs (for a layer: on the q, k, v the layer itself computed, mapped through the
layer's own projections in float64), the recipe is implementation='xla', and "Flax's own
attention" is shown to compute that same truth (to fp32 rounding) when given those inputs.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

from contract import (assert_contract, dequantized_inputs, make_do, make_qkv, rel_err,  # noqa: E402
                      truth_and_bf16)
from jax_fa4 import backends, mx  # noqa: E402
from jax_fa4 import flax_attention as FA  # noqa: E402
from jax_fa4 import reference as R  # noqa: E402

KERNELS = [b for b in ("cpu", "cuda") if backends.get(b).available()
           and jax.default_backend() == backends.get(b).platform]
IMPLS = ["xla"] + KERNELS
# fp32 attention against float64 on identical inputs: a few fp32 roundings per output, through
# sums of <= 100 terms, stay far below this (the observed values are ~1e-7).
FP32_VS_F64 = 1e-5


def _flax_batch(x, lead=(2, 2)):
  """[B, ...] -> [*lead, ...] with prod(lead) == B: Flax allows several batch dims."""
  return x.reshape(lead + x.shape[1:])


# ---- the attention_fn, called the way Flax calls it ------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind,do_kind", [("normal", "normal"), ("channel_outliers", "varying"),
                                          ("token_outliers", "normal"), ("tiny", "varying")])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_fn_contract(impl, kind, do_kind, causal):
  B, T, S, N, K, H = 4, 40, 40 if causal else 56, 4, 2, 64
  q, k, v = make_qkv(kind, B, T, S, N, K, H, seed=3)
  do = make_do(do_kind, B, T, N, H, seed=4)
  flax_kw = dict(mask=None, dropout_rng=None, dropout_rate=0.0, broadcast_dropout=True,
                 deterministic=True, dtype=None, precision=None, module=None, is_causal=causal)

  def run(implementation):
    f = lambda a, b, c: FA.dot_product_attention(a, b, c, implementation=implementation,
                                                 **flax_kw)
    args = tuple(_flax_batch(jnp.asarray(x)) for x in (q, k, v))
    o, vjp = jax.vjp(f, *args)
    assert o.shape == args[0].shape and o.dtype == jnp.float32
    return tuple(x.reshape((B,) + x.shape[2:]) for x in (o,) + vjp(_flax_batch(jnp.asarray(do))))

  got, rec = run(impl), run("xla")
  ref = truth_and_bf16(q, k, v, do, scale=H ** -0.5, is_causal=causal)
  # got/rec are (o, dq, dk, dv); the references are (o, lse, dq, dk, dv).
  for j, (i, name) in enumerate(((0, "o"), (2, "dq"), (3, "dk"), (4, "dv"))):
    assert_contract(name, got[j], rec[j], ref["bf16"][i], ref["truth"][i])


@pytest.mark.parametrize("opts", [dict(is_causal=True), dict(mask="random"), dict(mask="heads")])
def test_flax_own_attention_computes_the_truth_on_the_same_inputs(opts):
  """Flax's own attention_fn (nnx and linen) on the dequantized MX inputs IS the truth (to fp32
  rounding), with the same layouts, GQA, scale and mask meaning: so the contract against the
  truth is the contract against Flax's own attention."""
  B, T, S, N, K, H = 2, 24, 24, 4, 2, 64
  q, k, v = make_qkv("normal", B, T, S, N, K, H, seed=5)
  do = make_do("normal", B, T, N, H, seed=6)
  qd, kd, vd = dequantized_inputs(q, k, v)
  rng = np.random.default_rng(7)
  mask = None
  if "mask" in opts:
    shape = (B, 1, T, S) if opts["mask"] == "random" else (B, N, T, S)
    mask = rng.random(shape) > 0.4
    mask |= np.eye(T, S, dtype=bool)  # no fully masked row (Flax averages those uniformly)
  kw = dict(is_causal=opts.get("is_causal", False), mask=mask)
  truth = R.truth_forward(qd, kd, vd, scale=H ** -0.5, **kw)[0]
  dtruth = R.truth_backward(qd, kd, vd, do, scale=H ** -0.5, **kw)
  fns = [functools.partial(nnx.dot_product_attention, is_causal=kw["is_causal"])]
  if not kw["is_causal"] and K == N:  # linen has neither is_causal nor GQA
    fns.append(nn.dot_product_attention)
  for fn in fns:
    m = None if mask is None else jnp.asarray(mask)
    o, vjp = jax.vjp(lambda a, b, c: fn(a, b, c, mask=m), qd, kd, vd)
    assert rel_err(o, truth) < FP32_VS_F64
    for g, t in zip(vjp(jnp.asarray(do)), dtruth):
      assert rel_err(g, t) < FP32_VS_F64
  # And jax_fa4 through the Flax signature meets the contract on exactly these inputs.
  ref = truth_and_bf16(q, k, v, do, scale=H ** -0.5, **kw)
  outs = {}
  for impl in {"xla", None}:
    f = lambda a, b, c: FA.dot_product_attention(a, b, c, mask=None if mask is None else
                                                 jnp.asarray(mask), is_causal=kw["is_causal"],
                                                 implementation=impl)
    o, vjp = jax.vjp(f, *map(jnp.asarray, (q, k, v)))
    outs[impl] = (o,) + vjp(jnp.asarray(do))
  for j, i, name in ((0, 0, "o"), (1, 2, "dq"), (2, 3, "dk"), (3, 4, "dv")):
    assert_contract(name, outs[None][j], outs["xla"][j], ref["bf16"][i], ref["truth"][i])


def test_mask_is_passed_and_means_keep():
  B, T, N, H = 4, 32, 2, 64
  q, k, v = (_flax_batch(jnp.asarray(x)) for x in make_qkv("normal", B, T, T, N, N, H, seed=8))
  causal = nn.make_causal_mask(jnp.ones((2, 2, T)), dtype=jnp.float32)  # linen: float 1/0
  assert causal.shape == (2, 2, 1, T, T)
  via_mask = FA.dot_product_attention(q, k, v, mask=causal, implementation="xla")
  via_flag = FA.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
  np.testing.assert_array_equal(np.asarray(via_mask), np.asarray(via_flag))
  # A mask broadcast over the batch dims and one with per-head entries.
  rng = np.random.default_rng(9)
  for shape in ((1, 1, 1, T, T), (2, 2, N, T, T), (T, T)):
    keep = (rng.random(shape) > 0.5) | np.eye(T, dtype=bool)
    o = FA.dot_product_attention(q, k, v, mask=jnp.asarray(keep))
    full = np.broadcast_to(keep, (2, 2, N, T, T)).reshape(B, N, T, T)
    qq, kk, vv = (np.asarray(x).reshape((B,) + x.shape[2:]) for x in (q, k, v))
    ref = truth_and_bf16(qq, kk, vv, scale=H ** -0.5, mask=full)
    rec = R.mx_forward(mx.quantize(jnp.asarray(qq), 3), mx.quantize(jnp.asarray(kk), 3),
                       mx.quantize(jnp.asarray(vv), 1), scale=H ** -0.5, mask=jnp.asarray(full))[0]
    assert_contract("o", o.reshape((B,) + o.shape[2:]), rec, ref["bf16"][0], ref["truth"][0])
    # A dropped mask would be O(1) off; P's e4m3 rounding alone is ~2% (as in test_api).
    assert rel_err(o.reshape((B,) + o.shape[2:]), ref["truth"][0]) < 0.03


# ---- refusals ---------------------------------------------------------------------------------

def test_dropout_is_refused_unless_deterministic_or_zero():
  q, k, v = (jnp.asarray(x) for x in make_qkv("normal", 2, 8, 8, 2, 2, 64))
  with pytest.raises(NotImplementedError, match=r"dropout_rate=0.1 with deterministic=False"):
    FA.dot_product_attention(q, k, v, dropout_rate=0.1, deterministic=False,
                             dropout_rng=jax.random.key(0))
  base = FA.dot_product_attention(q, k, v)
  for kw in (dict(dropout_rate=0.1, deterministic=True), dict(dropout_rate=0.0,
                                                              deterministic=False)):
    np.testing.assert_array_equal(np.asarray(FA.dot_product_attention(q, k, v, **kw)),
                                  np.asarray(base))
  # Through the layers.
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 8, 128)), jnp.float32)
  m = nnx.MultiHeadAttention(2, 128, dropout_rate=0.1, attention_fn=FA.dot_product_attention,
                             decode=False, rngs=nnx.Rngs(0, dropout=1))
  with pytest.raises(NotImplementedError, match="dropout_rate=0.1"):
    m(x, deterministic=False)
  assert m(x, deterministic=True).shape == x.shape
  lm = nn.MultiHeadDotProductAttention(2, dropout_rate=0.1, attention_fn=FA.dot_product_attention)
  p = lm.init(jax.random.key(0), x, deterministic=True)
  with pytest.raises(NotImplementedError, match="dropout_rate=0.1"):
    lm.apply(p, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
  assert lm.apply(p, x, deterministic=True).shape == x.shape


def test_other_refusals_name_the_argument():
  q, k, v = (jnp.asarray(x) for x in make_qkv("normal", 2, 8, 8, 2, 2, 64))
  with pytest.raises(NotImplementedError, match=r"module=.*sow_weights"):
    FA.dot_product_attention(q, k, v, module=object())
  with pytest.raises(NotImplementedError, match="qk_attn_weights_einsum="):
    FA.dot_product_attention(q, k, v, qk_attn_weights_einsum=jnp.einsum)
  with pytest.raises(TypeError, match=r"unexpected keyword arguments \['input_positions'\]"):
    FA.dot_product_attention(q, k, v, input_positions=jnp.arange(8))
  m = nnx.MultiHeadAttention(2, 128, attention_fn=FA.dot_product_attention, decode=False,
                             rngs=nnx.Rngs(0))
  with pytest.raises(NotImplementedError, match="sow_weights"):
    m(jnp.ones((1, 8, 128)), sow_weights=True)


def test_precision_dtype_and_promotion():
  q, k, v = (jnp.asarray(x) for x in make_qkv("normal", 2, 8, 8, 2, 2, 64))
  o = FA.dot_product_attention(q, k, v, dtype=jnp.bfloat16, precision=jax.lax.Precision.HIGHEST)
  assert o.dtype == jnp.bfloat16
  assert FA.dot_product_attention(q.astype(jnp.bfloat16), k, v).dtype == jnp.float32
  from flax.nnx.nn.dtypes import promote_dtype
  assert FA.dot_product_attention(q, k, v, promote_dtype=promote_dtype,
                                  dtype=jnp.bfloat16).dtype == jnp.bfloat16


# ---- whole layers: output and input/parameter gradients against the float64 truth --------------

def _rope64(x, pos, theta=10000.0):
  H = x.shape[-1]
  freq = 1.0 / theta ** (np.arange(0, H, 2) / H)
  ang = np.asarray(pos, np.float64)[:, None] * freq
  cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
  x1, x2 = x[..., :H // 2], x[..., H // 2:]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _layer_truth(q, k, v, g, W, rope_pos=None, **mask_kw):
  """float64 truth/bf16 of (y, dx, dWq) for y = out(attention(q(x), k(x), v(x))).

  q, k, v are the layer's own fp32 projections (after RoPE) as the layer computed them, so
  their MX quantization is the layer's; the projections' maps are applied in float64.
  """
  H = q.shape[-1]
  do = np.einsum("btd,nhd->btnh", g, W["o"])
  ref = truth_and_bf16(q, k, v, do, scale=H ** -0.5, **mask_kw)
  out = {}
  for name, (o, _, dq, dk, dv) in ref.items():
    y = np.einsum("btnh,nhd->btd", o, W["o"]) + W["bo"]
    if rope_pos is not None:  # RoPE is a rotation: its transpose rotates back
      dq, dk = _rope64(dq, -rope_pos), _rope64(dk, -rope_pos)
    dx = sum(np.einsum("btnh,dnh->btd", d, W[n]) for d, n in ((dq, "q"), (dk, "k"), (dv, "v")))
    dwq = np.einsum("btd,btnh->dnh", W["x"], dq)
    out[name] = (y, dx, dwq)
  return out


def _check_layer(impl_out, rec_out, truth):
  for i, name in enumerate(("y", "dx", "dWq")):
    assert_contract(name, impl_out[i], rec_out[i], truth["bf16"][i], truth["truth"][i])


def _y_dx_dwq(m, x, g, call):
  """The layer's output, and the gradients of sum(y * g) w.r.t. x and the query kernel."""
  y = call(m, jnp.asarray(x))
  graphdef, params = nnx.split(m, nnx.Param)
  loss = lambda xx, p: jnp.sum(call(nnx.merge(graphdef, p), xx) * jnp.asarray(g))
  dx, dp = jax.grad(loss, argnums=(0, 1))(jnp.asarray(x), params)
  return y, dx, jax.tree.leaves(dp["query"]["kernel"])[0]


def _recorder(fn, store):
  @functools.wraps(fn)  # linen keeps only the keywords named in the signature
  def rec(q, k, v, *a, **kw):
    if not isinstance(q, jax.core.Tracer):  # the forward call, not the traced gradient one
      store.append(tuple(np.asarray(t, np.float64) for t in (q, k, v)))
    return fn(q, k, v, *a, **kw)
  return rec


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["normal", "token_outliers"])
def test_nnx_multihead_attention_drop_in(impl, kind):
  B, T, D, N, K = 2, 48, 256, 4, 2
  rng = np.random.default_rng(10)
  x = rng.standard_normal((B, T, D)).astype(np.float32)
  if kind == "token_outliers":
    x[:, rng.choice(T, 3, replace=False)] *= 40.0
  g = rng.standard_normal((B, T, D)).astype(np.float32)
  layers = {}
  for name, fn in (("impl", functools.partial(FA.dot_product_attention, implementation=impl)),
                   ("recipe", functools.partial(FA.dot_product_attention, implementation="xla")),
                   ("flax", nnx.dot_product_attention)):
    layers[name] = nnx.MultiHeadAttention(N, D, num_kv_heads=K, attention_fn=fn, decode=False,
                                          rngs=nnx.Rngs(0))
  store = []
  layers["impl"].attention_fn = _recorder(layers["impl"].attention_fn, store)

  def run(m):
    return _y_dx_dwq(m, x, g, lambda mm, xx: mm(xx, is_causal=True))

  outs = {name: run(m) for name, m in layers.items()}
  q, k, v = store[0]
  m = layers["impl"]
  W = dict(q=np.asarray(m.query.kernel[...], np.float64), k=np.asarray(m.key.kernel[...],
           np.float64), v=np.asarray(m.value.kernel[...], np.float64),
           o=np.asarray(m.out.kernel[...], np.float64), bo=np.asarray(m.out.bias[...],
           np.float64), x=x.astype(np.float64))
  truth = _layer_truth(q, k, v, g, W, is_causal=True)
  _check_layer(outs["impl"], outs["recipe"], truth)
  # Flax's own layer is the same function of the same parameters: its output differs from the
  # truth by the MX quantization of q, k, v only, which is the size of the bf16 reference's.
  e_flax, e_bf16 = rel_err(outs["flax"][0], truth["truth"][0]), rel_err(truth["bf16"][0],
                                                                          truth["truth"][0])
  assert e_flax < 3 * e_bf16, (e_flax, e_bf16)


def test_linen_multihead_dot_product_attention_drop_in():
  B, T, D, N = 2, 40, 256, 4
  rng = np.random.default_rng(11)
  x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
  g = rng.standard_normal((B, T, D)).astype(np.float32)
  mask = nn.make_causal_mask(jnp.ones((B, T)))  # linen's way to be causal: a dense mask
  store = []
  mods = dict(impl=nn.MultiHeadDotProductAttention(
      N, attention_fn=_recorder(FA.dot_product_attention, store)),
              recipe=nn.MultiHeadDotProductAttention(N, attention_fn=functools.partial(
                  FA.dot_product_attention, implementation="xla")))
  params = mods["impl"].init(jax.random.key(0), x, mask=mask)
  store.clear()

  def run(mod):
    f = lambda xx, p: jnp.sum(mod.apply(p, xx, mask=mask) * jnp.asarray(g))
    dx, dp = jax.grad(f, argnums=(0, 1))(x, params)
    return mod.apply(params, x, mask=mask), dx, dp["params"]["query"]["kernel"]

  outs = {n: run(m) for n, m in mods.items()}
  q, k, v = store[-1]
  P = jax.tree.map(lambda a: np.asarray(a, np.float64), params["params"])
  W = dict(q=P["query"]["kernel"], k=P["key"]["kernel"], v=P["value"]["kernel"],
           o=P["out"]["kernel"], bo=P["out"]["bias"], x=np.asarray(x, np.float64))
  truth = _layer_truth(q, k, v, g, W, mask=np.asarray(mask, bool))
  _check_layer(outs["impl"], outs["recipe"], truth)
  assert rel_err(outs["impl"][0], truth["truth"][0]) < 0.03  # the mask reached the kernel


# ---- the nnx Attention layer ------------------------------------------------------------------

def test_apply_rope_is_a_relative_rotation():
  rng = np.random.default_rng(12)
  q = rng.standard_normal((1, 1, 1, 64)).astype(np.float32)
  k = rng.standard_normal((1, 1, 1, 64)).astype(np.float32)
  dots = []
  for m, n in ((3, 1), (10, 8), (52, 50)):
    qr = FA.apply_rope(jnp.asarray(q), jnp.array([m]))
    kr = FA.apply_rope(jnp.asarray(k), jnp.array([n]))
    dots.append(float(jnp.sum(qr * kr)))
  np.testing.assert_allclose(dots, dots[0], rtol=1e-5)
  x = rng.standard_normal((2, 16, 3, 64)).astype(np.float32)
  pos = np.arange(16)
  assert rel_err(FA.apply_rope(jnp.asarray(x), pos), _rope64(x.astype(np.float64), pos)) < 1e-6
  if hasattr(nnx, "RoPE"):  # flax >= 0.12.10: the same convention as Flax's own RoPE
    rope = nnx.RoPE(theta=10000.0) if "theta" in nnx.RoPE.__init__.__code__.co_varnames else None
    if rope is not None:
      ref = jax.vmap(rope, in_axes=-2, out_axes=-2)(jnp.asarray(x))
      assert rel_err(FA.apply_rope(jnp.asarray(x), pos), ref) < 1e-5


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_layer_gqa_causal_rope(impl, monkeypatch):
  B, T, D, N, K = 2, 40, 256, 4, 2
  rng = np.random.default_rng(13)
  x = rng.standard_normal((B, T, D)).astype(np.float32)
  g = rng.standard_normal((B, T, D)).astype(np.float32)
  store = []
  orig = FA._attend

  def rec(attention, implementation, q, k, v, **kw):
    if not isinstance(q, jax.core.Tracer):
      store.append(tuple(np.asarray(t, np.float64) for t in (q, k, v)))
    return orig(attention, implementation, q, k, v, **kw)

  monkeypatch.setattr(FA, "_attend", rec)
  mods = {name: FA.Attention(D, N, K, implementation=i, use_bias=True, rngs=nnx.Rngs(0))
          for name, i in (("impl", impl), ("recipe", "xla"))}

  def run(m):
    y, dx, dwq = _y_dx_dwq(m, x, g, lambda mm, xx: mm(xx))
    return y, dx, dwq.reshape(D, N, D // N)

  outs = {}
  for name, m in mods.items():
    store.clear()
    outs[name] = run(m)
    if name == "impl":
      q, k, v = store[0]
  m = mods["impl"]
  H = D // N
  f64 = lambda a: np.asarray(a, np.float64)
  W = dict(q=f64(m.query.kernel[...]).reshape(D, N, H), k=f64(m.key.kernel[...]).reshape(D, K, H),
           v=f64(m.value.kernel[...]).reshape(D, K, H), o=f64(m.out.kernel[...]).reshape(N, H, D),
           bo=f64(m.out.bias[...]), x=x.astype(np.float64))
  truth = _layer_truth(q, k, v, g, W, rope_pos=np.arange(T), is_causal=True)
  _check_layer(outs["impl"], outs["recipe"], truth)
  assert outs["impl"][0].shape == (B, T, D)


def test_attention_layer_baselines_and_bad_config():
  x = jnp.asarray(np.random.default_rng(14).standard_normal((2, 16, 128)), jnp.float32)
  fa4 = FA.Attention(128, 2, 1, rngs=nnx.Rngs(0))
  base = FA.Attention(128, 2, 1, attention="xla", rngs=nnx.Rngs(0))
  # Same parameters; jax.nn's fp32 attention differs only by the MX quantization.
  assert rel_err(fa4(x), base(x)) < 0.05
  assert jax.jit(lambda m, x: m(x))(fa4, x).shape == x.shape
  with pytest.raises(ValueError, match="attention='flash' must be one of"):
    FA.Attention(128, 2, attention="flash", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="num_heads=4 must be a multiple of num_kv_heads=3"):
    FA.Attention(128, 4, 3, rngs=nnx.Rngs(0))
