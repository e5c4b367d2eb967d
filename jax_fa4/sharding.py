"""Multi-device MXFP8 attention: shard_map wrappers and context-parallel (ring) attention.

Three ways to run ``jax_fa4`` attention on several devices (docs/SHARDING.md has the details):

1. ``jax.jit`` on sharded inputs: ``jax_fa4.dot_product_attention`` itself runs shard-local
   when q, k, v are sharded over batch and/or heads (jax_fa4.partitioning); nothing to call here.
2. :func:`attention`: the same, written as an explicit ``jax.shard_map`` over batch/head axes.
3. :func:`ring_attention`: context parallelism. Q, K and V are sharded along the SEQUENCE over
   one mesh axis of size D. K and V travel between neighbours in MX form (e4m3 data and e8m0
   scales, each ``ppermute``-d as its own uint8 array), every device merges the partial
   results of its query block against each K/V block with their log-sum-exps, and the
   backward pass runs a second ring that carries K, V and the fp32 dK/dV accumulators, using
   the GLOBAL lse and delta = rowsum(o * dO) in each block's backward kernel.
   ``strategy="allgather"`` instead gathers the MX K/V once (for short rings).

Causal attention is load-balanced with the zig-zag layout: the sequence is cut into 2D chunks
of C = S / (2D) tokens and device i holds chunks i and 2D-1-i. Reorder inputs with
:func:`zigzag_reorder` before sharding and undo it on the outputs with :func:`zigzag_restore`.
Every (query chunk, key chunk) pair is then fully visible, diagonal-causal or empty, so the
unchanged kernels (no position offsets) serve every block, and each ring step does the same
amount of work on every device.

MX blocks along the sequence (V blocked along S, dO and Q along T, K along S) must line up
with the unsharded call's: chunk lengths are multiples of 32. Then every MX tensor a device
makes from its shard is bit-identical to the corresponding slice of the unsharded call's.

Lengths: ``query_seq_lengths``/``key_value_seq_lengths`` are GLOBAL per-batch lengths in the
natural (un-reordered) order; each device derives the lengths of its chunks (valid tokens of a
device's chunks always form a prefix of its local block, also in the zig-zag layout).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from jax_fa4 import backends, mx
from jax_fa4.attention import AttentionConfig, dot_product_attention, resolve_scale

AxisNames = Union[None, str, Tuple[str, ...]]
LAYOUTS = ("zigzag", "contiguous")
STRATEGIES = ("ring", "allgather")


# ----------------------------------------------------------------------------------------------
# shard_map across jax versions.

def _explicit_axes(mesh) -> bool:
  types = getattr(mesh, "axis_types", None) or ()
  explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
  return explicit is not None and any(t == explicit for t in types)


def _shard_map(f, mesh, in_specs, out_specs):
  """jax.shard_map (jax.experimental.shard_map on older jax), resharding the inputs to
  ``in_specs`` first on a mesh with Explicit axes (where shard_map does not reshard)."""
  sm = getattr(jax, "shard_map", None)
  if sm is not None:
    g = sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
  else:  # pragma: no cover - old jax
    from jax.experimental.shard_map import shard_map as old_sm
    g = old_sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)
  if not _explicit_axes(mesh):
    return g

  def resharded(*args):
    args = [jax.sharding.reshard(a, jax.sharding.NamedSharding(mesh, s))
            for a, s in zip(args, in_specs)]
    return g(*args)
  return resharded


# ----------------------------------------------------------------------------------------------
# Validation: a clear ValueError naming the argument and its value.

def _check_mesh(mesh):
  if not isinstance(mesh, Mesh):
    raise ValueError(f"mesh={mesh!r} must be a jax.sharding.Mesh")
  return mesh


def _axes(mesh: Mesh, value, name: str, required: bool = False) -> Tuple[str, ...]:
  if value is None:
    if required:
      raise ValueError(f"{name}=None: name the mesh axis to shard over (mesh axes "
                       f"{tuple(mesh.axis_names)})")
    return ()
  axes = (value,) if isinstance(value, str) else value
  if not isinstance(axes, (tuple, list)) or not axes or not all(isinstance(a, str) for a in axes):
    raise ValueError(f"{name}={value!r} must be a mesh axis name or a tuple of them")
  for a in axes:
    if a not in mesh.axis_names:
      raise ValueError(f"{name}={value!r}: {a!r} is not an axis of the mesh (mesh axes "
                       f"{tuple(mesh.axis_names)})")
  if len(set(axes)) != len(axes):
    raise ValueError(f"{name}={value!r} names an axis twice")
  return tuple(axes)


def _size(mesh: Mesh, axes) -> int:
  return math.prod(mesh.shape[a] for a in axes) if axes else 1


def _entry(axes):
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else tuple(axes)


def _check_disjoint(**named):
  seen = {}
  for name, axes in named.items():
    for a in axes:
      if a in seen:
        raise ValueError(f"{name} and {seen[a]} both use mesh axis {a!r}; each mesh axis can "
                         f"shard one dimension only")
      seen[a] = name


def _check_shapes(query, key, value):
  for x, name in ((query, "query"), (key, "key"), (value, "value")):
    if not hasattr(x, "shape") or len(x.shape) != 4:
      raise ValueError(f"{name}.shape={getattr(x, 'shape', None)} must be 4D "
                       f"[batch, seq, heads, head_dim]")
  B, T, N, H = query.shape
  if tuple(key.shape) != tuple(value.shape):
    raise ValueError(f"key.shape={tuple(key.shape)} and value.shape={tuple(value.shape)} "
                     f"must be equal")
  _, S, K, _ = key.shape
  if key.shape[0] != B or key.shape[3] != H:
    raise ValueError(f"key.shape={tuple(key.shape)} must match query.shape={tuple(query.shape)} "
                     f"in batch and head_dim")
  if K == 0 or N % K:
    raise ValueError(f"the number of query heads N={N} must be a multiple of the number of "
                     f"key/value heads K={K}")
  return B, T, N, K, H, S


def _check_divides(mesh, axes, name, dim_name, dim):
  n = _size(mesh, axes)
  if dim % n:
    raise ValueError(f"{name}={_entry(axes)!r} has {n} devices, which does not divide "
                     f"{dim_name}={dim}")


# ----------------------------------------------------------------------------------------------
# 2. shard_map over batch and heads.

def attention(query, key, value, *, mesh, batch_axis: AxisNames = None,
              head_axis: AxisNames = None, query_seq_lengths=None, key_value_seq_lengths=None,
              return_residual: bool = False, **kwargs):
  """``jax_fa4.dot_product_attention`` inside ``jax.shard_map``, split over batch and heads.

  ``query [B, T, N, H]`` and ``key``/``value [B, S, K, H]`` are split over ``batch_axis``
  (dividing B) and ``head_axis`` (dividing K; the query heads follow their kv head). No
  collective runs. ``kwargs`` are ``dot_product_attention``'s (scale, is_causal,
  local_window_size, implementation); a dense bias/mask is not taken here (use the jit path).
  """
  _check_mesh(mesh)
  b = _axes(mesh, batch_axis, "batch_axis")
  h = _axes(mesh, head_axis, "head_axis")
  _check_disjoint(batch_axis=b, head_axis=h)
  B, T, N, K, H, S = _check_shapes(query, key, value)
  _check_divides(mesh, b, "batch_axis", "batch", B)
  _check_divides(mesh, h, "head_axis", "the number of kv heads K", K)
  for bad in ("bias", "mask"):
    if bad in kwargs:
      raise ValueError(f"{bad} is not taken by jax_fa4.sharding.attention; call "
                       f"jax_fa4.dot_product_attention under jax.jit on sharded inputs")
  qspec = P(_entry(b), None, _entry(h), None)
  lspec = P(_entry(b))
  lens = [x for x in (query_seq_lengths, key_value_seq_lengths)]
  has = tuple(x is not None for x in lens)

  def local(q, k, v, *ls):
    it = iter(ls)
    ql = next(it) if has[0] else None
    kl = next(it) if has[1] else None
    return dot_product_attention(q, k, v, query_seq_lengths=ql, key_value_seq_lengths=kl,
                                 return_residual=True, **kwargs)

  args = [query, key, value] + [x for x in lens if x is not None]
  specs = (qspec, qspec, qspec) + (lspec,) * sum(has)
  o, lse = _shard_map(local, mesh, specs, (qspec, P(_entry(b), None, _entry(h))))(*args)
  return (o, lse) if return_residual else o


# ----------------------------------------------------------------------------------------------
# Zig-zag layout helpers.

def zigzag_permutation(seq_len: int, num_shards: int) -> np.ndarray:
  """Token order of the zig-zag layout: position p of the reordered sequence holds token perm[p].

  The sequence is cut into 2*num_shards chunks; shard i (the i-th contiguous 1/num_shards of
  the reordered sequence) holds chunks i and 2*num_shards-1-i.
  """
  if num_shards < 1 or seq_len % (2 * num_shards):
    raise ValueError(f"seq_len={seq_len} must be a multiple of 2*num_shards={2 * num_shards}")
  C = seq_len // (2 * num_shards)
  chunks = []
  for i in range(num_shards):
    chunks += [i, 2 * num_shards - 1 - i]
  return np.concatenate([np.arange(c * C, (c + 1) * C) for c in chunks])


def zigzag_reorder(x, num_shards: int, axis: int = 1):
  """x in natural order along ``axis`` -> zig-zag order (shard i: chunks i and 2D-1-i)."""
  perm = zigzag_permutation(x.shape[axis], num_shards)
  if isinstance(x, np.ndarray):
    return np.take(x, perm, axis=axis)
  return jnp.take(x, jnp.asarray(perm), axis=axis)


def zigzag_restore(x, num_shards: int, axis: int = 1):
  """Inverse of :func:`zigzag_reorder`: zig-zag order along ``axis`` -> natural order."""
  inv = np.argsort(zigzag_permutation(x.shape[axis], num_shards))
  if isinstance(x, np.ndarray):
    return np.take(x, inv, axis=axis)
  return jnp.take(x, jnp.asarray(inv), axis=axis)


# ----------------------------------------------------------------------------------------------
# 3. Context parallelism: the per-device computation (runs inside shard_map).

@dataclasses.dataclass(frozen=True)
class RingConfig:
  axis_name: AxisNames  # the sequence mesh axis (or axes) the ring runs over
  num_shards: int  # D
  layout: str  # "zigzag" or "contiguous"
  strategy: str  # "ring" or "allgather"
  is_causal: bool
  scale: float
  implementation: str  # resolved backend name
  out_dtype: str
  grad_dtypes: Tuple[str, str, str]

  def block_cfg(self, causal: bool) -> AttentionConfig:
    # The per-block gradients stay fp32 (the ring's accumulators are; the sum is cast once at the
    # end to grad_dtypes): a backend that rounds to the gradients' dtype (the CUDA backward rounds
    # dK, dV in its kernel) must not round each block, and its bf16 blocks would not match the fp32
    # zeros of a block the queries cannot see in lax.cond.
    return AttentionConfig(scale=self.scale, is_causal=causal, window=None,
                           implementation=self.implementation, out_dtype=self.out_dtype,
                           grad_dtypes=("float32", "float32", "float32"))


def _as_bytes(x):
  return jax.lax.bitcast_convert_type(x, jnp.uint8)


def _ppermute_mx(x: mx.MXArray, axis_name, perm) -> mx.MXArray:
  """One MX tensor to the next device: data and scales as two separate uint8 collectives."""
  data = jax.lax.ppermute(_as_bytes(x.data), axis_name, perm)
  scale = jax.lax.ppermute(_as_bytes(x.scale), axis_name, perm)
  return mx.MXArray(jax.lax.bitcast_convert_type(data, mx.E4M3),
                    jax.lax.bitcast_convert_type(scale, mx.E8M0), x.axis)


def _all_gather_mx(x: mx.MXArray, axis_name) -> mx.MXArray:
  data = jax.lax.all_gather(_as_bytes(x.data), axis_name, axis=1, tiled=True)
  scale = jax.lax.all_gather(_as_bytes(x.scale), axis_name, axis=1, tiled=True)
  return mx.MXArray(jax.lax.bitcast_convert_type(data, mx.E4M3),
                    jax.lax.bitcast_convert_type(scale, mx.E8M0), x.axis)


def _slice_seq(x, start: int, size: int):
  """Tokens [start, start+size) of axis 1 of an array or an MXArray (MX along seq: /32)."""
  if x is None:
    return None
  if isinstance(x, mx.MXArray):
    if x.axis == 1:
      return mx.MXArray(x.data[:, start:start + size],
                        x.scale[:, start // mx.BLOCK:(start + size) // mx.BLOCK], 1)
    return mx.MXArray(x.data[:, start:start + size], x.scale[:, start:start + size], x.axis)
  return x[:, start:start + size]


def _dyn_slice_seq(x, start, size: int):
  """Like _slice_seq with a traced start (a multiple of 32)."""
  def ds(a, st, n):
    return jax.lax.dynamic_slice_in_dim(a, st, n, axis=1)
  if isinstance(x, mx.MXArray):
    if x.axis == 1:
      return mx.MXArray(ds(x.data, start, size), ds(x.scale, start // mx.BLOCK, size // mx.BLOCK),
                        1)
    return mx.MXArray(ds(x.data, start, size), ds(x.scale, start, size), x.axis)
  return ds(x, start, size)


def _permute_chunks(x, order: Sequence[int], n_chunks: int):
  """Reorders the n_chunks equal chunks of axis 1 (array or MXArray): chunk p <- order[p]."""
  def perm(a):
    L = a.shape[1]
    c = L // n_chunks
    return jnp.concatenate([a[:, o * c:(o + 1) * c] for o in order], axis=1)
  if isinstance(x, mx.MXArray):
    return mx.MXArray(perm(x.data), perm(x.scale), x.axis)
  return perm(x)


def _chunk_len(lengths, chunk, C: int):
  """Valid tokens of chunk ``chunk`` (tokens [chunk*C, chunk*C+C)) for global lengths [B]."""
  return jnp.clip(lengths - chunk * C, 0, C).astype(jnp.int32)


def _merge(o1, l1, o2, l2):
  """Combines two partial softmax results (o normalized per part, lse natural log)."""
  m = jnp.maximum(l1, l2)
  m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
  w1 = jnp.exp(l1 - m_safe)
  w2 = jnp.exp(l2 - m_safe)
  tot = w1 + w2
  lse = jnp.where(tot > 0, m_safe + jnp.log(jnp.where(tot > 0, tot, 1.0)), -jnp.inf)
  inv = jnp.where(tot > 0, 1.0 / jnp.where(tot > 0, tot, 1.0), 0.0)
  o = (o1 * w1[..., None] + o2 * w2[..., None]) * inv[..., None]
  return o, lse


def _pad_rows(o, lse, before: int, after: int):
  """Zero output / -inf lse rows around a partial result (rows no key in the block sees)."""
  o = jnp.pad(o, ((0, 0), (before, after), (0, 0), (0, 0)))
  lse = jnp.pad(lse, ((0, 0), (before, after), (0, 0)), constant_values=-jnp.inf)
  return o, lse


def _pad_seq(x, before: int, after: int):
  return jnp.pad(x, ((0, 0), (before, after), (0, 0), (0, 0)))


class _Geometry:
  """Which global chunks a device holds, and the lengths of its blocks."""

  def __init__(self, rc: RingConfig, L: int):
    self.D = rc.num_shards
    self.zig = rc.layout == "zigzag"
    self.L = L
    self.C = L // 2 if self.zig else L  # chunk length

  def chunks(self, dev):
    """Global chunk indices held by device ``dev`` (traced ok)."""
    if self.zig:
      return dev, 2 * self.D - 1 - dev
    return (dev,)

  def block_len(self, lengths, dev):
    """Valid tokens of device dev's whole local block (a prefix of it)."""
    return sum(_chunk_len(lengths, c, self.C) for c in self.chunks(dev))


