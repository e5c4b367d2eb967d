"""Flax integration: an ``attention_fn`` for Flax's attention layers, and an nnx attention layer.

``dot_product_attention`` is a drop-in ``attention_fn`` for ``flax.nnx.MultiHeadAttention`` and
``flax.linen.MultiHeadDotProductAttention``::

    from jax_fa4 import flax_attention
    layer = nnx.MultiHeadAttention(8, 512, attention_fn=flax_attention.dot_product_attention,
                                   rngs=nnx.Rngs(0))
    y = layer(x, is_causal=True)            # nnx forwards is_causal to the attention_fn
    # Choose a backend, or fix options that Flax does not pass, with functools.partial:
    fn = functools.partial(flax_attention.dot_product_attention, implementation="xla")

It takes Flax's arguments (layout ``[batch..., length, heads, head_dim]``, mask True = keep of
shape ``[batch..., heads, q_length, kv_length]`` or broadcastable to it, GQA when key/value have
fewer heads) and computes MXFP8 attention with ``jax_fa4.dot_product_attention``. Dropout on
the attention weights is not supported (the weights are never materialised): the call runs when
``dropout_rate == 0`` or ``deterministic``, and raises ``NotImplementedError`` otherwise, as it
does for ``module`` (``sow_weights=True``) and Flax's einsum overrides. ``precision`` is
accepted and ignored (the MX recipe fixes its own precision); ``dtype`` promotes q, k, v like
Flax does.

``Attention`` is an nnx layer (q/k/v/out projections, GQA, causal, rotary embeddings) that
calls ``jax_fa4.dot_product_attention`` directly, or ``jax.nn.dot_product_attention`` (cudnn or
xla) as a baseline, with the same parameters.

Flax is an optional dependency: importing this module needs it only for ``Attention``.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_fa4.attention import dot_product_attention as _fa4_attention

try:  # Flax is optional: dot_product_attention works without it.
  from flax import nnx as _nnx
except ImportError:  # pragma: no cover - exercised only where flax is absent
  _nnx = None


# ----------------------------------------------------------------------------------------------
# attention_fn for nnx.MultiHeadAttention and linen.MultiHeadDotProductAttention

def _fold_batch(x, batch: Sequence[int], name: str):
  """[*batch, a, b, c] (or broadcastable batch) -> [prod(batch) or 1, a, b, c]."""
  if x is None:
    return None
  x = jnp.asarray(x)
  nb = len(batch)
  if x.ndim > nb + 3:
    raise ValueError(f"{name}.shape={x.shape} has more dims than [batch..., heads, q, kv] with "
                     f"batch={tuple(batch)}")
  x = x.reshape((1,) * (nb + 3 - x.ndim) + x.shape)
  lead = x.shape[:nb]
  if all(d == 1 for d in lead):
    return x.reshape((1,) + x.shape[nb:])
  try:
    x = jnp.broadcast_to(x, tuple(batch) + x.shape[nb:])
  except ValueError:
    raise ValueError(f"{name}.shape={x.shape} does not broadcast to batch dims "
                     f"{tuple(batch)}") from None
  return x.reshape((math.prod(batch),) + x.shape[nb:])


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    broadcast_dropout: bool = True,
    dropout_rng=None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype=None,
    precision=None,
    module=None,
    promote_dtype: Optional[Callable] = None,
    is_causal: bool = False,
    force_fp32_for_softmax: bool = False,
    einsum_dot_general=None,
    qk_attn_weights_einsum=None,
    attn_weights_value_einsum=None,
    *,
    scale: Optional[float] = None,
    local_window_size=None,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    implementation: Optional[str] = None,
    **unknown,
):
  """MXFP8 attention with the signature of ``flax.nnx.dot_product_attention`` (and linen's).

  Args:
    query: ``[batch..., q_length, num_heads, head_dim]``.
    key, value: ``[batch..., kv_length, num_kv_heads, head_dim]``; ``num_kv_heads`` divides
      ``num_heads`` (GQA/MQA).
    bias: additive logits bias broadcastable to ``[batch..., num_heads, q_length, kv_length]``.
    mask: True = keep (any dtype, cast to bool as Flax does), broadcastable to the same shape.
    broadcast_dropout, dropout_rng: accepted; dropout itself is not supported (below).
    dropout_rate, deterministic: the call runs when ``dropout_rate == 0`` or ``deterministic``;
      otherwise it raises ``NotImplementedError`` (jax_fa4 never materialises the weights).
    dtype: computation dtype: q, k, v are promoted to it (or to their common type when None).
    precision: accepted and ignored: the MX recipe fixes its own precision (NUMERICS.md).
    module: must be None; Flax passes the module only for ``sow_weights=True``, and there are
      no attention weights to sow.
    promote_dtype: nnx's promotion function, used when given.
    is_causal: causal mask (top-left aligned, as jax.nn), passed by ``nnx.MultiHeadAttention``.
    force_fp32_for_softmax: accepted (linen); the softmax is always fp32 here.
    einsum_dot_general, qk_attn_weights_einsum, attn_weights_value_einsum: linen's overrides
      for quantized einsums; must be None.
    scale, local_window_size, query_seq_lengths, key_value_seq_lengths, implementation: as
      ``jax_fa4.dot_product_attention``; bind them with ``functools.partial``.

  Returns:
    ``[batch..., q_length, num_heads, head_dim]`` in the promoted dtype.
  """
  if unknown:
    raise TypeError(f"jax_fa4.flax_attention.dot_product_attention got unexpected keyword "
                    f"arguments {sorted(unknown)}")
  if dropout_rate != 0.0 and not deterministic:
    raise NotImplementedError(
        f"dropout_rate={dropout_rate} with deterministic={deterministic} is not supported by "
        f"jax_fa4 (attention-weight dropout needs the weights, which are never materialised); "
        f"use dropout_rate=0.0 or deterministic=True")
  if module is not None:
    raise NotImplementedError(
        f"module={type(module).__name__} (sow_weights=True) is not supported by jax_fa4: the "
        f"attention weights are never materialised, so there is nothing to sow")
  for name, val in (("einsum_dot_general", einsum_dot_general),
                    ("qk_attn_weights_einsum", qk_attn_weights_einsum),
                    ("attn_weights_value_einsum", attn_weights_value_einsum)):
    if val is not None:
      raise NotImplementedError(f"{name}={val!r} is not supported by jax_fa4 (its products are "
                                f"the MXFP8 recipe's); pass None")
  del broadcast_dropout, dropout_rng, precision, force_fp32_for_softmax

  if promote_dtype is not None:
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
  else:
    dt = jnp.dtype(dtype) if dtype is not None else jnp.result_type(query, key, value)
    query, key, value = (jnp.asarray(x, dt) for x in (query, key, value))

  if query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
    raise ValueError(f"query.shape={query.shape}, key.shape={key.shape} and value.shape="
                     f"{value.shape} must be [batch..., length, heads, head_dim] with equal rank")
  batch = query.shape[:-3]
  if key.shape[:-3] != batch or value.shape[:-3] != batch:
    raise ValueError(f"query.shape={query.shape}, key.shape={key.shape} and value.shape="
                     f"{value.shape} must have the same batch dims")
  fold = lambda x: x.reshape((math.prod(batch),) + x.shape[-3:])
  q4, k4, v4 = fold(query), fold(key), fold(value)
  mask4 = _fold_batch(mask, batch, "mask")
  if mask4 is not None and mask4.dtype != jnp.bool_:
    mask4 = mask4.astype(jnp.bool_)
  bias4 = _fold_batch(bias, batch, "bias")
  lens = {}
  for name, x in (("query_seq_lengths", query_seq_lengths),
                  ("key_value_seq_lengths", key_value_seq_lengths)):
    if x is not None:
      lens[name] = jnp.asarray(x).reshape(-1)
  out = _fa4_attention(q4, k4, v4, bias4, mask4, scale=scale, is_causal=is_causal,
                       local_window_size=local_window_size, implementation=implementation, **lens)
  return out.reshape(query.shape[:-1] + (value.shape[-1],))


# ----------------------------------------------------------------------------------------------
# Rotary embeddings

def rope_frequencies(head_dim: int, theta: float = 10000.0):
  """The RoPE inverse frequencies ``theta ** (-2i / head_dim)``, float32 ``[head_dim // 2]``."""
  if head_dim <= 0 or head_dim % 2:
    raise ValueError(f"head_dim={head_dim} must be positive and even for rotary embeddings")
  return 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)).astype(
      np.float32)


