"""The MX quantizer, bit-exact on hand-computed cases (NUMERICS.md section 1)."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_fa4 import mx


def bytes_of(m):
  return np.asarray(mx.e8m0_to_bytes(m.scale))


def elems(m):
  return np.asarray(m.data.astype(jnp.float32))


def block(first, rest=0.0, n=32):
  return jnp.array([first] + [rest] * (n - 1), jnp.float32)


@pytest.mark.parametrize("value,byte,elem", [
    (0.0, 0x00, 0.0),        # amax 0 -> 2**-127
    (1.0, 119, 256.0),       # 1/448 = 1.14 * 2**-9 -> rounds up to 2**-8
    (2.0 ** -8, 111, 256.0), # powers of two stay exact, one scale step per octave
    (256.0, 127, 256.0),     # 256/448 < 1 -> scale 2**0
    (448.0, 127, 448.0),     # exactly at the e4m3 maximum: fp32(448 * fp32(1/448)) == 1.0
    (449.0, 128, 224.0),     # just past it: the scale rounds up, nothing saturates
    (1000.0, 129, 256.0),    # 1000/4 = 250 rounds (RNE) to 256
    (-1000.0, 129, -256.0),
])
def test_single_value_blocks(value, byte, elem):
  m = mx.quantize(block(value, value))
  assert bytes_of(m).tolist() == [byte]
  assert (elems(m) == elem).all()


def test_round_to_nearest_even_and_subnormals():
  # Scale 2**0 (amax 256): e4m3 has 3 mantissa bits, subnormals m * 2**-9.
  x = jnp.array([256.0, 1.0625, 1.1875, 2.0 ** -10, 1.5 * 2.0 ** -9, 3 * 2.0 ** -9,
                 2.0 ** -9, 2.0 ** -6] + [0.0] * 24, jnp.float32)
  m = mx.quantize(x)
  assert bytes_of(m).tolist() == [127]
  want = [256.0, 1.0, 1.25, 0.0, 2.0 ** -8, 3 * 2.0 ** -9, 2.0 ** -9, 2.0 ** -6]
  assert elems(m)[:8].tolist() == want
  np.testing.assert_array_equal(np.asarray(m.dequantize())[:8], want)


def test_nan_and_inf():
  m = mx.quantize(jnp.stack([block(jnp.nan, 1.0), block(jnp.inf, 1.0), block(-jnp.inf, 1.0)]))
  assert bytes_of(m)[:, 0].tolist() == [0xFF, 0xFE, 0xFE]
  assert np.isnan(elems(m)[0]).all()                  # a NaN scale: the whole block is NaN
  assert elems(m)[1, 0] == 448.0 and elems(m)[2, 0] == -448.0  # inf saturates at the largest scale
  d = np.asarray(m.dequantize())
  assert np.isnan(d[0]).all() and d[1, 0] == np.inf and d[2, 0] == -np.inf


def test_block_axis_not_multiple_of_32_and_any_axis():
  x = jnp.concatenate([jnp.full((32,), 3.0), jnp.full((32,), 0.5), jnp.full((6,), 96.0)])
  m = mx.quantize(x)
  assert m.data.shape == (70,) and m.scale.shape == (3,)
  # 3/448 -> 2**-7; 0.5/448 -> 2**-9 (rounded up from 2**-9.8); the 6-element tail block is
  # zero-padded for its amax only: 96/448 -> 2**-2.
  assert bytes_of(m).tolist() == [120, 118, 125]
  np.testing.assert_array_equal(np.asarray(m.dequantize()), np.asarray(x))
  y = jnp.broadcast_to(x[:, None], (70, 3))
  my = mx.quantize(y, axis=0)
  assert my.scale.shape == (3, 3) and my.axis == 0
  np.testing.assert_array_equal(bytes_of(my)[:, 1], [120, 118, 125])


def _numpy_quantize(x):
  """An independent numpy/ml_dtypes implementation of the rule, along the last axis."""
  x = np.asarray(x, np.float32)
  n = x.shape[-1]
  pad = (-n) % 32
  xp = np.concatenate([x, np.zeros(x.shape[:-1] + (pad,), np.float32)], -1)
  xb = xp.reshape(x.shape[:-1] + (-1, 32))
  amax = np.abs(xb).max(-1)
  v = (amax * (np.float32(1) / np.float32(448))).astype(np.float32)
  bits = v.view(np.uint32)
  byte = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0)
  byte = np.minimum(byte, 254).astype(np.int64)
  mult = np.exp2((127 - byte).astype(np.float64))[..., None]
  el = np.clip(xb.astype(np.float64) * mult, -448, 448).astype(np.float32)
  el = el.astype(ml_dtypes.float8_e4m3fn).reshape(xp.shape)[..., :n]
  return byte.astype(np.uint8), el


@pytest.mark.parametrize("scale_exp", [-12, 0, 9])
def test_random_matches_independent_numpy(scale_exp):
  rng = np.random.default_rng(scale_exp + 100)
  x = (rng.standard_normal((17, 200)) * 2.0 ** scale_exp
       * np.exp(rng.uniform(-4, 4, (17, 1)))).astype(np.float32)
  m = mx.quantize(jnp.asarray(x))
  byte, el = _numpy_quantize(x)
  np.testing.assert_array_equal(bytes_of(m), byte)
  np.testing.assert_array_equal(np.asarray(m.data).view(np.uint8), el.view(np.uint8))


def test_requantize_and_roundtrip_error():
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((64, 96)), jnp.float32)
  m = mx.quantize(x, axis=1)
  step = mx.dequantize(mx.MXArray(jnp.ones_like(m.data), m.scale, 1))  # 2**(byte-127) per element
  normal = jnp.abs(x) >= step * 2.0 ** -6
  err = jnp.abs(m.dequantize() - x)
  # e4m3 keeps 3 mantissa bits: half an ulp is 2**-4 relative for normals, and half the
  # subnormal spacing (2**-10 of the block scale) below that.
  assert bool(jnp.all(jnp.where(normal, err <= 2.0 ** -4 * jnp.abs(x), err <= step * 2.0 ** -10)))
  r = mx.requantize(m, 0)
  assert r.axis == 0 and r.scale.shape == (2, 96)
  assert mx.requantize(m, 1) is m


def test_mxarray_is_a_pytree_and_jits():
  m = jax.jit(lambda x: mx.quantize(x, 0))(jnp.ones((64, 4)))
  leaves, tree = jax.tree_util.tree_flatten(m)
  assert len(leaves) == 2
  m2 = jax.tree_util.tree_unflatten(tree, leaves)
  assert m2.axis == 0
  np.testing.assert_array_equal(np.asarray(jax.jit(mx.dequantize)(m2)), np.ones((64, 4)))


def test_validate_rejects_bad_scales():
  m = mx.quantize(jnp.ones((4, 64)), 1)
  with pytest.raises(ValueError, match=r"x.scale.shape=\(4, 3\)"):
    mx.MXArray(m.data, jnp.concatenate([m.scale, m.scale[:, :1]], 1), 1).validate("x")
  with pytest.raises(TypeError, match="x.data.dtype=float32"):
    mx.MXArray(jnp.ones((4, 64)), m.scale, 1).validate("x")
  with pytest.raises(TypeError, match="x.dtype=int32"):
    mx.quantize(jnp.ones((4,), jnp.int32))


def test_rounding_survives_jit_on_the_default_device():
  # XLA may fold f32 -> e4m3 -> f32 conversions away (on GPU with its default excess-precision
  # setting); the recipe's roundings must happen on every backend, inside jit and fused code.
  rng = np.random.default_rng(9)
  p = jnp.asarray(rng.random((64, 256)), jnp.float32)
  got = jax.jit(lambda p: mx.quantize_fixed(p * 0.5, 256.0) * 2.0)(p)
  want = (np.clip(np.asarray(p) * 0.5 * 256, -448, 448).astype(ml_dtypes.float8_e4m3fn)
          .astype(np.float32) / 256.0 * 2.0)
  np.testing.assert_array_equal(np.asarray(got), want)
  x = jnp.asarray(rng.standard_normal((8, 96)), jnp.float32)
  qdq = jax.jit(lambda x: mx.quantize(x * 3.0, 1).dequantize())(x)
  byte, el = _numpy_quantize(np.asarray(x) * 3.0)
  want = el.astype(np.float32) * np.exp2(np.repeat(byte.astype(np.float64) - 127, 32, -1)[:, :96])
  np.testing.assert_array_equal(np.asarray(qdq), want.astype(np.float32))


def test_package_quantize_is_mx_quantize_off_hopper(monkeypatch):
  # jax_fa4.quantize: mx.quantize's bits wherever it runs. On the CPU device it is mx.quantize;
  # with the CUDA path forced on, the program compiled for the CPU still takes mx.quantize's
  # branch (platform_dependent), under jit, vmap and grad alike. The input is committed to the CPU
  # so that the test means the same on a Hopper machine (where the default device is the GPU, and
  # the fake kernel below would otherwise run: seen on the H200, 2026-12-05).
  import jax_fa4
  cpu = jax.devices("cpu")[0]
  x = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal((3, 70, 5)) * 100, jnp.bfloat16), cpu)
  want = mx.quantize(x, 1)

  def same(got):
    np.testing.assert_array_equal(bytes_of(got), bytes_of(want))
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(got.data, jnp.uint8)),
                                  np.asarray(jax.lax.bitcast_convert_type(want.data, jnp.uint8)))

  same(jax_fa4.quantize(x, 1))
  from jax_fa4 import _cuda_ops
  traced = []

  def fake_cuda(a, axis):  # wrong on purpose: it must be traced but never run on the CPU
    traced.append(axis)
    m = mx.quantize(a * 2, axis)
    return mx.MXArray(data=m.data, scale=m.scale, axis=axis)

  monkeypatch.setattr(mx, "_cuda_quantizer_available", lambda: True)
  monkeypatch.setattr(_cuda_ops, "quantize", fake_cuda)
  # The first call above traced the dispatch (on a GPU machine, with the real kernel): drop jax's
  # trace caches so the calls below trace the fake one.
  jax.clear_caches()
  same(jax_fa4.quantize(x, 1))  # eager: the branch is still picked for x's device (the CPU)
  same(jax.jit(lambda a: jax_fa4.quantize(a, 1))(x))
  assert traced
  same(jax.vmap(lambda a: jax_fa4.quantize(a, 0))(x))
  xf = jax.device_put(x.astype(jnp.float32), cpu)
  loss = lambda q: (lambda a: jnp.sum(q(a, 1).dequantize() * jnp.cos(a)))
  np.testing.assert_array_equal(np.asarray(jax.jit(jax.grad(loss(jax_fa4.quantize)))(xf)),
                                np.asarray(jax.jit(jax.grad(loss(mx.quantize)))(xf)))