def _ring_perm(D):
  return [(i, (i + 1) % D) for i in range(D)]


def _step_fwd(rc: RingConfig, g: _Geometry, impl, q_h, kv, q_len_g, kv_len_g, d, j, first):
  """The partial (o, lse) of this device's queries against K/V block j (j = d on step 0)."""
  k_h, v_s = kv
  full, causal = rc.block_cfg(False), rc.block_cfg(True)
  ql = g.block_len(q_len_g, d)
  if first and rc.is_causal:
    return impl.forward_mx(q_h, k_h, v_s, None, None, ql, g.block_len(kv_len_g, j), causal)
  if not rc.is_causal:
    return impl.forward_mx(q_h, k_h, v_s, None, None, ql, g.block_len(kv_len_g, j), full)
  C = g.C
  if g.zig:
    def earlier():  # j < d: all local queries see kv chunk j fully; chunk 2D-1-j not at all
      return impl.forward_mx(q_h, _slice_seq(k_h, 0, C), _slice_seq(v_s, 0, C), None, None, ql,
                             _chunk_len(kv_len_g, j, C), full)

    def later():  # j > d: only query chunk 2D-1-d sees kv block j, fully
      qb = _slice_seq(q_h, C, C)
      o, lse = impl.forward_mx(qb, k_h, v_s, None, None,
                               _chunk_len(q_len_g, 2 * g.D - 1 - d, C),
                               g.block_len(kv_len_g, j), full)
      return _pad_rows(o, lse, C, 0)
  else:
    def earlier():
      return impl.forward_mx(q_h, k_h, v_s, None, None, ql, g.block_len(kv_len_g, j), full)

    def later():  # contiguous causal: a later block is invisible
      B, L, N, H = q_h.shape
      return jnp.zeros((B, L, N, H), jnp.float32), jnp.full((B, L, N), -jnp.inf, jnp.float32)
  return jax.lax.cond(j < d, earlier, later)


