"""Multi-device attention on 8 fake CPU devices: sharding rules, shard_map, ring attention.

Every sharded mode is held to the accuracy contract of NUMERICS.md section 4 against the
unsharded call (recipe = the unsharded ``implementation='xla'`` call; truth = float64 on the
dequantized MX inputs), for outputs, lse and the gradients. The compiled HLO is read to check
that batch/head-sharded calls run without collectives and that a ring step moves the MX bytes
docs/SHARDING.md states.

Needs ``--xla_force_host_platform_device_count=8`` before jax creates its CPU backend. This
module sets it when it is imported first; when another module initialised jax earlier (a full
``pytest tests/`` run without the flag in conftest.py), the whole module runs in a fresh
subprocess instead (test_module_in_subprocess), never faked or skipped.
"""
import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import dataclasses  # noqa: E402
import functools  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_fa4  # noqa: E402
from contract import assert_contract, make_do, make_qkv, truth_and_bf16  # noqa: E402
from jax_fa4 import backends  # noqa: E402
from jax_fa4 import sharding as shd  # noqa: E402

CPUS = jax.devices("cpu")
_CHILD = os.environ.get("JAX_FA4_SHARDING_CHILD") == "1"
NEED_SUBPROCESS = len(CPUS) < 8 and not _CHILD
# The kernels where they run here (the C++ CPU kernels), else the recipe.
IMPL = ("cpu" if backends.get("cpu").available() and jax.default_backend() == "cpu" else "xla")
AUTO = jax.sharding.AxisType.Auto
NAMES = ("o", "lse", "dq", "dk", "dv")
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")


@pytest.fixture(autouse=True)
def _eight_devices(request):
  if NEED_SUBPROCESS and request.node.originalname != "test_module_in_subprocess":
    pytest.skip("jax was initialised with fewer than 8 CPU devices: this module runs in "
                "test_module_in_subprocess instead")


def test_module_in_subprocess():
  if not NEED_SUBPROCESS:
    pytest.skip("8 CPU devices are present: the tests run in this process")
  env = dict(os.environ, JAX_FA4_SHARDING_CHILD="1",
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip())
  r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                      os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                     cwd=os.path.dirname(os.path.abspath(__file__)))
  assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]


def _mesh(shape, names):
  n = int(np.prod(shape))
  return jax.make_mesh(shape, names, devices=CPUS[:n], axis_types=(AUTO,) * len(shape))


def _count(hlo: str):
  return {op: len(re.findall(rf"\b{op}(-start)?\(", hlo)) for op in COLLECTIVES}


# ----------------------------------------------------------------------------------------------
# References (cached: several sharded modes share one set of inputs).

@functools.lru_cache(maxsize=None)
def _case(B, S, N, K, H, causal, ragged, kind="normal", do_kind="varying", seed=0):
  q, k, v = make_qkv(kind, B, S, S, N, K, H, seed=seed)
  do = make_do(do_kind, B, S, N, H, seed=seed + 1)
  if ragged:  # lengths that cut through chunks, one of them empty-ish
    ql = np.array([int(S * 0.9) - 1] + [S] * (B - 1), np.int32)
    kl = np.array([int(S * 0.6) + 3] + [S - 13] * (B - 1), np.int32)
  else:
    ql = kl = None
  lens = {} if not ragged else dict(query_seq_lengths=jnp.asarray(ql),
                                    key_value_seq_lengths=jnp.asarray(kl))

  def unsharded(a, b, c):
    return jax_fa4.dot_product_attention(a, b, c, is_causal=causal, implementation="xla",
                                         return_residual=True, **lens)

  args = tuple(map(jnp.asarray, (q, k, v)))
  recipe = _value_and_grads(jax.jit(unsharded), args, do)
  ref = truth_and_bf16(q, k, v, do, scale=H ** -0.5, is_causal=causal, q_seqlen=ql,
                       kv_seqlen=kl)
  return dict(args=args, do=do, lens=lens, recipe=recipe, ref=ref)


