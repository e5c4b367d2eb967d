"""Phase timings of the forward kernel's consumer loop, from a measurement build.

Needs the CUDA module built with -DJAX_FA4_FWD_TRACE (CMAKE_CUDA_FLAGS and CMAKE_CXX_FLAGS): thread 0
of each consumer warpgroup of one CTA (fwd_sm90_mainloop.cuh, kTraceCta) stores clock64() at eight
points of each of its first 32 key tiles in the sequential loop:
  0 tile start | 1 K landed | 2 Q K^T issued | 3 Q K^T done | 4 mask checked | 5 row max (with the
  quad shuffles and the rescale factor) | 6 exp2, row sums | 7 P packed | 8 V landed | 9 P V done |
  10 O updated, stage released
Prints, per consumer and per configuration, the mean cycles of each phase over tiles 4..31 and the
offset between the two consumers' tile starts (0 = the two warpgroups run in step).

  python scripts/trace_fwd.py        (TRACE_DEFAULTS=1: only the default kernels, three consumers at H <= 128)

Building and running it (seen working, 2026-12-05): on the dev machine
  cmake -S . -B build_trace -G Ninja -DJAX_FA4_CUDA=ON -DPython_EXECUTABLE=$(which python3.12) \
    -DCMAKE_CUDA_FLAGS=-DJAX_FA4_FWD_TRACE -DCMAKE_CXX_FLAGS=-DJAX_FA4_FWD_TRACE
  cmake --build build_trace --target _jax_fa4_cuda && mkdir -p .build_trace && cp build_trace/*.so .build_trace/
then carry `.build_trace` to the GPU machine and run `cp .build_trace/*.so jax_fa4/ && python3
scripts/trace_fwd.py` (after everything that needs the normal module).
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_fa4 import _cuda_ops as co
from jax_fa4 import _jax_fa4_cuda as ext
from jax_fa4 import mx

PHASES = ("K wait", "QK issue", "QK wait", "mask", "max", "exp+sum", "pack", "V wait", "PV", "O update")
NP = 12  # points per tile in the buffer (11 used)


def trace(scores: str, bits: int, H: int = 128, causal: bool = False, consumers: int = 2) -> np.ndarray:
  os.environ["JAX_FA4_SM90_PIPELINE"] = str(bits)
  os.environ["JAX_FA4_SM90_PERSISTENT"] = "0"
  os.environ["JAX_FA4_SM90_CONSUMERS"] = str(consumers)
  B, T, N = 2, 8192, 16
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(kk, (B, T, N, H), jnp.float32).astype(jnp.bfloat16) for kk in keys)
  qm, km, vm = mx.quantize(q, 3), mx.quantize(k, 3), mx.quantize(v, 1)
  L = jnp.full((B,), T, jnp.int32)
  f = jax.jit(lambda a, b, c: co.forward_mx(a, b, c, L, L, scale=H ** -0.5, is_causal=causal, scores=scores))
  for _ in range(3):
    jax.block_until_ready(f(qm, km, vm))
  t = np.asarray(ext.fwd_trace(), np.int64).reshape(3, 32, NP)[:consumers, :, :11]  # [consumer][tile][point]
  return t


def report(name: str, t: np.ndarray) -> None:
  print(f"== {name}")
  for wg in range(t.shape[0]):
    d = np.diff(t[wg], axis=1)[4:]          # phases 0->1 ... 9->10, tiles 4..31
    tile = np.diff(t[wg, :, 0])[4:]         # tile start to next tile start
    print(f"  consumer {wg}: tile {tile.mean():7.0f} cyc | " +
          " | ".join(f"{p} {d[:, i].mean():6.0f}" for i, p in enumerate(PHASES)))
  off = (t[1, 4:, 0] - t[0, 4:, 0]).astype(np.float64)
  qk0 = t[0, 4:, 3] - t[0, 4:, 2]
  print(f"  consumer 1 starts a tile {off.mean():.0f} cyc after consumer 0 (min {off.min():.0f}, max "
        f"{off.max():.0f}); consumer 0's Q K^T wait {qk0.mean():.0f} cyc")
  for it in (8, 9):
    print(f"  tile {it}: " + " ".join(f"c{wg}:" + ",".join(f"{x - t[0, it, 0]:d}" for x in t[wg, it])
                                       for wg in range(t.shape[0])))


def main():
  if not hasattr(ext, "fwd_trace"):
    raise SystemExit("the CUDA module is not a trace build (-DJAX_FA4_FWD_TRACE)")
  print(f"device: {jax.devices()[0].device_kind}")
  if os.environ.get("TRACE_DEFAULTS"):  # only the default kernels: three consumers at H = 128 and 64, H = 256
    report("exact scores, three consumers (default), H=128, B=2 T=S=8192 N=16", trace("exact", 0, consumers=3))
    report("exact scores, three consumers (default), H=64", trace("exact", 0, H=64, consumers=3))
    report("exact scores, two consumers (default), H=256", trace("exact", 0, H=256))
    return
  for scores, bits in (("exact", 0), ("exact", 2), ("fp8", 0), ("fp8", 2)):
    report(f"{scores} scores, JAX_FA4_SM90_PIPELINE={bits}, H=128, B=2 T=S=8192 N=16", trace(scores, bits))
  report("exact scores, JAX_FA4_SM90_PIPELINE=0, H=256", trace("exact", 0, H=256))
  report("exact scores, JAX_FA4_SM90_PIPELINE=0 (sequential), H=64", trace("exact", 0, H=64))


if __name__ == "__main__":
  main()