def _step_bwd(rc: RingConfig, g: _Geometry, impl, qs, kv, lse, delta, q_len_g, kv_len_g, d, j,
              first):
  """(dq, dk, dv) of this device's queries against K/V block j (local shapes, fp32)."""
  q_h, q_t, do_h, do_t = qs
  k_h, k_s, v_h = kv
  full, causal = rc.block_cfg(False), rc.block_cfg(True)
  ql = g.block_len(q_len_g, d)

  def bwd(cfg, qh, qt, dh, dt, ls, dl, kh, ks, vh, qlen, kvlen):
    dq, dk, dv, _ = impl.backward(qh, qt, kh, ks, vh, dh, dt, ls, dl, None, None, qlen, kvlen, cfg)
    return dq, dk, dv

  allq = (q_h, q_t, do_h, do_t, lse, delta)
  if (first and rc.is_causal) or not rc.is_causal:
    cfg = causal if rc.is_causal else full
    return bwd(cfg, *allq, k_h, k_s, v_h, ql, g.block_len(kv_len_g, j))
  C = g.C
  if g.zig:
    def earlier():
      dq, dk, dv = bwd(full, *allq, _slice_seq(k_h, 0, C), _slice_seq(k_s, 0, C),
                       _slice_seq(v_h, 0, C), ql, _chunk_len(kv_len_g, j, C))
      return dq, _pad_seq(dk, 0, C), _pad_seq(dv, 0, C)

    def later():
      sl = [_slice_seq(x, C, C) for x in (q_h, q_t, do_h, do_t)]
      dq, dk, dv = bwd(full, *sl, lse[:, C:], delta[:, C:], k_h, k_s, v_h,
                       _chunk_len(q_len_g, 2 * g.D - 1 - d, C), g.block_len(kv_len_g, j))
      return _pad_seq(dq, C, 0), dk, dv
  else:
    def earlier():
      return bwd(full, *allq, k_h, k_s, v_h, ql, g.block_len(kv_len_g, j))

    def later():
      B, L, N, H = q_h.shape
      K = k_h.shape[2]
      z = jnp.zeros((B, L, K, H), jnp.float32)
      return jnp.zeros((B, L, N, H), jnp.float32), z, z
  return jax.lax.cond(j < d, earlier, later)