def _value_and_grads(f, args, do):
  (o, lse), vjp = jax.vjp(f, *args)
  cot = (jnp.asarray(do, o.dtype), jnp.zeros(lse.shape, lse.dtype))
  return (o, lse) + tuple(vjp(cot))


def _check(case, outs):
  for i, name in enumerate(NAMES):
    assert_contract(name, outs[i], case["recipe"][i], case["ref"]["bf16"][i],
                    case["ref"]["truth"][i])


# ----------------------------------------------------------------------------------------------
# 1. jax.jit on batch/head-sharded inputs: shard-local, no collective, no resharding.

# One case for every mesh: GQA 4:1 (N=8 query heads on K=2 kv heads), causal, ragged lengths.
JIT_CASE = (8, 96, 8, 2, 64, True, True)


@pytest.mark.parametrize("mesh_shape,spec,impl", [
    ((8,), ("b", None), IMPL),         # batch only
    ((2,), (None, "h"), IMPL),         # heads only: kv heads split with their query heads
    ((4, 2), ("b", "h"), IMPL),        # both
    ((4, 2), ("b", "h"), "xla"),       # both, the recipe backend
])
def test_jit_on_sharded_inputs_runs_shard_local(mesh_shape, spec, impl):
  case = _case(*JIT_CASE)
  names = tuple(a for a in ("b", "h") if a in spec)
  mesh = _mesh(mesh_shape, names)
  sh = NamedSharding(mesh, P(spec[0], None, spec[1], None))
  args = tuple(jax.device_put(x, sh) for x in case["args"])
  lens = {n: jax.device_put(x, NamedSharding(mesh, P(spec[0]))) for n, x in case["lens"].items()}
  f = lambda a, b, c: jax_fa4.dot_product_attention(a, b, c, is_causal=True, implementation=impl,
                                                    return_residual=True, **lens)
  do = jax.device_put(jnp.asarray(case["do"]), sh)
  # Forward and backward in one program: no collective anywhere (so none in the forward).
  compiled = jax.jit(lambda a, b, c, do: _value_and_grads(f, (a, b, c), do)).lower(
      *args, do).compile()
  assert _count(compiled.as_text()) == dict.fromkeys(COLLECTIVES, 0), _count(compiled.as_text())
  outs = compiled(*args, do)
  for x in (outs[0],) + tuple(outs[2:]):
    assert x.sharding.is_equivalent_to(sh, 4), x.sharding
  _check(case, outs)


def test_jit_sharded_without_shardy_uses_the_gspmd_callbacks():
  case = _case(*JIT_CASE)
  mesh = _mesh((4, 2), ("b", "h"))
  sh = NamedSharding(mesh, P("b", None, "h", None))
  args = tuple(jax.device_put(x, sh) for x in case["args"])
  lens = {n: jax.device_put(x, NamedSharding(mesh, P("b"))) for n, x in case["lens"].items()}
  f = lambda a, b, c: jax_fa4.dot_product_attention(a, b, c, is_causal=True, implementation=IMPL,
                                                    return_residual=True, **lens)
  do = jax.device_put(jnp.asarray(case["do"]), sh)
  old = jax.config.jax_use_shardy_partitioner
  jax.config.update("jax_use_shardy_partitioner", False)
  try:
    compiled = jax.jit(lambda a, b, c, do: _value_and_grads(f, (a, b, c), do)).lower(
        *args, do).compile()
    assert _count(compiled.as_text()) == dict.fromkeys(COLLECTIVES, 0)
    outs = compiled(*args, do)
  finally:
    jax.config.update("jax_use_shardy_partitioner", old)
  _check(case, outs)