def apply_rope(x, positions, theta: float = 10000.0):
  """Rotary embedding of ``x [batch, length, heads, head_dim]`` at ``positions``.

  The half-split convention of ``flax.nnx.RoPE`` / GPT-NeoX / Llama: with x = [x1, x2] along
  head_dim, returns [x1 cos - x2 sin, x2 cos + x1 sin], angles ``positions * freq``, computed in
  float32 and returned in x's dtype. ``positions``: ``[length]`` or ``[batch, length]``.
  """
  H = x.shape[-1]
  freq = jnp.asarray(rope_frequencies(H, theta))
  pos = jnp.asarray(positions, jnp.float32)
  if pos.ndim == 1:
    pos = pos[None]
  ang = pos[..., None] * freq  # [batch or 1, length, H/2]
  cos, sin = jnp.cos(ang)[..., None, :], jnp.sin(ang)[..., None, :]  # heads axis
  xf = x.astype(jnp.float32)
  x1, x2 = xf[..., : H // 2], xf[..., H // 2:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


# ----------------------------------------------------------------------------------------------
# The nnx layer

ATTENTIONS = ("jax_fa4", "cudnn", "xla")


def _attend(attention: str, implementation, q, k, v, *, mask, is_causal, scale,
            local_window_size, query_seq_lengths, key_value_seq_lengths):
  kw = dict(mask=mask, scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
            key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size)
  if attention == "jax_fa4":
    return _fa4_attention(q, k, v, implementation=implementation, **kw)
  # Baselines: jax.nn's own attention, cudnn (bf16/fp16 on a GPU) or xla.
  return jax.nn.dot_product_attention(q, k, v, implementation=attention, **kw)


if _nnx is not None:

  def _init(init, axes, model_axis):
    if model_axis is None:
      return init
    return _nnx.with_partitioning(init, tuple(model_axis if a == "model" else a for a in axes))

  class Attention(_nnx.Module):
    """Multi-head attention (GQA, causal, RoPE) computed by ``jax_fa4.dot_product_attention``.

    Args:
      in_features: model width D of the input ``x [batch, length, D]``.
      num_heads: N query heads. num_kv_heads: K key/value heads (K divides N); default N.
      head_dim: H; default ``in_features // num_heads``. out_features: default in_features.
      is_causal: causal self-attention (default True).
      rope_theta: RoPE base; ``None`` disables rotary embeddings.
      use_bias: biases on the four projections.
      dtype: computation dtype of projections and attention (params stay ``param_dtype``).
      attention: ``"jax_fa4"`` (MXFP8, default), or the bf16 baselines ``"cudnn"``/``"xla"``
        (``jax.nn.dot_product_attention`` with that implementation).
      implementation: the jax_fa4 backend (``None`` or one of ``jax_fa4.IMPLEMENTATIONS``), for attention="jax_fa4".
      local_window_size, scale: as ``jax_fa4.dot_product_attention``.
      model_axis: a mesh axis name to annotate the projections for tensor parallelism (q/k/v
        kernels split on their output features = heads, the out kernel on its input features),
        or None for no annotations.
    """

    def __init__(self, in_features: int, num_heads: int, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, out_features: Optional[int] = None, *,
                 is_causal: bool = True, rope_theta: Optional[float] = 10000.0,
                 use_bias: bool = False, dtype: Any = None, param_dtype: Any = jnp.float32,
                 attention: str = "jax_fa4", implementation: Optional[str] = None,
                 local_window_size=None, scale: Optional[float] = None,
                 kernel_init: Callable = _nnx.initializers.lecun_normal(),
                 out_kernel_init: Optional[Callable] = None,
                 model_axis: Optional[str] = None, rngs: "_nnx.Rngs"):
      if attention not in ATTENTIONS:
        raise ValueError(f"attention={attention!r} must be one of {ATTENTIONS}")
      num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
      if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of "
                         f"num_kv_heads={num_kv_heads}")
      if head_dim is None:
        if in_features % num_heads:
          raise ValueError(f"in_features={in_features} is not divisible by num_heads="
                           f"{num_heads}; pass head_dim")
        head_dim = in_features // num_heads
      if rope_theta is not None and head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even for rotary embeddings "
                         f"(or pass rope_theta=None)")
      self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
      self.is_causal, self.rope_theta, self.dtype = is_causal, rope_theta, dtype
      self.attention, self.implementation = attention, implementation
      self.local_window_size, self.scale = local_window_size, scale
      out_features = in_features if out_features is None else out_features
      lin = lambda i, o, init, axes: _nnx.Linear(
          i, o, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
          kernel_init=_init(init, axes, model_axis),
          bias_init=_init(_nnx.initializers.zeros_init(), axes[1:], model_axis), rngs=rngs)
      self.query = lin(in_features, num_heads * head_dim, kernel_init, (None, "model"))
      self.key = lin(in_features, num_kv_heads * head_dim, kernel_init, (None, "model"))
      self.value = lin(in_features, num_kv_heads * head_dim, kernel_init, (None, "model"))
      self.out = lin(num_heads * head_dim, out_features, out_kernel_init or kernel_init,
                     ("model", None))

    def __call__(self, x, *, positions=None, mask=None, query_seq_lengths=None,
                 key_value_seq_lengths=None):
      """x ``[batch, length, in_features]`` -> ``[batch, length, out_features]``.

      positions: ``[length]`` or ``[batch, length]`` for RoPE (default ``arange(length)``);
      mask: True = keep, broadcastable to ``[batch, num_heads, length, length]``.
      """
      B, T, _ = x.shape
      q = self.query(x).reshape(B, T, self.num_heads, self.head_dim)
      k = self.key(x).reshape(B, T, self.num_kv_heads, self.head_dim)
      v = self.value(x).reshape(B, T, self.num_kv_heads, self.head_dim)
      if self.rope_theta is not None:
        pos = jnp.arange(T) if positions is None else positions
        q, k = apply_rope(q, pos, self.rope_theta), apply_rope(k, pos, self.rope_theta)
      o = _attend(self.attention, self.implementation, q, k, v, mask=mask,
                  is_causal=self.is_causal, scale=self.scale,
                  local_window_size=self.local_window_size,
                  query_seq_lengths=query_seq_lengths,
                  key_value_seq_lengths=key_value_seq_lengths)
      return self.out(o.reshape(B, T, self.num_heads * self.head_dim))

else:  # pragma: no cover

  class Attention:  # type: ignore[no-redef]
    def __init__(self, *a, **k):
      raise ImportError("jax_fa4.flax_attention.Attention needs flax (pip install flax)")


__all__ = ["dot_product_attention", "Attention", "apply_rope", "rope_frequencies", "ATTENTIONS"]