def _natural_kv(rc: RingConfig, x):
  """A gathered [B, S, ...] tensor in device order -> natural token order."""
  if rc.layout != "zigzag":
    return x
  D = rc.num_shards
  order = np.argsort(zigzag_chunk_order(D))
  return _permute_chunks(x, order, 2 * D)


def _device_kv(rc: RingConfig, x):
  """Natural token order -> device order (the inverse of _natural_kv)."""
  if rc.layout != "zigzag":
    return x
  return _permute_chunks(x, zigzag_chunk_order(rc.num_shards), 2 * rc.num_shards)


def zigzag_chunk_order(num_shards: int):
  """Chunk indices in zig-zag device order: [0, 2D-1, 1, 2D-2, ...]."""
  out = []
  for i in range(num_shards):
    out += [i, 2 * num_shards - 1 - i]
  return out


def _q_chunks(g: _Geometry, d):
  """[(local start, global chunk index)] of this device's query chunks."""
  if g.zig:
    return [(0, d), (g.C, 2 * g.D - 1 - d)]
  return [(0, d)]


def _allgather_fwd(rc, g, impl, q_h, k_h, v_s, q_len_g, kv_len_g, d):
  kg = _natural_kv(rc, _all_gather_mx(k_h, rc.axis_name))
  vg = _natural_kv(rc, _all_gather_mx(v_s, rc.axis_name))
  full, causal = rc.block_cfg(False), rc.block_cfg(True)
  if not rc.is_causal:
    return impl.forward_mx(q_h, kg, vg, None, None, g.block_len(q_len_g, d), kv_len_g, full)
  C = g.C
  os_, ls_ = [], []
  for start, c in _q_chunks(g, d):
    qc = _slice_seq(q_h, start, C)
    qlen = _chunk_len(q_len_g, c, C)
    # Keys before the chunk: a prefix of the gathered sequence, selected by the length.
    o1, l1 = impl.forward_mx(qc, kg, vg, None, None, qlen, jnp.minimum(kv_len_g, c * C), full)
    o2, l2 = impl.forward_mx(qc, _dyn_slice_seq(kg, c * C, C), _dyn_slice_seq(vg, c * C, C),
                             None, None, qlen, _chunk_len(kv_len_g, c, C), causal)
    o, lse = _merge(o1, l1, o2, l2)
    os_.append(o)
    ls_.append(lse)
  return jnp.concatenate(os_, axis=1), jnp.concatenate(ls_, axis=1)


