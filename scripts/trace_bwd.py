"""Phase timings of the backward kernel's consumer loop, from a measurement build.

Needs the CUDA module built with -DJAX_FA4_BWD_TRACE (CMAKE_CUDA_FLAGS and CMAKE_CXX_FLAGS; it may be
combined with -DJAX_FA4_FWD_TRACE): thread 0 of each consumer warpgroup of one CTA (key tile 40, kv
head 3, batch 0: bwd_sm90_kernel.cuh, kBwdTraceTile) stores clock64() at 16 points of each of its
first 32 query tiles:
  0 tile start | 1 Q, dO landed | 2 S^T, dP^T issued | 3 S^T done | 4 P (exp2, mask) | 5 dP^T done |
  6 P8 packed and dS^T formed | 7 dV issued | 8 T-blocks rounded | 9 dK issued | 10 S-block bytes
  exchanged | 11 dS^T stored, barrier passed | 12 dQ issued | 13 dV, dK done, stage released |
  14 dQ done | 15 dQ stored for the writer
(Before 2026-12-06's third session, points 4-7 were: P and P8 packed | dV issued | dP^T done | dS^T
formed: docs/runs/trace_bwd_h100_20261206.txt was taken with that order.)
Prints, per consumer, the mean cycles of each phase over query tiles 4..31 and the offset between
the two consumers' tile starts.

  python scripts/trace_bwd.py

Build: as scripts/trace_fwd.py says, with -DJAX_FA4_BWD_TRACE added to both flag sets; carry the
module and copy it over jax_fa4/'s after everything that needs the normal module has run.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_fa4 import _cuda_ops as co
from jax_fa4 import _jax_fa4_cuda as ext
from jax_fa4 import mx

PHASES = ("Q/dO wait", "S,dP issue", "S wait", "exp2", "dP wait", "P8,dS", "dV issue", "T-round",
          "dK issue", "S-bytes", "dS store+bar", "dQ issue", "dV,dK wait", "dQ wait", "dQ store")
NP = 16


def trace(H: int = 128, causal: bool = False) -> np.ndarray:
  B, T, N = 2, 8192, 16
  ks = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(kk, (B, T, N, H), jnp.float32).astype(jnp.bfloat16) for kk in ks)
  qm, km, vm, dom = (mx.quantize(x, 3) for x in (q, k, v, do))
  L = jnp.full((B,), T, jnp.int32)
  o, lse = co.forward_mx(qm, km, mx.quantize(v, 1), L, L, scale=H ** -0.5, is_causal=causal)
  delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), -1)
  f = jax.jit(lambda *a: co.backward(*a, L, L, scale=H ** -0.5, is_causal=causal))
  for _ in range(3):
    jax.block_until_ready(f(qm, km, vm, dom, lse, delta))
  return np.asarray(ext.bwd_trace(), np.int64).reshape(2, 32, NP)


def report(name: str, t: np.ndarray) -> None:
  print(f"== {name}")
  for wg in range(2):
    d = np.diff(t[wg], axis=1)[4:]
    tile = np.diff(t[wg, :, 0])[4:]
    print(f"  consumer {wg}: tile {tile.mean():6.0f} cyc | " +
          " | ".join(f"{p} {d[:, i].mean():5.0f}" for i, p in enumerate(PHASES)))
  off = (t[1, 4:, 0] - t[0, 4:, 0]).astype(np.float64)
  print(f"  consumer 1 starts a tile {off.mean():.0f} cyc after consumer 0 "
        f"(min {off.min():.0f}, max {off.max():.0f})")
  for it in (8, 9):
    print(f"  tile {it}: " + " ".join(f"c{wg}:" + ",".join(f"{x - t[0, it, 0]:d}" for x in t[wg, it])
                                       for wg in range(2)))


def main():
  if not hasattr(ext, "bwd_trace"):
    raise SystemExit("the CUDA module is not a trace build (-DJAX_FA4_BWD_TRACE)")
  print(f"device: {jax.devices()[0].device_kind}")
  report("backward, H=128, B=2 T=S=8192 N=16, non-causal", trace(128))
  report("backward, H=128, causal", trace(128, True))
  report("backward, H=64, non-causal", trace(64))


if __name__ == "__main__":
  main()
