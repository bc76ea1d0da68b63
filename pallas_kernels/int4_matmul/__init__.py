"""W4A16 int4 matmuls (dense and ragged-by-expert for MoE) with group-wise scales.

kernel.py (Pallas, Triton GPU backend) | reference.py (format, quantize/dequantize, pure-jnp
spec) | validate.py (input checks) | bench.py (timings).
"""
from pallas_kernels.int4_matmul.kernel import int4_grouped_matmul, int4_matmul
from pallas_kernels.int4_matmul.reference import (
    dequantize_int4,
    int4_grouped_matmul_reference,
    int4_matmul_reference,
    quantize_int4,
    unpack_int4,
)

__all__ = [
    "dequantize_int4",
    "int4_grouped_matmul",
    "int4_grouped_matmul_reference",
    "int4_matmul",
    "int4_matmul_reference",
    "quantize_int4",
    "unpack_int4",
]