def _allgather_bwd(rc, g, impl, qs, k_h, k_s, v_h, lse, delta, q_len_g, kv_len_g, d):
  q_h, q_t, do_h, do_t = qs
  kg_h = _natural_kv(rc, _all_gather_mx(k_h, rc.axis_name))
  kg_s = _natural_kv(rc, _all_gather_mx(k_s, rc.axis_name))
  vg_h = _natural_kv(rc, _all_gather_mx(v_h, rc.axis_name))
  full, causal = rc.block_cfg(False), rc.block_cfg(True)

  def bwd(cfg, qh, qt, dh, dt, ls, dl, kh, ks, vh, qlen, kvlen):
    dq, dk, dv, _ = impl.backward(qh, qt, kh, ks, vh, dh, dt, ls, dl, None, None, qlen, kvlen, cfg)
    return dq, dk, dv

  if not rc.is_causal:
    dq, dk, dv = bwd(full, q_h, q_t, do_h, do_t, lse, delta, kg_h, kg_s, vg_h,
                     g.block_len(q_len_g, d), kv_len_g)
  else:
    C = g.C
    dqs = []
    dk = dv = None
    for start, c in _q_chunks(g, d):
      sl = [_slice_seq(x, start, C) for x in (q_h, q_t, do_h, do_t)]
      ls, dl = lse[:, start:start + C], delta[:, start:start + C]
      qlen = _chunk_len(q_len_g, c, C)
      dq1, dk1, dv1 = bwd(full, *sl, ls, dl, kg_h, kg_s, vg_h, qlen,
                          jnp.minimum(kv_len_g, c * C))
      dq2, dk2, dv2 = bwd(causal, *sl, ls, dl, _dyn_slice_seq(kg_h, c * C, C),
                          _dyn_slice_seq(kg_s, c * C, C), _dyn_slice_seq(vg_h, c * C, C), qlen,
                          _chunk_len(kv_len_g, c, C))
      dk1 = jax.lax.dynamic_update_slice_in_dim(
          dk1, jax.lax.dynamic_slice_in_dim(dk1, c * C, C, 1) + dk2, c * C, 1)
      dv1 = jax.lax.dynamic_update_slice_in_dim(
          dv1, jax.lax.dynamic_slice_in_dim(dv1, c * C, C, 1) + dv2, c * C, 1)
      dqs.append(dq1 + dq2)
      dk = dk1 if dk is None else dk + dk1
      dv = dv1 if dv is None else dv + dv1
    dq = jnp.concatenate(dqs, axis=1)
  # Each device's dK/dV of the whole sequence: sum them and hand each its own block.
  dk = jax.lax.psum_scatter(_device_kv(rc, dk), rc.axis_name, scatter_dimension=1, tiled=True)
  dv = jax.lax.psum_scatter(_device_kv(rc, dv), rc.axis_name, scatter_dimension=1, tiled=True)
  return dq, dk, dv


