"""Attention masks shared by the recipe and the float64 truth: causal, windows, lengths, user masks."""
from __future__ import annotations

import jax.numpy as jnp


def positional_mask(T: int, S: int, *, is_causal: bool, window, q_seqlen, kv_seqlen, xp=jnp):
  """Boolean [B or 1, 1, T, S] mask, True = keep, with jax.nn's conventions.

  Causal keeps key j <= query i (top-left aligned, also when T != S). A window (left, right)
  keeps i - left <= j <= i + right; None on either side means unbounded. Lengths mask keys
  j >= kv_seqlen[b] and whole query rows i >= q_seqlen[b].
  """
  i = xp.arange(T)[:, None]
  j = xp.arange(S)[None, :]
  keep = xp.ones((T, S), dtype=bool)
  if is_causal:
    keep = keep & (j <= i)
  if window is not None:
    left, right = window
    if left is not None:
      keep = keep & (j >= i - left)
    if right is not None:
      keep = keep & (j <= i + right)
  keep = keep[None, None]
  if q_seqlen is not None:
    keep = keep & (xp.arange(T)[None, None, :, None] < xp.asarray(q_seqlen)[:, None, None, None])
  if kv_seqlen is not None:
    keep = keep & (xp.arange(S)[None, None, None, :] < xp.asarray(kv_seqlen)[:, None, None, None])
  return keep


def broadcast_bnts(x, B: int, N: int, T: int, S: int, xp=jnp):
  """A user bias/mask broadcast to [B, N, T, S] (jax.nn accepts anything broadcastable to it)."""
  return xp.broadcast_to(x, (B, N, T, S))


__all__ = ["positional_mask", "broadcast_bnts"]
