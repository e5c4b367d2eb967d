"""Sharding rules for the attention kernels: batch- and head-sharded calls run shard-local.

Every backend call that ``jax_fa4.dot_product_attention`` makes (the forward, the float forward
of the GPU backend and the backward; the FFI kernels and the jnp recipe alike) goes through
:func:`forward_mx`, :func:`forward_float` and :func:`backward` here. Each wraps the backend
function in ``jax.experimental.custom_partitioning`` so that, under ``jax.jit`` with sharded
inputs, the partitioner runs the UNCHANGED backend function on each device's shard instead of
gathering the operands:

- the batch axis B may be sharded over any mesh axes (that divide B);
- the head axes may be sharded over mesh axes whose size divides the number of kv heads K:
  the kv heads are split K/M per device and the query heads follow their kv head (query head
  n belongs to kv head n // (N/K), so a contiguous split of N by M is the split of K by M).
  With GQA the head split therefore never separates a query head from its kv head, and the
  per-group sums of dK/dV stay local.
- T, S and H are replicated (masks are positional and MX blocks run along T, S and H); a
  sequence-sharded operand is gathered. For sequence parallelism use
  ``jax_fa4.sharding.ring_attention``.

A head sharding whose size does not divide K (e.g. MQA, K=1, with sharded query heads) is not
served shard-local: the heads are replicated for the call (the partitioner inserts the
gathers). The same rules are given twice: as a Shardy sharding rule (jax's default
partitioner) and as the GSPMD callbacks ``infer_sharding_from_operands``/``partition``.

The wrappers are also ``jax.custom_batching.custom_vmap`` functions: a ``vmap`` over them
folds the mapped axis into the batch axis (the kernels see one larger batch).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_fa4 import backends, mx


# ----------------------------------------------------------------------------------------------
# The static description of one call: what the partitioner callbacks and the rule depend on.

@dataclasses.dataclass(frozen=True)
class _Static:
  kind: str  # "fwd_mx", "fwd_float" or "bwd"
  backend: str
  cfg: Any  # jax_fa4.attention.AttentionConfig (hashable)
  B: int
  N: int
  K: int
  bias_shape: Optional[Tuple[int, ...]]
  mask_shape: Optional[Tuple[int, ...]]
  raw_do: bool = False  # "bwd": dO goes in as one float BTNH array (do_t None), not two MXArrays
  transposed: bool = True  # "bwd": q_t and k_s are MXArrays (False: both None)


def _axes_tuple(entry) -> Tuple[str, ...]:
  if entry is None:
    return ()
  if isinstance(entry, (tuple, list)):
    return tuple(entry)
  return (entry,)


def _axes_size(mesh, axes) -> int:
  return math.prod(mesh.shape[a] for a in axes) if axes else 1


def _spec_entry(sharding, dim: int, ndim: int):
  if not isinstance(sharding, NamedSharding):
    return ()
  spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
  return _axes_tuple(spec[dim])


def _plan(st: _Static, mesh, q_sharding, k_sharding):
  """(batch axes, head axes): the mesh axes the call is split over (each a tuple, maybe ())."""
  b = _spec_entry(q_sharding, 0, 4) or _spec_entry(k_sharding, 0, 4)
  if st.B % _axes_size(mesh, b):
    b = ()
  h = _spec_entry(q_sharding, 2, 4) or _spec_entry(k_sharding, 2, 4)
  if set(h) & set(b) or st.K % _axes_size(mesh, h):
    h = ()
  return b or None, h or None


def _bnts_spec(shape, b, h):
  if shape is None:
    return None
  return P(b if shape[0] != 1 else None, h if shape[1] != 1 else None, None, None)


def _specs(st: _Static, b, h):
  """(operand specs, result specs) as pytrees matching the wrapped function's arguments."""
  btnh = P(b, None, h, None)
  btn = P(b, None, h)
  lens = P(b)
  mxs = lambda: mx.MXArray(btnh, btnh, 3)  # the axis is irrelevant to the spec pytree
  bias = _bnts_spec(st.bias_shape, b, h)
  mask = _bnts_spec(st.mask_shape, b, h)
  if st.kind == "fwd_mx":
    return (mxs(), mxs(), mxs(), bias, mask, lens, lens), (btnh, btn)
  if st.kind == "fwd_float":
    return (btnh, btnh, btnh, lens, lens), (btnh, btn)
  dbias = None if st.bias_shape is None or st.backend != "xla" else P(b, h, None, None)
  do = (btnh, None) if st.raw_do else (mxs(), mxs())
  t = mxs() if st.transposed else None
  return ((mxs(), t, mxs(), t, mxs()) + do + (btn, btn, bias, mask, lens, lens),
          (btnh, btnh, btnh, dbias))