def _fwd_core(rc: RingConfig, q, k, v, q_len_g, kv_len_g):
  impl = backends.get(rc.implementation)
  g = _Geometry(rc, q.shape[1])
  d = jax.lax.axis_index(rc.axis_name)
  q_h = mx.quantize(q, 3)
  k_h, v_s = mx.quantize(k, 3), mx.quantize(v, 1)
  if rc.strategy == "allgather":
    o, lse = _allgather_fwd(rc, g, impl, q_h, k_h, v_s, q_len_g, kv_len_g, d)
  else:
    D = rc.num_shards
    perm = _ring_perm(D)
    send = lambda kv: tuple(_ppermute_mx(x, rc.axis_name, perm) for x in kv)
    step = lambda kv, s, first: _step_fwd(rc, g, impl, q_h, kv, q_len_g, kv_len_g, d,
                                          (d - s) % D, first)
    kv = (k_h, v_s)
    # Each step sends the block it holds on to the next device BEFORE computing with it, so
    # the transfer overlaps the step's kernel; the last step sends nothing (D-1 transfers).
    kv_next = send(kv) if D > 1 else None
    o, lse = step(kv, 0, True)

    def body(s, carry):
      kv, o, lse = carry
      kv_next = send(kv)
      o_s, l_s = step(kv, s, False)
      o, lse = _merge(o, lse, o_s, l_s)
      return kv_next, o, lse

    if D > 2:
      kv_next, o, lse = jax.lax.fori_loop(1, D - 1, body, (kv_next, o, lse))
    if D > 1:
      o_s, l_s = step(kv_next, D - 1, False)
      o, lse = _merge(o, lse, o_s, l_s)
  return o, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_local(rc: RingConfig, q, k, v, q_len_g, kv_len_g):
  o, lse = _fwd_core(rc, q, k, v, q_len_g, kv_len_g)
  return jax.lax.optimization_barrier(o.astype(rc.out_dtype)), lse


def _ring_local_fwd(rc, q, k, v, q_len_g, kv_len_g):
  o, lse = _fwd_core(rc, q, k, v, q_len_g, kv_len_g)
  # As in jax_fa4.attention: keep O materialised in the caller's dtype, so that the backward's
  # delta = rowsum(O dO) sees the rounded O (XLA:GPU would fold the round trip away).
  o = jax.lax.optimization_barrier(o.astype(rc.out_dtype))
  res = dict(q_h=mx.quantize(q, 3), q_t=mx.quantize(q, 1), k_h=mx.quantize(k, 3),
             k_s=mx.quantize(k, 1), v_h=mx.quantize(v, 3), o=o, lse=lse, q_len=q_len_g,
             kv_len=kv_len_g)
  return (o, lse), res