def _sharded_step(shardy, mesh_shape=(4, 2), **fields):
  """JIT_CASE's forward and backward in one program over a ("b", "h") mesh, under one partitioner,
  with IMPL's Backend fields replaced by ``fields`` while it compiles: (outputs, collectives)."""
  from jax_fa4 import partitioning
  case = _case(*JIT_CASE)
  mesh = _mesh(mesh_shape, ("b", "h"))
  sh = NamedSharding(mesh, P("b", None, "h", None))
  args = tuple(jax.device_put(x, sh) for x in case["args"])
  lens = {n: jax.device_put(x, NamedSharding(mesh, P("b"))) for n, x in case["lens"].items()}
  do = jax.device_put(jnp.asarray(case["do"]), sh)
  f = lambda a, b, c: jax_fa4.dot_product_attention(a, b, c, is_causal=True, implementation=IMPL,
                                                    return_residual=True, **lens)
  old = jax.config.jax_use_shardy_partitioner
  jax.config.update("jax_use_shardy_partitioner", shardy)
  partitioning._op.cache_clear()  # ops are cached by backend name: none built over another Backend
  try:
    with pytest.MonkeyPatch.context() as mp:
      mp.setitem(backends._BACKENDS, IMPL, dataclasses.replace(backends.get(IMPL), **fields))
      compiled = jax.jit(lambda a, b, c, g: _value_and_grads(f, (a, b, c), g)).lower(
          *args, do).compile()
      return compiled(*args, do), _count(compiled.as_text())
  finally:
    jax.config.update("jax_use_shardy_partitioner", old)
    partitioning._op.cache_clear()


