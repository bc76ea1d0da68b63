"""W4A16 int4 matmuls (dense and ragged-by-expert for MoE) with group-wise scales.

Weights in jaxserve.quant.int4's layout, the project's one int4 layout: quantize with
``jaxserve.quant.int4.Int4GroupFormat(G).quantize(w)`` (``values``, ``scales``).
kernel.py (Pallas, Triton GPU backend) | reference.py (the layout's spec: unpack /
dequantize, pure-jnp reference matmuls) | validate.py (input checks) | bench.py (timings).
"""
from pallas_kernels.int4_matmul.kernel import int4_grouped_matmul, int4_matmul
from pallas_kernels.int4_matmul.reference import (
    dequantize_int4,
    int4_grouped_matmul_reference,
    int4_matmul_reference,
    unpack_int4,
)

__all__ = [
    "dequantize_int4",
    "int4_grouped_matmul",
    "int4_grouped_matmul_reference",
    "int4_matmul",
    "int4_matmul_reference",
    "unpack_int4",
]
