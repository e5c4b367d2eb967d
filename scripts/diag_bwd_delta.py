"""Where does a backward contract miss come from: the backward kernel, or the forward's O / lse it
is given? Runs one case of tests/test_cuda_backward.py (seed from JAX_FA4_TEST_SEED) four ways:
kernel and recipe backward, each with the kernel forward's and the recipe forward's (O, lse).
Prints rel_err vs the float64 truth for dQ, dK, dV.

  JAX_FA4_TEST_SEED=1003307812 python scripts/diag_bwd_delta.py [case index]
"""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import test_cuda_backward as tb  # noqa: E402
from contract import make_do, make_qkv  # noqa: E402
from jax_fa4 import mx, reference  # noqa: E402


def rel(x, t):
  return float(np.linalg.norm(np.asarray(x, np.float64) - t) / np.linalg.norm(t))


def main():
  idx = int(sys.argv[1]) if len(sys.argv) > 1 else 1
  case = tb.CASES[idx]
  B, T, S, N, K, H, causal, window, kind, do_kind, lens = case
  seed = tb._SEED + idx
  q, k, v = make_qkv(kind, B, T, S, N, K, H, seed=seed)
  do = make_do(do_kind, B, T, N, H, seed=seed + 1)
  ql = np.full((B,), T, np.int32) if lens is None else np.asarray(lens[0], np.int32)
  kl = np.full((B,), S, np.int32) if lens is None else np.asarray(lens[1], np.int32)
  qj, kj, vj, doj = (jnp.asarray(x) for x in (q, k, v, do))
  qm, km, vm = mx.quantize(qj, 3), mx.quantize(kj, 3), mx.quantize(vj, 1)
  ops = dict(q_h=qm, q_t=mx.quantize(qj, 1), k_h=km, k_s=mx.quantize(kj, 1), v_h=mx.quantize(vj, 3),
             do_h=mx.quantize(doj, 3), do_t=mx.quantize(doj, 1))
  kw = dict(scale=1.0 / np.sqrt(H), is_causal=causal, window=window)
  o_k, lse_k = tb._ops().forward_mx(qm, km, vm, jnp.asarray(ql), jnp.asarray(kl), out_dtype=jnp.float32, **kw)
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    o_r, lse_r = reference.mx_forward(*jax.device_put((qm, km, vm), cpu), q_seqlen=jnp.asarray(ql),
                                      kv_seqlen=jnp.asarray(kl), **kw)
  o_r, lse_r = np.asarray(o_r), np.asarray(lse_r)
  o_k, lse_k = np.asarray(o_k), np.asarray(lse_k)
  print(f"case {tb._ids(case)} seed {seed}")
  print(f"forward: O kernel vs recipe rel diff {rel(o_k, o_r.astype(np.float64)):.3e}; "
        f"max |lse diff| {np.nanmax(np.abs(np.where(np.isfinite(lse_r), lse_k - lse_r, 0))):.3e}")
  tkw = dict(kw, q_len=ql, kv_len=kl)
  truth = tb._truth64_grads(qm.dequantize(), km.dequantize(), vm.dequantize(), do, **tkw)
  rkw = dict(kw, q_seqlen=jnp.asarray(ql), kv_seqlen=jnp.asarray(kl))
  for fwd_name, o, lse in (("kernel fwd", o_k, lse_k), ("recipe fwd", o_r, lse_r)):
    delta = np.sum(o * do, -1).astype(np.float32)
    g = tb._ops().backward(ops["q_h"], ops["k_h"], ops["v_h"], ops["do_h"], jnp.asarray(lse), jnp.asarray(delta),
                           jnp.asarray(ql), jnp.asarray(kl), **kw)
    r = tb._recipe_grads(ops, jnp.asarray(lse), jnp.asarray(delta), rkw)
    for name, x, y, t in zip(("dq", "dk", "dv"), g, r, truth):
      print(f"  {fwd_name}: {name} kernel {rel(x, t):.4e} recipe {rel(y, t):.4e} (x{rel(x, t) / rel(y, t):.3f})")


if __name__ == "__main__":
  main()