@pytest.mark.parametrize("shardy", [True, False])
def test_raw_cotangent_backward_is_shard_local_and_unchanged(shardy):
  # The CUDA backward takes dO as the cotangent itself (Backend.raw_cotangent: one float BTNH
  # operand, no do_t) and quantizes it as mx.quantize(do, 3). The same plumbing on this
  # machine's backend, with the quantization done in front of it: the sharded call stays
  # shard-local under both partitioners and the gradients are bitwise those of the MX path.
  from jax_fa4 import mx
  base = backends.get(IMPL)
  seen = []

  def backward(q_h, q_t, k_h, k_s, v_h, do_h, do_t, *rest):
    seen.append((type(do_h), do_h.shape, do_t))
    assert not isinstance(do_h, mx.MXArray) and do_t is None
    return base.backward(q_h, q_t, k_h, k_s, v_h, mx.quantize(do_h, 3), mx.quantize(do_h, 1),
                         *rest)

  want, _ = _sharded_step(shardy)
  got, collectives = _sharded_step(shardy, backward=backward, raw_cotangent=True)
  assert collectives == dict.fromkeys(COLLECTIVES, 0), collectives
  # Traced whole (the abstract evaluation) and on each device's shard: batch 8 / 4, kv heads
  # 2 / 2 with their 4 query heads.
  assert {s[1] for s in seen} == {(8, 96, 8, 64), (2, 96, 4, 64)}, seen
  for name, a, b in zip(NAMES, got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.mark.parametrize("shardy", [True, False])
def test_backward_without_transposed_residuals_is_shard_local(shardy):
  # The CUDA backends keep no q_t / k_s residuals (Backend.transposed_residuals=False): their
  # backward gets None for both, and the partitioner's specs and Shardy rule leave them out. The
  # same plumbing on this machine's backend, with q_t and k_s re-blocked from q_h and k_h in front
  # of it (not the MX path's bits, so the sharded call is compared with the same backend on one
  # device): shard-local under both partitioners, and the same bits as unsharded.
  from jax_fa4 import mx
  base = backends.get(IMPL)
  seen = []

  def backward(q_h, q_t, k_h, k_s, *rest):
    seen.append(q_h.shape)
    assert q_t is None and k_s is None
    return base.backward(q_h, mx.requantize(q_h, 1), k_h, mx.requantize(k_h, 1), *rest)

  patch = dict(backward=backward, transposed_residuals=False)
  want, _ = _sharded_step(shardy, (1, 1), **patch)
  got, collectives = _sharded_step(shardy, **patch)
  assert collectives == dict.fromkeys(COLLECTIVES, 0), collectives
  assert set(seen) == {(8, 96, 8, 64), (2, 96, 4, 64)}, seen
  for name, a, b in zip(NAMES, got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_jit_sharded_dense_bias_on_the_recipe():
  # A dense bias [1, N, T, S] (broadcast over batch) rides along with the head split; only the
  # recipe serves it. Its gradient is summed over the sharded batch: that all-reduce is the
  # only collective, and it follows the backward kernel.
  B, S, N, K, H = 4, 64, 4, 2, 64
  q, k, v = make_qkv("normal", B, S, S, N, K, H, seed=5)
  do = make_do("normal", B, S, N, H, seed=6)
  bias = np.random.default_rng(7).standard_normal((1, N, S, S)).astype(np.float32)
  mesh = _mesh((2, 2), ("b", "h"))
  sh = NamedSharding(mesh, P("b", None, "h", None))
  bsh = NamedSharding(mesh, P(None, "h", None, None))

  def f(a, b, c, bb):
    return jax_fa4.dot_product_attention(a, b, c, bb, implementation="xla", return_residual=True)

  def grads(a, b, c, bb, g):
    (o, lse), vjp = jax.vjp(f, a, b, c, bb)
    return (o, lse) + vjp((g, jnp.zeros_like(lse)))
  args = [jnp.asarray(x) for x in (q, k, v, bias, do)]
  placed = [jax.device_put(x, s_) for x, s_ in zip(args, (sh, sh, sh, bsh, sh))]
  fwd = jax.jit(f).lower(*placed[:4]).compile()
  assert _count(fwd.as_text()) == dict.fromkeys(COLLECTIVES, 0), _count(fwd.as_text())
  compiled = jax.jit(grads).lower(*placed).compile()
  counts = _count(compiled.as_text())
  assert {op: n for op, n in counts.items() if op != "all-reduce"} == dict.fromkeys(
      (op for op in COLLECTIVES if op != "all-reduce"), 0), counts
  outs = compiled(*placed)
  ref = jax.jit(grads)(*args)
  truth = truth_and_bf16(q, k, v, do, scale=H ** -0.5, bias=bias)
  for i, name in enumerate(NAMES):
    assert_contract(name, outs[i], ref[i], truth["bf16"][i], truth["truth"][i])
  np.testing.assert_allclose(np.asarray(outs[5]), np.asarray(ref[5]), rtol=1e-5, atol=1e-6)


def test_head_split_that_does_not_divide_kv_heads_is_still_correct():
  # MQA (K=1) with the query heads split 4 ways: kv heads cannot follow, the partitioner
  # replicates the heads for the call (collectives allowed), and the numbers are unchanged.
  case = _case(2, 64, 4, 1, 64, False, False)
  mesh = _mesh((4,), ("h",))
  args = (jax.device_put(case["args"][0], NamedSharding(mesh, P(None, None, "h", None))),
          *case["args"][1:])
  f = lambda a, b, c: jax_fa4.dot_product_attention(a, b, c, implementation=IMPL,
                                                    return_residual=True)
  _check(case, jax.jit(lambda *a: _value_and_grads(f, a[:3], a[3]))(*args,
                                                                    jnp.asarray(case["do"])))


# ----------------------------------------------------------------------------------------------
# 2. shard_map wrapper over batch and heads.

def test_shard_map_attention_over_batch_and_heads():
  case = _case(*JIT_CASE)
  mesh = _mesh((4, 2), ("data", "model"))
  f = lambda a, b, c: shd.attention(a, b, c, mesh=mesh, batch_axis="data", head_axis="model",
                                    is_causal=True, implementation=IMPL, return_residual=True,
                                    **case["lens"])
  compiled = jax.jit(lambda a, b, c, do: _value_and_grads(f, (a, b, c), do)).lower(
      *case["args"], jnp.asarray(case["do"])).compile()
  outs = compiled(*case["args"], jnp.asarray(case["do"]))
  _check(case, outs)


# ----------------------------------------------------------------------------------------------
# 3. Context parallelism.

RING_S = 512  # one sequence length for every ring size: 2D chunks of >= 32 tokens up to D=8


def _ring_case(causal):
  # Shared by every ring test (the references are computed once): GQA 2:1, ragged lengths.
  return _case(2, RING_S, 4, 2, 64, causal, True)


def _run_ring(case, mesh, D, layout, causal, strategy, impl=IMPL, **axes):
  zz = (lambda x: shd.zigzag_reorder(x, D)) if layout == "zigzag" else (lambda x: x)
  uz = (lambda x: shd.zigzag_restore(x, D)) if layout == "zigzag" else (lambda x: x)

  def ring(a, b, c):
    o, lse = shd.ring_attention(zz(a), zz(b), zz(c), mesh=mesh, is_causal=causal, layout=layout,
                                strategy=strategy, implementation=impl, return_residual=True,
                                **axes, **case["lens"])
    return uz(o), uz(lse)
  return jax.jit(lambda a, b, c, do: _value_and_grads(ring, (a, b, c), do))(
      *case["args"], jnp.asarray(case["do"]))


@pytest.mark.parametrize("D,layout,causal,strategy", [
    (2, "zigzag", True, "ring"),
    (4, "zigzag", True, "ring"),
    (8, "zigzag", True, "ring"),
    (2, "contiguous", False, "ring"),
    (4, "contiguous", False, "ring"),
    (8, "zigzag", False, "ring"),
    (4, "contiguous", True, "ring"),   # causal without load balancing: still correct
    (4, "zigzag", True, "allgather"),
    (8, "contiguous", False, "allgather"),
])
def test_ring_attention_matches_the_unsharded_call(D, layout, causal, strategy):
  case = _ring_case(causal)
  mesh = _mesh((D,), ("sp",))
  _check(case, _run_ring(case, mesh, D, layout, causal, strategy, seq_axis="sp"))


def test_ring_with_batch_and_head_axes_and_gqa():
  case = _ring_case(True)
  mesh = _mesh((2, 2, 2), ("data", "model", "sp"))
  _check(case, _run_ring(case, mesh, 2, "zigzag", True, "ring", seq_axis="sp",
                         batch_axis="data", head_axis="model"))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_backward_asks_the_backend_for_fp32_block_gradients(layout, monkeypatch):
  # A backend may hand back gradients already in cfg.grad_dtypes (the CUDA one does: it rounds dK,
  # dV in the kernel). The ring adds its per-block gradients into fp32 accumulators and casts once
  # at the end, so the per-block configs must ask for float32: bf16 block gradients would be
  # rounded per block, and under contiguous causal they would not even trace (lax.cond against
  # the fp32 zeros of a block the queries cannot see). bf16 inputs; a backend that honours
  # grad_dtypes gives the ring the same bits as this machine's, which returns fp32 regardless.
  case = _ring_case(True)
  bf = dict(case, args=tuple(x.astype(jnp.bfloat16) for x in case["args"]))
  D = 4
  mesh = _mesh((D,), ("sp",))
  want = _run_ring(bf, mesh, D, layout, True, "ring", seq_axis="sp")
  base = backends.get(IMPL)
  seen = set()

  def backward(*args):
    cfg = args[-1]
    seen.add(tuple(cfg.grad_dtypes))
    dq, dk, dv, db = base.backward(*args)
    return (*(g.astype(dt) for g, dt in zip((dq, dk, dv), cfg.grad_dtypes)), db)
  monkeypatch.setitem(backends._BACKENDS, IMPL, dataclasses.replace(base, backward=backward))
  got = _run_ring(bf, mesh, D, layout, True, "ring", seq_axis="sp")  # ring calls the backend directly
  assert seen == {("float32",) * 3}, seen
  for name, a, b in zip(NAMES, got, want):
    assert a.dtype == b.dtype, name
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_ring_attention_local_inside_user_shard_map():
  case = _ring_case(True)
  D = 4
  mesh = _mesh((D,), ("sp",))
  spec = P(None, "sp", None, None)

  def body(a, b, c):
    return shd.ring_attention_local(a, b, c, axis_name="sp", is_causal=True,
                                    implementation=IMPL, return_residual=True, **case["lens"])
  sm = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3,
                     out_specs=(spec, P(None, "sp", None)), check_vma=False)

  def f(a, b, c):
    o, lse = sm(*(shd.zigzag_reorder(x, D) for x in (a, b, c)))
    return shd.zigzag_restore(o, D), shd.zigzag_restore(lse, D)
  _check(case, jax.jit(lambda a, b, c, do: _value_and_grads(f, (a, b, c), do))(
      *case["args"], jnp.asarray(case["do"])))


def test_zigzag_layout_helpers():
  perm = shd.zigzag_permutation(16, 2)  # chunks of 4: device 0 holds 0, 3; device 1 holds 1, 2
  np.testing.assert_array_equal(perm, [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])
  x = np.arange(2 * 16 * 3).reshape(2, 16, 3)
  np.testing.assert_array_equal(shd.zigzag_restore(shd.zigzag_reorder(x, 2), 2), x)
  xj = jnp.asarray(x)
  np.testing.assert_array_equal(np.asarray(shd.zigzag_reorder(xj, 2)), shd.zigzag_reorder(x, 2))
  assert shd.zigzag_chunk_order(3) == [0, 5, 1, 4, 2, 3]


# ----------------------------------------------------------------------------------------------
# 5. Bytes per ring step, read from the compiled HLO.

def _permute_bytes(hlo: str):
  sizes = {"u8": 1, "s8": 1, "f8e4m3fn": 1, "f8e8m0fnu": 1, "bf16": 2, "f16": 2, "f32": 4}
  out = []
  for dt, dims in re.findall(r"= (\w+)\[([\d,]*)\]\{[^}]*\} collective-permute(?:-start)?\(",
                             hlo):
    out.append((dt, sizes[dt] * int(np.prod([int(d) for d in dims.split(",") if d]))))
  return out


@pytest.mark.parametrize("dtype", [jnp.bfloat16])
def test_ring_step_moves_mx_bytes(dtype):
  B, S, N, K, H, D = 2, 256, 4, 2, 64, 2
  mesh = _mesh((D,), ("sp",))
  q = jnp.zeros((B, S, N, H), dtype)
  k = jnp.zeros((B, S, K, H), dtype)
  f = jax.jit(lambda a, b, c: shd.ring_attention(a, b, c, mesh=mesh, seq_axis="sp",
                                                 is_causal=True, implementation=IMPL))
  perms = _permute_bytes(f.lower(q, k, k).compile().as_text())
  # D=2: one ring step, four arrays (K data, K scales, V data, V scales), each uint8.
  assert len(perms) == 4 and {dt for dt, _ in perms} == {"u8"}, perms
  L = S // D
  step = sum(b for _, b in perms)
  assert step == shd.ring_step_bytes(B, L, K, H, "mx") == int(2 * B * L * K * H * (1 + 1 / 32))
  assert shd.ring_step_bytes(B, L, K, H, "bf16") == 2 * B * L * K * H * 2
  assert step / shd.ring_step_bytes(B, L, K, H, "bf16") == pytest.approx((1 + 1 / 32) / 2)


def test_ring_backward_moves_mx_kv_and_fp32_accumulators():
  B, S, N, K, H, D = 2, 256, 4, 2, 64, 2
  mesh = _mesh((D,), ("sp",))
  q = jnp.zeros((B, S, N, H), jnp.bfloat16)
  k = jnp.zeros((B, S, K, H), jnp.bfloat16)
  loss = lambda a, b, c: jnp.sum(shd.ring_attention(a, b, c, mesh=mesh, seq_axis="sp",
                                                    is_causal=True, implementation=IMPL)
                                 .astype(jnp.float32))
  hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, k).compile().as_text()
  perms = _permute_bytes(hlo)
  n = B * (S // D) * K * H
  u8 = sorted(b for dt, b in perms if dt == "u8")
  f32 = [b for dt, b in perms if dt == "f32"]
  # forward: K_h, V_s once; backward: K_h, K_s, V_h once (data + scales each; XLA may merge
  # the backward's K_h transfer with the forward's identical one); dK, dV accumulators twice
  # (one ring step, then home).
  assert sum(u8) in (4 * (n + n // 32), 5 * (n + n // 32)), perms
  assert f32 == [4 * n] * 4, perms


# ----------------------------------------------------------------------------------------------
# Bad meshes and axis names: a clear ValueError naming the argument and its value.

def _small(S=256):
  q = jnp.zeros((2, S, 4, 64), jnp.float32)
  k = jnp.zeros((2, S, 2, 64), jnp.float32)
  return q, k, k


@pytest.mark.parametrize("kw,pattern", [
    (dict(mesh="mesh", seq_axis="sp"), r"mesh='mesh' must be a jax.sharding.Mesh"),
    (dict(seq_axis="seq"), r"seq_axis='seq': 'seq' is not an axis of the mesh"),
    (dict(seq_axis=None), r"seq_axis=None: name the mesh axis"),
    (dict(seq_axis=3), r"seq_axis=3 must be a mesh axis name"),
    (dict(seq_axis="sp", batch_axis="sp"), r"batch_axis and seq_axis both use mesh axis 'sp'"),
    (dict(seq_axis="sp", head_axis="x"), r"head_axis='x': 'x' is not an axis of the mesh"),
    (dict(seq_axis="sp", head_axis="m"),
     r"head_axis='m' has 4 devices, which does not divide the number of kv heads K=2"),
    (dict(seq_axis="sp", batch_axis="m"), r"batch_axis='m' has 4 devices, which does not divide"),
    (dict(seq_axis="sp", layout="striped"), r"layout='striped' must be one of"),
    (dict(seq_axis="sp", strategy="tree"), r"strategy='tree' must be one of"),
    (dict(seq_axis="sp", scale=float("inf")), r"scale=inf must be a finite Python float"),
    (dict(seq_axis="m", S=192), r"seq_axis='m' splits the sequence of length 192 into 8 chunks"),
    (dict(seq_axis="m", S=96, layout="contiguous"),
     r"seq_axis='m' splits the sequence of length 96 into 4 chunks"),
])
def test_bad_mesh_or_axis_raises_naming_it(kw, pattern):
  mesh = _mesh((2, 4), ("sp", "m"))
  kw = dict(dict(mesh=mesh), **kw)
  S = kw.pop("S", 256)
  with pytest.raises(ValueError, match=pattern):
    shd.ring_attention(*_small(S), **kw)


def test_bad_shard_map_attention_arguments():
  mesh = _mesh((2, 4), ("b", "h"))
  with pytest.raises(ValueError, match=r"head_axis='hh': 'hh' is not an axis of the mesh"):
    shd.attention(*_small(), mesh=mesh, head_axis="hh")
  with pytest.raises(ValueError, match=r"head_axis='h' has 4 devices, which does not divide"):
    shd.attention(*_small(), mesh=mesh, head_axis="h")
  with pytest.raises(ValueError, match=r"mesh=None must be a jax.sharding.Mesh"):
    shd.attention(*_small(), mesh=None, batch_axis="b")
  with pytest.raises(ValueError, match=r"seq_len=100 must be a multiple of 2\*num_shards=8"):
    shd.zigzag_permutation(100, 4)
