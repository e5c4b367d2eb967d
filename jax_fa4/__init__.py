"""jax_fa4: block-scaled (MXFP8) FlashAttention for JAX."""
from jax_fa4.mx import MXArray, dequantize, requantize
from jax_fa4.mx import quantize_auto as quantize  # the CUDA quantizer on Hopper, else mx.quantize
from jax_fa4.attention import IMPLEMENTATIONS, AttentionConfig, dot_product_attention
from jax_fa4.backends import available as available_backends
from jax_fa4 import sharding

__version__ = "0.1.0"

__all__ = [
    "MXArray",
    "AttentionConfig",
    "IMPLEMENTATIONS",
    "available_backends",
    "dequantize",
    "dot_product_attention",
    "quantize",
    "requantize",
    "sharding",
]
