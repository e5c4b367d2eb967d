"""Sequence-sharded (ring) MXFP8 attention on 8 fake CPU devices.

Shards one long causal self-attention over 8 devices with jax_fa4.sharding.ring_attention
(zig-zag layout, K/V passed around the ring in MX form), takes its gradients, and prints the
relative error of the output and of dQ/dK/dV against the unsharded call, next to the error of
the unsharded call itself against float64 attention on the same MX inputs.

  python examples/ring_attention_cpu.py [--seq 1024] [--strategy ring|allgather] [--no-causal]
"""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_fa4  # noqa: E402
from jax_fa4 import reference, sharding  # noqa: E402


def rel_err(x, truth):
  x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  truth = np.asarray(truth, np.float64)
  ok = np.isfinite(truth)
  return float(np.linalg.norm(x[ok] - truth[ok]) / np.linalg.norm(truth[ok]))


def main():
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--seq", type=int, default=1024)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--kv-heads", type=int, default=2)
  ap.add_argument("--head-dim", type=int, default=64)
  ap.add_argument("--strategy", default="ring", choices=sharding.STRATEGIES)
  ap.add_argument("--no-causal", action="store_true")
  args = ap.parse_args()
  B, S, N, K, H = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
  causal = not args.no_causal
  D = 8
  devices = jax.devices("cpu")[:D]
  mesh = jax.make_mesh((D,), ("seq",), devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,))

  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((B, S, N, H)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.bfloat16)
  do = jnp.asarray(rng.standard_normal((B, S, N, H)), jnp.bfloat16)

  def sharded(q, k, v):
    # Zig-zag: device i holds sequence chunks i and 2D-1-i (balanced causal work); undo after.
    zq, zk, zv = (sharding.zigzag_reorder(x, D) for x in (q, k, v))
    o = sharding.ring_attention(zq, zk, zv, mesh=mesh, seq_axis="seq", is_causal=causal,
                                strategy=args.strategy)
    return sharding.zigzag_restore(o, D)

  def unsharded(q, k, v):
    return jax_fa4.dot_product_attention(q, k, v, is_causal=causal)

  results = {}
  for name, f in (("ring", sharded), ("unsharded", unsharded)):
    g = jax.jit(lambda q, k, v, f=f: jax.vjp(f, q, k, v))
    t0 = time.perf_counter()
    o, vjp = g(q, k, v)
    grads = vjp(do)
    jax.block_until_ready(grads)
    results[name] = (o,) + tuple(grads)
    print(f"{name:>10}: compiled and ran forward+backward in {time.perf_counter() - t0:.1f} s")

  # float64 truth on the same (dequantized MX) inputs.
  qd = jax_fa4.quantize(q.astype(jnp.float32), 3).dequantize()
  kd = jax_fa4.quantize(k.astype(jnp.float32), 3).dequantize()
  vd = jax_fa4.quantize(v.astype(jnp.float32), 1).dequantize()
  to, _ = reference.truth_forward(qd, kd, vd, scale=H ** -0.5, is_causal=causal)
  tg = reference.truth_backward(qd, kd, vd, do, scale=H ** -0.5, is_causal=causal)
  truth = (to,) + tuple(tg)
  print(f"\n{D} devices, B={B} S={S} N={N} K={K} H={H}, causal={causal}, "
        f"strategy={args.strategy}, backend={jax_fa4.available_backends()}")
  print(f"per ring step each device sends {sharding.ring_step_bytes(B, S // D, K, H, 'mx')} "
        f"bytes of MX K/V (bf16 would be {sharding.ring_step_bytes(B, S // D, K, H, 'bf16')})")
  print(f"{'tensor':>6} {'ring vs unsharded':>18} {'ring vs f64':>12} {'unsharded vs f64':>17}")
  for i, name in enumerate(("o", "dq", "dk", "dv")):
    r, u = results["ring"][i], results["unsharded"][i]
    print(f"{name:>6} {rel_err(r, np.asarray(u, np.float32)):18.3e} {rel_err(r, truth[i]):12.3e} "
          f"{rel_err(u, truth[i]):17.3e}")


if __name__ == "__main__":
  main()