def _ring_local_bwd(rc, res, cts):
  do, _ = cts  # like jax.nn, the lse carries no gradient
  impl = backends.get(rc.implementation)
  o, lse = res["o"], res["lse"]
  g = _Geometry(rc, o.shape[1])
  d = jax.lax.axis_index(rc.axis_name)
  do = jnp.asarray(do).astype(o.dtype)
  delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
  qs = (res["q_h"], res["q_t"], mx.quantize(do, 3), mx.quantize(do, 1))
  kv = (res["k_h"], res["k_s"], res["v_h"])
  ql, kl = res["q_len"], res["kv_len"]
  if rc.strategy == "allgather":
    dq, dk, dv = _allgather_bwd(rc, g, impl, qs, *kv, lse, delta, ql, kl, d)
  else:
    D = rc.num_shards
    perm = _ring_perm(D)
    send = lambda kv: tuple(_ppermute_mx(x, rc.axis_name, perm) for x in kv)
    step = lambda kv, s, first: _step_bwd(rc, g, impl, qs, kv, lse, delta, ql, kl, d,
                                          (d - s) % D, first)
    # K and V (in MX form) are sent one step ahead; the fp32 dK/dV accumulators travel WITH
    # the block they belong to, after each step added its share, and finally go home.
    kv_next = send(kv) if D > 1 else None
    dq, dk, dv = step(kv, 0, True)

    def accumulate(kv, s, dq, dk, dv):
      dk = jax.lax.ppermute(dk, rc.axis_name, perm)
      dv = jax.lax.ppermute(dv, rc.axis_name, perm)
      dq_s, dk_s, dv_s = step(kv, s, False)
      return dq + dq_s, dk + dk_s, dv + dv_s

    def body(s, carry):
      kv, dq, dk, dv = carry
      kv_next = send(kv)
      return (kv_next,) + accumulate(kv, s, dq, dk, dv)

    if D > 2:
      kv_next, dq, dk, dv = jax.lax.fori_loop(1, D - 1, body, (kv_next, dq, dk, dv))
    if D > 1:
      dq, dk, dv = accumulate(kv_next, D - 1, dq, dk, dv)
      # The accumulators of block d+1 are here: send them home.
      dk = jax.lax.ppermute(dk, rc.axis_name, perm)
      dv = jax.lax.ppermute(dv, rc.axis_name, perm)
  qd, kd, vd = rc.grad_dtypes
  return dq.astype(qd), dk.astype(kd), dv.astype(vd), None, None


_ring_local.defvjp(_ring_local_fwd, _ring_local_bwd)


def _float_dtype(x, name):
  dt = jnp.dtype(x.dtype)
  if dt not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
    raise TypeError(f"{name}.dtype={dt} must be one of (bfloat16, float16, float32)")
  return dt.name


def _ring_config(query, key, value, *, axis_name, num_shards, L, is_causal, scale, layout,
                 strategy, implementation):
  B, T, N, K, H, S = _check_shapes(query, key, value)
  if layout not in LAYOUTS:
    raise ValueError(f"layout={layout!r} must be one of {LAYOUTS}")
  if strategy not in STRATEGIES:
    raise ValueError(f"strategy={strategy!r} must be one of {STRATEGIES}")
  dts = tuple(_float_dtype(x, n) for x, n in ((query, "query"), (key, "key"), (value, "value")))
  if len(set(dts)) != 1:
    raise TypeError(f"query.dtype={dts[0]}, key.dtype={dts[1]} and value.dtype={dts[2]} must "
                    f"be equal")
  if T != S:
    raise ValueError(f"ring attention is self-attention over one sharded sequence: "
                     f"query.shape[1]={T} must equal key.shape[1]={S}")
  scale = resolve_scale(scale, H)
  impl = backends.resolve(implementation, head_dim=H, num_heads=N, num_kv_heads=K,
                          has_bias=False, has_mask=False, window=None, is_causal=is_causal,
                          out_dtype=dts[0])
  return RingConfig(axis_name=axis_name, num_shards=num_shards, layout=layout,
                    strategy=strategy, is_causal=bool(is_causal), scale=float(scale),
                    implementation=impl, out_dtype=dts[0], grad_dtypes=dts)


def _check_chunks(name, value, L_total, D, layout):
  n_chunks = 2 * D if layout == "zigzag" else D
  if L_total % (n_chunks * mx.BLOCK):
    raise ValueError(f"{name}={value!r} splits the sequence of length {L_total} into "
                     f"{n_chunks} chunks ({layout} layout over {D} devices); each chunk must be "
                     f"a multiple of {mx.BLOCK} tokens, so the length must be a multiple of "
                     f"{n_chunks * mx.BLOCK}")


def _lengths(x, name, B, limit):
  if x is None:
    return jnp.full((B,), limit, jnp.int32)
  x = jnp.asarray(x)
  if x.dtype != jnp.int32:
    raise TypeError(f"{name}.dtype={x.dtype} must be int32")
  if x.shape != (B,):
    raise ValueError(f"{name}.shape={x.shape} must be ({B},), one length per batch element")
  if not isinstance(x, jax.core.Tracer):
    v = np.asarray(x)
    if ((v < 0) | (v > limit)).any():
      raise ValueError(f"{name}={v.tolist()} must lie in [0, {limit}]")
  return x


def ring_attention_local(query, key, value, *, axis_name, num_shards: Optional[int] = None,
                         is_causal: bool = False, scale: Optional[float] = None,
                         query_seq_lengths=None, key_value_seq_lengths=None,
                         layout: str = "zigzag", strategy: str = "ring",
                         implementation=None, return_residual: bool = False):
  """Ring attention on LOCAL shards, for use inside your own ``jax.shard_map``.

  ``query [B, L, N, H]``, ``key``/``value [B, L, K, H]`` are this device's sequence block
  (in ``layout`` order) along the mesh axis ``axis_name``; ``num_shards`` is that axis's size
  (default: ``jax.lax.axis_size(axis_name)``). Lengths are GLOBAL, natural-order, per batch
  element. Returns the local output block (and lse) in the same layout.
  """
  D = num_shards if num_shards is not None else jax.lax.axis_size(axis_name)
  L = query.shape[1]
  _check_chunks("num_shards", D, L * D, D, layout)
  rc = _ring_config(query, key, value, axis_name=axis_name, num_shards=D, L=L,
                    is_causal=is_causal, scale=scale, layout=layout, strategy=strategy,
                    implementation=implementation)
  B = query.shape[0]
  ql = _lengths(query_seq_lengths, "query_seq_lengths", B, L * D)
  kl = _lengths(key_value_seq_lengths, "key_value_seq_lengths", B, L * D)
  o, lse = _ring_local(rc, query, key, value, ql, kl)
  return (o, lse) if return_residual else o


