"""Weight formats for per-phase weight representations (bf16, fp8 channel/block, int4 groups).

See ``formats`` for the registry and spec strings, ``qweight`` for the QuantizedWeight
pytree and its sharding rules, ``int4`` for the packed nibble layout.
"""
from .formats import (ALIASES, Bf16Format, Fp8BlockFormat, Fp8ChannelFormat, Int4GroupFormat, bytes_per_param,
                      dequantize, get_weight_format, matmul, nbytes, quantize, ragged_matmul, weight_format_names)
from .int4 import pack_int4, repack_int4, unpack_int4
from .qweight import QuantizedWeight, WeightFormat, logical_axes_for, shardings_for

__all__ = ["ALIASES", "Bf16Format", "Fp8BlockFormat", "Fp8ChannelFormat", "Int4GroupFormat", "QuantizedWeight",
           "WeightFormat", "bytes_per_param", "dequantize", "get_weight_format", "logical_axes_for", "matmul",
           "nbytes", "pack_int4", "quantize", "ragged_matmul", "repack_int4", "shardings_for", "unpack_int4",
           "weight_format_names"]
