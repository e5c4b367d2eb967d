"""GPU probe of the forward launcher's grid and consumer choice by row length (fwd_sm90_launch.cu,
kShortRowsS): times forward_mx from MX inputs (preparation included) at about 16k tokens, N=16, for
T=S in {512, 1024, 2048, 4096}, H 64 and 128, causal and not, under

  default  no environment switch: the launcher's own choice (the rule under test)
  p0c3     one CTA per work tile, three consumers (the long-row default)
  p1c3     one CTA per SM, three consumers
  p1c2     one CTA per SM, two consumers

in rounds that alternate the settings (a fresh jit per call: a launch captured into a CUDA graph
keeps the settings of its capture). Prints us and TFLOP/s per setting (median over rounds).

  python scripts/probe_short_rows.py [--json OUT] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys

import jax
import jax.numpy as jnp

from jax_fa4 import _cuda_ops as co
from jax_fa4 import mx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
from bench_backward_gpu import time_fn  # noqa: E402

SETTINGS = {"default": None, "p0c3": ("0", "3"), "p1c3": ("1", "3"), "p1c2": ("1", "2")}


def _env(setting):
  for name in ("JAX_FA4_SM90_PERSISTENT", "JAX_FA4_SM90_CONSUMERS", "JAX_FA4_SM90_PIPELINE"):
    os.environ.pop(name, None)
  if setting is not None:
    os.environ["JAX_FA4_SM90_PERSISTENT"], os.environ["JAX_FA4_SM90_CONSUMERS"] = setting


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--json")
  ap.add_argument("--rounds", type=int, default=3)
  a = ap.parse_args()
  print(f"device: {jax.devices()[0].device_kind}", flush=True)
  out = {}
  for H in (128, 64):
    for T in (512, 1024, 2048, 4096):
      B, N = 16384 // T, 16
      keys = jax.random.split(jax.random.key(T + H), 3)
      q, k, v = (jax.random.normal(kk, (B, T, N, H), jnp.float32).astype(jnp.bfloat16) for kk in keys)
      qm, km, vm = mx.quantize(q, 3), mx.quantize(k, 3), mx.quantize(v, 1)
      L = jnp.full((B,), T, jnp.int32)
      for causal in (False, True):
        fl = 4 * B * T * T * N * H * (0.5 if causal else 1)
        times = {name: [] for name in SETTINGS}
        for _ in range(a.rounds):
          for name, setting in SETTINGS.items():
            _env(setting)
            f = jax.jit(lambda a_, b_, c_: co.forward_mx(a_, b_, c_, L, L, scale=H ** -0.5, is_causal=causal))
            times[name].append(time_fn(f, (qm, km, vm), warmup=1) * 1e6)
        _env(None)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        key = f"H{H} B{B} T=S={T} causal={causal}"
        out[key] = med
        print(f"{key}: " + " | ".join(f"{n} {t:7.1f} us {fl / t / 1e6:5.0f}" for n, t in med.items())
              + f" | default vs p0c3 x{med['p0c3'] / med['default']:.3f}", flush=True)
  if a.json:
    pathlib.Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