def ring_attention(query, key, value, *, mesh, seq_axis: AxisNames,
                   batch_axis: AxisNames = None, head_axis: AxisNames = None,
                   is_causal: bool = False, scale: Optional[float] = None,
                   query_seq_lengths=None, key_value_seq_lengths=None, layout: str = "zigzag",
                   strategy: str = "ring", implementation=None, return_residual: bool = False):
  """Context-parallel MXFP8 attention: the sequence sharded over ``seq_axis``.

  Args:
    query: ``[B, S, N, H]``; key, value: ``[B, S, K, H]`` (GQA: K divides N), global arrays
      whose sequence axis is in ``layout`` order: for ``"zigzag"`` (the default, load-balanced
      for causal attention) reorder them with ``zigzag_reorder(x, D)`` first, D being the size
      of ``seq_axis``; ``"contiguous"`` is the natural order.
    mesh: a ``jax.sharding.Mesh``; seq_axis: the mesh axis (or axes) the sequence is split
      over; batch_axis/head_axis: optional further splits of B and of the kv heads.
    query_seq_lengths, key_value_seq_lengths: optional int32 ``[B]`` GLOBAL lengths in the
      natural order (positions >= length are masked, as in ``dot_product_attention``).
    strategy: ``"ring"`` (K/V in MX form passed between neighbours, D-1 steps overlapped with
      compute) or ``"allgather"`` (the MX K/V gathered once; fewer, larger messages).
    implementation: the backend of every block (as in ``dot_product_attention``).

  Returns the output ``[B, S, N, H]`` in the same (layout) order as the inputs (undo with
  ``zigzag_restore``), and with ``return_residual`` the lse ``[B, S, N]``.
  Sequence chunks must be multiples of 32 tokens: S divisible by 64*D (zigzag) or 32*D.
  """
  _check_mesh(mesh)
  s_ax = _axes(mesh, seq_axis, "seq_axis", required=True)
  b = _axes(mesh, batch_axis, "batch_axis")
  h = _axes(mesh, head_axis, "head_axis")
  _check_disjoint(seq_axis=s_ax, batch_axis=b, head_axis=h)
  B, T, N, K, H, S = _check_shapes(query, key, value)
  if layout not in LAYOUTS:
    raise ValueError(f"layout={layout!r} must be one of {LAYOUTS}")
  D = _size(mesh, s_ax)
  _check_chunks("seq_axis", _entry(s_ax), S, D, layout)
  _check_divides(mesh, b, "batch_axis", "batch", B)
  _check_divides(mesh, h, "head_axis", "the number of kv heads K", K)
  rc = _ring_config(query, key, value, axis_name=_entry(s_ax), num_shards=D, L=S // D,
                    is_causal=is_causal, scale=scale, layout=layout, strategy=strategy,
                    implementation=implementation)
  ql = _lengths(query_seq_lengths, "query_seq_lengths", B, S)
  kl = _lengths(key_value_seq_lengths, "key_value_seq_lengths", B, S)
  xs = P(_entry(b), _entry(s_ax), _entry(h), None)
  ls = P(_entry(b))
  o, lse = _shard_map(functools.partial(_ring_local, rc), mesh, (xs, xs, xs, ls, ls),
                      (xs, P(_entry(b), _entry(s_ax), _entry(h))))(query, key, value, ql, kl)
  return (o, lse) if return_residual else o


def ring_step_bytes(batch: int, local_seq: int, kv_heads: int, head_dim: int,
                    fmt: str = "mx") -> int:
  """Bytes of K and V that one ring step sends per device.

  MX: 2 * B * S_local * K * H * (1 + 1/32) (e4m3 data + one e8m0 scale per 32 elements);
  bf16: 2 * B * S_local * K * H * 2.
  """
  n = batch * local_seq * kv_heads * head_dim
  if fmt == "mx":
    return 2 * (n + n // mx.BLOCK)
  if fmt == "bf16":
    return 2 * n * 2
  raise ValueError(f"fmt={fmt!r} must be 'mx' or 'bf16'")


__all__ = ["attention", "ring_attention", "ring_attention_local", "zigzag_reorder",
           "zigzag_restore", "zigzag_permutation", "zigzag_chunk_order", "ring_step_bytes",
           "RingConfig", "LAYOUTS", "STRATEGIES"]