def _to_shardings(mesh, tree):
  return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), tree,
                                is_leaf=lambda x: isinstance(x, P))


def _mx_like(spec_tree, args):
  """The spec tree with MXArray placeholders re-shaped like the real arguments' pytrees."""
  out = []
  for s, a in zip(spec_tree, args):
    if isinstance(a, mx.MXArray):
      out.append(mx.MXArray(s.data, s.scale, a.axis))
    else:
      out.append(s)
  return tuple(out)


# ----------------------------------------------------------------------------------------------
# The Shardy rule: an einsum-like string, built from the static shapes.

def _bnts_factors(shape, n, tag):
  """Factors of a dense bias/mask [B|1, N|1, T|1, S|1]; a size-1 dim gets its own factor."""
  if shape is None:
    return None
  names = ("b", n, "t", "s")
  return " ".join(f"{tag}{i}" if shape[i] == 1 else names[i] for i in range(4))


def _rule(st: _Static):
  G = st.N // st.K
  # The query-head dim: kv head k major, query head within its group g minor. Shardy rejects
  # size-1 factors inside a compound dim, so MQA (K=1) and MHA (G=1) use a single factor.
  n = "(k g)" if G > 1 and st.K > 1 else ("k" if G == 1 else "g")
  btnh, btnq, bttn = f"b t {n} h", f"b t {n} hq", f"b tq {n} h"
  bskh, bskq, bssk = "b s k h", "b s k hq", "b sq k h"
  btn = f"b t {n}"
  bias = _bnts_factors(st.bias_shape, n, "xb")
  mask = _bnts_factors(st.mask_shape, n, "xm")
  extra = [x for x in (bias, mask) if x is not None]
  if st.kind == "fwd_mx":
    ops = [btnh, btnq, bskh, bskq, bskh, "b sv k h", *extra, "b", "b"]
    res = [btnh, btn]
  elif st.kind == "fwd_float":
    ops = [btnh, bskh, bskh, "b", "b"]
    res = [btnh, btn]
  else:
    # q_h, q_t, k_h, k_s, v_h, do_h, do_t (data, scale each; a raw dO is one array and no
    # do_t; without transposed residuals no q_t and k_s), lse, delta, bias, mask, lengths.
    do = [btnh] if st.raw_do else [btnh, btnq, btnh, bttn]
    q_t, k_s = ([btnh, bttn], [bskh, bssk]) if st.transposed else ([], [])
    ops = [btnh, btnq, *q_t, bskh, bskq, *k_s, bskh, bskq, *do,
           btn, btn, *extra, "b", "b"]
    res = [btnh, bskh, bskh]
    if st.bias_shape is not None and st.backend == "xla":
      res.append(f"b {n} t s")
  rule = ", ".join(ops) + " -> " + ", ".join(res)
  # Factors in order of first appearance: Shardy wants the special factors' indices sorted.
  factors = list(dict.fromkeys(rule.replace("(", " ").replace(")", " ").replace(",", " ")
                               .replace("->", " ").split()))
  replicated = tuple(f for f in factors if f not in ("b", "k"))
  sizes = dict(g=G) if G > 1 and st.K > 1 else {}
  return rule, dict(need_replication_factors=replicated, **sizes)


# ----------------------------------------------------------------------------------------------
# The wrapped ops.

def _local_fn(st: _Static):
  impl = backends.get(st.backend)
  if st.kind == "fwd_mx":
    return lambda *a: tuple(impl.forward_mx(*a, st.cfg))
  if st.kind == "fwd_float":
    return lambda *a: tuple(impl.forward_float(*a, st.cfg))
  return lambda *a: tuple(impl.backward(*a, st.cfg))


