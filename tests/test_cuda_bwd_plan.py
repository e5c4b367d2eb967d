"""The memory plan of the CUDA backward's dQ, checked on the lowered program (no GPU needed).

A bf16 / f16 dQ is accumulated in fp32 one chunk of (batches, kv heads) at a time, and a bf16 dQ is
written over the kernel's bf16 copy of q (csrc/cuda/bwd_dq_epilogue.cuh): the custom call must
alias that output to that operand and ask for one chunk's accumulator, not all of dQ's. The kernels
themselves are tested on the GPU (tests/test_cuda_backward.py, test_dq_chunks_are_the_fp32_dq_rounded_once).
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from jax_fa4 import _cuda_ops, mx


def _lowered_bwd(monkeypatch, B, T, N, K, H, dq_dtype, **kw):
  monkeypatch.setattr(_cuda_ops, "_ensure", lambda: None)  # lowering only: nothing runs

  def f(q, k, v, do, lse, delta, ql, kl):
    qm, km, vm = mx.quantize(q, 3), mx.quantize(k, 3), mx.quantize(v, 3)
    return _cuda_ops.backward(qm, km, vm, do, lse, delta, ql, kl, scale=0.1, dq_dtype=dq_dtype,
                              dkv_dtype=jnp.bfloat16, **kw)

  sds = jax.ShapeDtypeStruct
  args = (sds((B, T, N, H), jnp.bfloat16), sds((B, T, K, H), jnp.bfloat16), sds((B, T, K, H), jnp.bfloat16),
          sds((B, T, N, H), jnp.bfloat16), sds((B, T, N), jnp.float32), sds((B, T, N), jnp.float32),
          sds((B,), jnp.int32), sds((B,), jnp.int32))
  text = jax.jit(f).lower(*args).as_text()
  (line,) = [l for l in text.splitlines() if "@jax_fa4_cuda_bwd" in l]
  return line


def _results(line):
  return [(d.rstrip("x"), t) for d, t in re.findall(r"tensor<([0-9x]*)(bf16|f16|f32|i32)>", line.split("->")[-1])]


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dq_dtype", ["bfloat16", "float16", "float32"])
def test_large_dq_is_accumulated_a_quarter_at_a_time(monkeypatch, dq_dtype, is_causal):
  # Causal calls too: the launcher's causal grid order fills each chunk's tail (bwd_sm90_launch.cu).
  B, T, N, K, H = 2, 8192, 16, 8, 128  # the shape with GQA: 128 MiB of fp32 dQ
  line = _lowered_bwd(monkeypatch, B, T, N, K, H, jnp.dtype(dq_dtype), is_causal=is_causal)
  res = _results(line)
  short = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}[dq_dtype]
  assert res[0] == ("2x8192x16x128", short)  # dq in the gradient's dtype, scaled by the kernel
  if dq_dtype == "float32":
    assert res[4] == ("0", "f32")  # dQ is its own accumulator
  else:
    assert res[4] == ("1x8192x8x128", "f32")  # one batch x 4 of 8 kv heads (x 2 query heads each)
    assert "dq_chunk_kh = 4" in line
  aliased = "output_operand_aliases" in line
  assert aliased == (dq_dtype == "bfloat16"), line  # dQ over the bf16 copy of q (operand 0)
  if aliased:
    assert "output_tuple_indices = [0], operand_index = 0" in line


@pytest.mark.parametrize("kw", [dict(deterministic=True), dict(deterministic=True, is_causal=True)],
                         ids=["deterministic", "deterministic-causal"])
def test_deterministic_dq_is_one_chunk(monkeypatch, kw):
  # Still written over q's bf16 copy, but the accumulator is all of dQ's: one launch, no drains.
  line = _lowered_bwd(monkeypatch, 2, 8192, 16, 8, 128, jnp.dtype(jnp.bfloat16), **kw)
  assert _results(line)[4] == ("2x8192x16x128", "f32")
  assert "dq_chunk_kh = 8" in line
  assert "output_tuple_indices = [0], operand_index = 0" in line


def test_dq_chunking_rule():
  ch = _cuda_ops._dq_chunking
  # Small accumulators (<= 32 MiB) are one chunk.
  assert ch(2, 1024, 16, 16, 128) == (2, 16)
  # Large: a quarter of the batches, or of the kv heads of one batch (rounded up: partial chunks).
  assert ch(8, 8192, 16, 16, 128) == (2, 16)
  assert ch(5, 8192, 16, 16, 128) == (2, 16)
  assert ch(2, 8192, 16, 16, 128) == (1, 8)
  assert ch(1, 16384, 16, 16, 128) == (1, 4)
  assert ch(1, 16384, 16, 3, 128) == (1, 1)
  assert ch(1, 65536, 16, 1, 128) == (1, 1)  # MQA, one batch: nothing to split (a known gap)
  # Deterministic: one chunk (each chunk's launch drains the GPU, which the ordered adds expose).
  assert ch(8, 8192, 16, 16, 128, deterministic=True) == (8, 16)


def _main_deps(text):
  """{SSA value: the values its op reads} over the lowered module's main function."""
  deps, ops, body = {}, {}, False
  for line in text.splitlines():
    if "func.func public @main" in line:
      body = True
      continue
    if body and line.startswith("  }"):
      break
    m = re.match(r"\s*(%[\w]+)(?::\d+)? = (.*)", line) if body else None
    if m:
      deps[m.group(1)] = [v.split("#")[0] for v in re.findall(r"%[\w#]+", m.group(2))]
      ops[m.group(1)] = m.group(2)
  return deps, ops


