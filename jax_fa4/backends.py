"""The backends behind ``dot_product_attention`` and how one is chosen.

- ``"xla"``: the plain-jnp recipe (jax_fa4.reference), any platform; the only one serving a
  dense ``bias`` or ``mask``.
- ``"cpu"``: the C++ FFI kernels (forward and backward), platform "cpu".
- ``"cuda"``: the Hopper (sm_90a) forward kernel with exact scores (Q K^T on bf16 wgmma from the
  exact dequantized MX values, P V on FP8 wgmma) and the sm_90a backward kernel (all five products
  on bf16 wgmma from the exact MX values; dS in bf16).
- ``"cuda_fp8"``: the same kernel with Q K^T on FP8 wgmma too (faster where Q K^T's tensor time
  shows: H=256 576 vs 497 TFLOP/s on an H200), opt-in only, since FP8 wgmma's reduced-precision
  sums miss the accuracy contract (see ``Backend.default``).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax

from jax_fa4 import reference

KERNEL_HEAD_DIMS = (64, 128, 256)


class Unsupported(Exception):
  """Why a backend cannot serve a call: carries the exception type to raise for it."""

  def __init__(self, exc_type, message):
    super().__init__(message)
    self.exc_type = exc_type


@dataclasses.dataclass(frozen=True)
class Backend:
  name: str
  platform: Optional[str]  # jax.default_backend() value it runs on; None = any
  available: Callable[[], bool]
  check: Callable[..., None]  # raises Unsupported
  forward_mx: Callable
  backward: Callable
  forward_float: Optional[Callable] = None
  # Whether implementation=None may pick it: only backends that meet the accuracy contract.
  default: bool = True
  # Whether backward() takes dO as the cotangent itself (do_h a float [B,T,N,H] array, do_t None)
  # and uses it as mx.quantize(do, 3), instead of the two MX orientations: the CUDA backward makes
  # its bf16 copy of dO from the floats in one pass, with no MX dO in between.
  raw_cotangent: bool = False
  # Whether backward() reads q_t and k_s, q and k blocked along T and S (the recipe and the CPU
  # kernels: NUMERICS.md section 3's orientations). The CUDA backward's bf16 wgmma reads either
  # major-ness, so q_h and k_h serve all its products; it is passed None for both, and the
  # custom_vjp neither quantizes nor keeps them.
  transposed_residuals: bool = True


# ---- xla: the recipe -------------------------------------------------------------------------

def _xla_check(**_):
  return None


def _recipe_kwargs(bias, mask, q_len, kv_len, cfg):
  return dict(scale=cfg.scale, is_causal=cfg.is_causal, q_seqlen=q_len, kv_seqlen=kv_len,
              window=cfg.window, bias=bias, mask=mask)


def _xla_forward(q_h, k_h, v_s, bias, mask, q_len, kv_len, cfg):
  return reference.mx_forward(q_h, k_h, v_s, **_recipe_kwargs(bias, mask, q_len, kv_len, cfg))


def _xla_backward(q_h, q_t, k_h, k_s, v_h, do_h, do_t, lse, delta, bias, mask, q_len, kv_len, cfg):
  return reference.mx_backward(q_h, q_t, k_h, k_s, v_h, do_h, do_t, lse, delta,
                               **_recipe_kwargs(bias, mask, q_len, kv_len, cfg))


# ---- cpu: C++ FFI kernels --------------------------------------------------------------------

def _cpu_ops():
  from jax_fa4 import _cpu_ops  # imports the extension; fails cleanly where it is not built
  return _cpu_ops


def _cpu_available() -> bool:
  try:
    return _cpu_ops().available()
  except ImportError:
    return False


def _kernel_check(name, *, head_dim, has_bias, has_mask, **_):
  if has_bias:
    raise Unsupported(NotImplementedError,
                      f"bias is not supported by implementation={name!r}; use "
                      f"implementation='xla' (or None, which falls back to it)")
  if has_mask:
    raise Unsupported(NotImplementedError,
                      f"a dense mask is not supported by implementation={name!r}; express it "
                      f"with is_causal/local_window_size/*_seq_lengths, or use "
                      f"implementation='xla'")
  if head_dim not in KERNEL_HEAD_DIMS:
    raise Unsupported(ValueError, f"{head_dim=} must be one of {KERNEL_HEAD_DIMS} for "
                                  f"implementation={name!r}")


def _cpu_check(**kw):
  _kernel_check("cpu", **kw)


def _cpu_forward(q_h, k_h, v_s, bias, mask, q_len, kv_len, cfg):
  left, right = cfg.window_lr
  return _cpu_ops().forward(q_h, k_h, v_s, q_len, kv_len, scale=cfg.scale,
                            is_causal=cfg.is_causal, window_left=left, window_right=right)


def _cpu_backward(q_h, q_t, k_h, k_s, v_h, do_h, do_t, lse, delta, bias, mask, q_len, kv_len, cfg):
  left, right = cfg.window_lr
  dq, dk, dv = _cpu_ops().backward(q_h, q_t, k_h, k_s, v_h, do_h, do_t, lse, delta, q_len, kv_len,
                                   scale=cfg.scale, is_causal=cfg.is_causal, window_left=left,
                                   window_right=right)
  return dq, dk, dv, None


# ---- cuda: Hopper kernels --------------------------------------------------------------------

def _cuda_ops():
  from jax_fa4 import _cuda_ops
  return _cuda_ops


def _cuda_available() -> bool:
  try:
    return _cuda_ops().available()
  except ImportError:
    return False


def _cuda_check(name, *, q_shape, k_shape, **kw):
  _kernel_check(name, **kw)
  why = _cuda_ops().unsupported_reason(q_shape, k_shape, head_dim=kw["head_dim"],
                                       window=kw["window"], out_dtype=kw["out_dtype"])
  if why is not None:
    raise Unsupported(NotImplementedError, f"implementation={name!r} cannot serve this call: {why}")


_SCORES = {"cuda": "exact", "cuda_fp8": "fp8"}


def _cuda_forward(q_h, k_h, v_s, bias, mask, q_len, kv_len, cfg):
  return _cuda_ops().forward_mx(q_h, k_h, v_s, q_len, kv_len, scale=cfg.scale,
                                is_causal=cfg.is_causal, window=cfg.window,
                                out_dtype=cfg.out_dtype, scores=_SCORES[cfg.implementation])


def _cuda_backward(q_h, q_t, k_h, k_s, v_h, do_h, do_t, lse, delta, bias, mask, q_len, kv_len, cfg):
  # bf16 wgmma reads either major-ness, so the H-blocked q_h, k_h, v_h serve every product: the
  # second orientations (q_t, k_s, do_t) are unused here (None from dot_product_attention:
  # Backend.transposed_residuals; MX from ring attention). do_h: the cotangent itself from
  # dot_product_attention (raw_cotangent), an MXArray blocked along H from ring attention.
  # dK and dV leave the kernel in the gradients' dtype when k and v share one (rounded once from
  # fp32 in the kernel: no fp32 copies of them for bf16 training); dQ likewise, accumulated in fp32
  # one chunk of heads at a time and rounded once to q's gradient dtype (_cuda_ops.backward).
  dkv = {cfg.grad_dtypes[1], cfg.grad_dtypes[2]}
  dkv_dtype = dkv.pop() if len(dkv) == 1 and None not in dkv else "float32"
  if dkv_dtype not in ("float32", "bfloat16", "float16"):
    dkv_dtype = "float32"
  dq_dtype = cfg.grad_dtypes[0] if cfg.grad_dtypes[0] in ("bfloat16", "float16") else "float32"
  dq, dk, dv = _cuda_ops().backward(q_h, k_h, v_h, do_h, lse, delta, q_len, kv_len,
                                    scale=cfg.scale, is_causal=cfg.is_causal, window=cfg.window,
                                    deterministic=cfg.deterministic, dkv_dtype=dkv_dtype,
                                    dq_dtype=dq_dtype)
  return dq, dk, dv, None


def _cuda_forward_float(q, k, v, q_len, kv_len, cfg):
  return _cuda_ops().forward_float(q, k, v, q_len, kv_len, scale=cfg.scale,
                                   is_causal=cfg.is_causal, window=cfg.window,
                                   out_dtype=cfg.out_dtype, scores=_SCORES[cfg.implementation])


_BACKENDS = {
    "xla": Backend("xla", None, lambda: True, _xla_check, _xla_forward, _xla_backward),
    "cpu": Backend("cpu", "cpu", _cpu_available, _cpu_check, _cpu_forward, _cpu_backward),
    # Backward: the sm_90a kernel with every product on bf16 wgmma (docs/HOPPER_BACKWARD.md).
    # A default: it meets the contract on every tested distribution but one, O under perfectly
    # flat attention (1.3-1.6x the bound, ~4e-5 relative, from P V's FP8 sums; an xfail in
    # tests/test_cuda_forward.py, docs/HOPPER_FORWARD.md).
    "cuda": Backend("cuda", "gpu", _cuda_available, functools.partial(_cuda_check, "cuda"),
                    _cuda_forward, _cuda_backward, forward_float=_cuda_forward_float,
                    raw_cotangent=True, transposed_residuals=False),
    # Not a default: on an H200 FP8 wgmma's sums miss the contract for the lse and for outlier
    # inputs (docs/HOPPER_FORWARD.md); implementation='cuda_fp8' opts in.
    "cuda_fp8": Backend("cuda_fp8", "gpu", _cuda_available, functools.partial(_cuda_check, "cuda_fp8"),
                        _cuda_forward, _cuda_backward, forward_float=_cuda_forward_float,
                        default=False, raw_cotangent=True, transposed_residuals=False),
}


def get(name: str) -> Backend:
  return _BACKENDS[name]


def available() -> dict:
  """{backend name: whether it can run here} (kernels: extension built and device present)."""
  return {name: b.available() for name, b in _BACKENDS.items()}


def resolve(implementation: Optional[str], **features) -> str:
  """The backend that serves a call: an explicit choice is checked, None picks the fastest."""
  if implementation is not None:
    b = _BACKENDS[implementation]
    if not b.available():
      raise RuntimeError(
          f"implementation={implementation!r} is not available here: "
          + ("the jax_fa4 C++ extension was not built" if implementation == "cpu" else
             "it needs the jax_fa4 CUDA extension (built with nvcc) and a Hopper (sm_90) GPU "
             "as jax's default device"))
    if b.platform is not None and jax.default_backend() != b.platform:
      raise RuntimeError(f"implementation={implementation!r} runs on platform {b.platform!r}, "
                         f"but jax's default backend is {jax.default_backend()!r}")
    try:
      b.check(**features)
    except Unsupported as e:
      raise e.exc_type(str(e)) from None
    return implementation
  platform = jax.default_backend()
  for name in ("cuda", "cpu"):
    b = _BACKENDS[name]
    if b.default and b.platform == platform and b.available():
      try:
        b.check(**features)
      except Unsupported:
        continue
      return name
  return "xla"