@functools.lru_cache(maxsize=None)
def _op(st: _Static):
  local = _local_fn(st)
  cp = custom_partitioning(local)

  def plan_from(mesh, arg_shapes):
    first = arg_shapes[0]
    q_sh = (first.data if isinstance(first, mx.MXArray) else first).sharding
    kk = arg_shapes[2] if st.kind == "fwd_mx" else (arg_shapes[1] if st.kind == "fwd_float"
                                                   else arg_shapes[2])
    k_sh = (kk.data if isinstance(kk, mx.MXArray) else kk).sharding
    return _plan(st, mesh, q_sh, k_sh)

  def infer(mesh, arg_shapes, result_shape):
    b, h = plan_from(mesh, arg_shapes)
    _, res = _specs(st, b, h)
    return _to_shardings(mesh, res)

  def partition(mesh, arg_shapes, result_shape):
    b, h = plan_from(mesh, arg_shapes)
    ops, res = _specs(st, b, h)
    ops = _mx_like(ops, arg_shapes)
    return mesh, local, _to_shardings(mesh, res), _to_shardings(mesh, ops)

  rule, kw = _rule(st)
  cp.def_partition(partition=partition, infer_sharding_from_operands=infer,
                   sharding_rule=rule, **kw)

  @jax.custom_batching.custom_vmap
  def op(*args):
    return cp(*args)

  @op.def_vmap
  def _vmap_rule(axis_size, in_batched, *args):
    # Fold the mapped axis into the batch axis: [V, B, ...] -> [V*B, ...].
    def fold(x, batched):
      if x is None:
        return None
      if not batched:
        x = jnp.broadcast_to(x, (axis_size,) + x.shape)
      if x.shape[1] == 1 and st.B != 1:  # a broadcast batch dim of a bias/mask
        x = jnp.broadcast_to(x, (x.shape[0], st.B) + x.shape[2:])
      return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])

    flat, tree = jax.tree_util.tree_flatten(args)
    flat_b = jax.tree_util.tree_leaves(in_batched)
    folded = jax.tree_util.tree_unflatten(tree, [fold(x, b) for x, b in zip(flat, flat_b)])
    out = call(st_batched(st, axis_size), *folded)
    out = jax.tree_util.tree_map(lambda y: y.reshape((axis_size, -1) + y.shape[1:]), out)
    return out, jax.tree_util.tree_map(lambda _: True, out)

  return op


def st_batched(st: _Static, v: int) -> _Static:
  def bshape(s):
    return None if s is None else (st.B * v,) + tuple(s[1:])
  return dataclasses.replace(st, B=st.B * v, bias_shape=bshape(st.bias_shape),
                             mask_shape=bshape(st.mask_shape))


def call(st: _Static, *args):
  out = _op(st)(*args)
  if st.kind == "bwd" and len(out) == 3:
    out = tuple(out) + (None,)
  return tuple(out)


def _shape(x):
  return None if x is None else tuple(x.shape)


def _static(kind, backend, cfg, q, k, bias=None, mask=None) -> _Static:
  B, _, N, _ = q.shape
  return _Static(kind, backend, cfg, B, N, k.shape[2], _shape(bias), _shape(mask))


def _backend_name(impl) -> str:
  return impl if isinstance(impl, str) else impl.name


# ----------------------------------------------------------------------------------------------
# Public entry points: the backend signatures, plus the backend (name or Backend) in front.

def forward_mx(impl, q_h, k_h, v_s, bias, mask, q_len, kv_len, cfg):
  """``backends.get(impl).forward_mx(...)``, shard-local under batch/head sharding."""
  st = _static("fwd_mx", _backend_name(impl), cfg, q_h, k_h, bias, mask)
  o, lse = call(st, q_h, k_h, v_s, bias, mask, q_len, kv_len)
  return o, lse


def forward_float(impl, q, k, v, q_len, kv_len, cfg):
  """``backends.get(impl).forward_float(...)``, shard-local under batch/head sharding."""
  st = _static("fwd_float", _backend_name(impl), cfg, q, k)
  o, lse = call(st, q, k, v, q_len, kv_len)
  return o, lse


def backward(impl, q_h, q_t, k_h, k_s, v_h, do_h, do_t, lse, delta, bias, mask, q_len, kv_len,
             cfg):
  """``backends.get(impl).backward(...)``, shard-local under batch/head sharding."""
  st = _static("bwd", _backend_name(impl), cfg, q_h, k_h, bias, mask)
  st = dataclasses.replace(st, raw_do=not isinstance(do_h, mx.MXArray),
                           transposed=q_t is not None)
  return call(st, q_h, q_t, k_h, k_s, v_h, do_h, do_t, lse, delta, bias, mask, q_len, kv_len)


__all__ = ["forward_mx", "forward_float", "backward"]