def _reaches(deps, start, goal):
  seen, todo = set(), [start]
  while todo:
    v = todo.pop()
    if v == goal:
      return True
    if v not in seen:
      seen.add(v)
      todo.extend(deps.get(v, ()))
  return False


def test_backward_copies_wait_for_the_forward(monkeypatch):
  # The training step's peak is at the forward kernel (H100 memory report, docs/HOPPER_BACKWARD.md
  # "Peak memory: the schedule"). The backward's bf16 copies of q and dO (bwd operands 0 and 5)
  # must depend on the forward's result, or XLA may make them first and keep them live through it;
  # here dO's source is a jit argument, ready at the start.
  import jax_fa4
  from jax_fa4 import backends
  monkeypatch.setattr(_cuda_ops, "_ensure", lambda: None)  # lowering only: nothing runs
  monkeypatch.setattr(backends, "resolve", lambda implementation, **kw: "cuda")

  def step(q, k, v, w):
    loss = lambda q, k, v: jnp.sum(jax_fa4.dot_product_attention(q, k, v).astype(jnp.float32) * w)
    return jax.grad(loss, (0, 1, 2))(q, k, v)

  x = jax.ShapeDtypeStruct((2, 256, 4, 128), jnp.bfloat16)
  text = jax.jit(step).trace(x, x, x, x).lower(lowering_platforms=("cuda",)).as_text()
  deps, ops = _main_deps(text)
  (fwd,) = [v for v, op in ops.items() if "@jax_fa4_cuda_fwd(" in op]
  (bwd,) = [v for v, op in ops.items() if "@jax_fa4_cuda_bwd(" in op]
  operands = [o.split("#")[0] for o in re.search(r"@jax_fa4_cuda_bwd\(([^)]*)\)", ops[bwd]).group(1).split(", ")]
  for name, i in (("q", 0), ("dO", 5)):
    copy = operands[i]
    assert "@jax_fa4_cuda_exact_rows" in ops[copy], (name, ops[copy][:80])
    assert _reaches(deps, copy, fwd), f"the backward's {name} copy does not wait for the forward"


@pytest.mark.parametrize("impl,kept", [("cuda", False), ("cuda_fp8", False), ("xla", True)])
def test_vjp_residuals_hold_the_orientations_the_backward_reads(monkeypatch, impl, kept):
  # The CUDA backward reads q and k blocked along H only (bf16 wgmma takes either major-ness), so
  # its custom_vjp keeps no q_t / k_s: an eager jax.vjp, or a program that ends after the forward,
  # holds one MX copy of q and of k instead of two. The recipe reads both orientations.
  from jax_fa4 import attention
  monkeypatch.setattr(_cuda_ops, "_ensure", lambda: None)  # tracing only: nothing runs
  cfg = attention.AttentionConfig(scale=0.1, is_causal=True, window=None, implementation=impl,
                                  out_dtype="bfloat16", grad_dtypes=("bfloat16",) * 3)
  x = jax.ShapeDtypeStruct((2, 256, 4, 128), jnp.bfloat16)
  lens = jax.ShapeDtypeStruct((2,), jnp.int32)
  _, res = jax.eval_shape(
      lambda q, k, v, ql, kl: attention._attention_fwd(cfg, q, k, v, None, None, ql, kl),
      x, x, x, lens, lens)
  for name, axis in (("q_h", 3), ("k_h", 3), ("v_h", 3)):
    assert isinstance(res[name], mx.MXArray) and res[name].axis == axis, name
  for name, axis in (("q_t", 1), ("k_s", 1)):
    assert (res[name] is not None) == kept, name
    assert res[name] is None or res[name].axis == axis, name
