"""A/B of two builds of the forward kernel (run once per build, each in its own process, with
PYTHONPATH pointing at that build's jax_fa4): saves O and lse of fixed-seed cases (exact scores,
default variants) to PREFIX.npz and times forward_mx from MX inputs (preparation included) at
B=2, T=S=8192, N=16, H = 128 and 64, causal and not, beside cuDNN bf16 in the same process
(PREFIX.json). Then `python scripts/ab_fwd.py --compare A.npz B.npz` says whether the outputs are
bitwise equal.

  PYTHONPATH=/path/to/build_a python scripts/ab_fwd.py $OUT/a
  PYTHONPATH=/path/to/build_b python scripts/ab_fwd.py $OUT/b
  python scripts/ab_fwd.py --compare $OUT/a.npz $OUT/b.npz
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

CASES = [  # B, T, S, N, K, H, causal, window, q_lens, kv_lens
    (1, 1000, 1300, 4, 2, 128, False, None, [1000], [1211]),
    (2, 777, 777, 4, 4, 128, True, None, [777, 300], [777, 0]),
    (1, 513, 2049, 2, 1, 64, False, (100, 50), [513], [2049]),
    (1, 1, 31, 2, 1, 128, False, None, [1], [31]),
    (1, 1023, 1023, 2, 1, 128, True, (200, 0), [1023], [1023]),
    (2, 300, 700, 2, 1, 256, True, None, [300, 17], [700, 650]),
]


def run(prefix: str) -> None:
  import jax
  import jax.numpy as jnp
  from jax_fa4 import _cuda_ops as co
  from jax_fa4 import mx
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
  from probe_fwd_loops import _shapes, _time  # noqa: E402
  print(f"jax_fa4 from {co.__file__}", flush=True)
  rng = np.random.default_rng(1234)
  arrays = {}
  for i, (B, T, S, N, K, H, causal, window, qls, kls) in enumerate(CASES):
    q = jnp.asarray(rng.standard_normal((B, T, N, H)) * rng.uniform(0.5, 3), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32)
    o, lse = co.forward_mx(mx.quantize(q, 3), mx.quantize(k, 3), mx.quantize(v, 1), jnp.asarray(qls, jnp.int32),
                           jnp.asarray(kls, jnp.int32), scale=float(H) ** -0.5, is_causal=causal, window=window,
                           out_dtype=jnp.float32)
    arrays[f"o{i}"], arrays[f"lse{i}"] = np.asarray(o), np.asarray(lse)
  np.savez(prefix + ".npz", **arrays)
  results = {"device": jax.devices()[0].device_kind}
  for H, causal, fl, base, mxs, L in _shapes(results, (128, 64)):
    f = jax.jit(lambda a, b, c: co.forward_mx(a, b, c, L, L, scale=H ** -0.5, is_causal=causal))
    us = _time(f, mxs)
    results[f"H{H}_c{int(causal)}_fa4_mx"] = us
    print(f"   fa4 MX (default): {us:8.1f} us {fl / us / 1e6:5.0f} TF/s ({base / us:.3f}x cuDNN bf16)", flush=True)
  with open(prefix + ".json", "w") as fh:
    json.dump(results, fh, indent=1)


def compare(a: str, b: str) -> bool:
  x, y = np.load(a), np.load(b)
  ok = True
  for name in x.files:
    same = np.array_equal(x[name].view(np.uint32), y[name].view(np.uint32))
    ok &= same
    if not same:
      print(f"{name}: DIFFERENT (max |d| {np.nanmax(np.abs(x[name] - y[name])):.3e})")
  print(f"{a} vs {b}: {'bitwise equal' if ok else 'DIFFERENT'} ({len(x.files)} arrays)")
  return ok


if __name__ == "__main__":
  ap = argparse.ArgumentParser()
  ap.add_argument("prefix", nargs="?")
  ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
  args = ap.parse_args()
  if args.compare:
    sys.exit(0 if compare(*args.compare) else 1)
  run(args.prefix)
