"""Weight formats for per-phase weight representations (bf16, fp8 channel/block, int8, int4
groups) and the one quantized linear op that computes in them.

See ``formats`` for the registry and spec strings, ``qweight`` for the QuantizedWeight
pytree and its sharding rules, ``int4`` for the packed nibble layout, ``linear`` for the op
the models call and ``paths`` for the (format, backend) registry of formulations.
"""
from .formats import (ALIASES, Bf16Format, Fp8BlockFormat, Fp8ChannelFormat, Int4GroupFormat, Int8ChannelFormat,
                      bytes_per_param, dequantize, get_weight_format, nbytes, quantize, weight_format_names)
from .int4 import pack_int4, unpack_int4
from .linear import matmul, ragged_matmul
from .qweight import QuantizedWeight, WeightFormat, logical_axes_for, shardings_for

__all__ = ["ALIASES", "Bf16Format", "Fp8BlockFormat", "Fp8ChannelFormat", "Int4GroupFormat", "Int8ChannelFormat",
           "QuantizedWeight", "WeightFormat", "bytes_per_param", "dequantize", "get_weight_format",
           "logical_axes_for", "matmul", "nbytes", "pack_int4", "quantize", "ragged_matmul",
           "shardings_for", "unpack_int4", "weight_format_names"]
