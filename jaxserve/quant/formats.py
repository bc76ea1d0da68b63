"""Weight-format registry: one entry per format; parse a spec string into a format.

Per-phase weight representations: one model, several formats;
prefill typically runs bf16 or fp8 weights, decode int4, fp8 or bf16. Each format
quantizes a float ``[..., K, N]`` weight once at load (host numpy) into a
``QuantizedWeight`` pytree and supplies a jittable ``dequantize`` and ``nbytes``; the
matmuls that read each format are registered per backend in ``jaxserve.quant.paths`` and
called through ``jaxserve.quant.linear``.

Spec strings: ``bf16``, ``fp8_e4m3`` (per-channel; aliases ``fp8``, ``fp8:channel``),
``fp8:block128``, ``int8`` (per-channel; alias ``int8:channel``), ``int4:g32``, ``int4:g64``,
``int4:g128`` (alias ``int4`` = g128).
Adding a format = one class instance in ``_FORMATS``.

Bytes per param (scales float32): bf16 2; fp8_e4m3 1 + 4/K; fp8:block128
1 + 4/128**2 (~1.0002); int8 1 + 4/K; int4:gG 0.5 + 4/G (g32 0.625, g64 0.5625, g128 0.53125),
for K a multiple of the block/group (else the padded/partial block is counted).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .fp8 import Fp8BlockFormat, Fp8ChannelFormat
from .int4 import Int4GroupFormat
from .int8 import Int8ChannelFormat
from .qweight import REGISTERED, QuantizedWeight, WeightFormat, check_weight


@dataclasses.dataclass(frozen=True)
class Bf16Format(WeightFormat):
    """Plain bfloat16 cast: values bf16 [..., K, N], no scales. 2 B/param."""

    size_kind = ("bf16", 0)

    @property
    def name(self) -> str:
        return "bf16"

    def quantize(self, w, name: str = "weight") -> QuantizedWeight:
        w = check_weight(w, name)
        return self._wrap(w.astype(ml_dtypes.bfloat16), None, w.shape)

    def dequantize(self, qw: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
        return jnp.asarray(qw.values).astype(dtype)


_FORMATS: dict[str, WeightFormat] = {
    f.name: f
    for f in (
        Bf16Format(),
        Fp8ChannelFormat(),
        Fp8BlockFormat(128),
        Int8ChannelFormat(),
        Int4GroupFormat(32),
        Int4GroupFormat(64),
        Int4GroupFormat(128),
    )
}
REGISTERED.update(_FORMATS)
# Note: the capacity planner (jaxserve.planner) reads bare "fp8" as fp8:block128; here it is
# fp8_e4m3 (per channel), as for KV formats. Spell the format out where it matters.
ALIASES = {"bfloat16": "bf16", "fp8": "fp8_e4m3", "fp8:channel": "fp8_e4m3", "int8:channel": "int8",
           "int4": "int4:g128"}


def get_weight_format(spec: str | WeightFormat) -> WeightFormat:
    """'int4:g128' | 'fp8' | 'fp8:block128' | 'bf16' | ... -> the registered format."""
    if isinstance(spec, WeightFormat):
        return spec
    key = str(spec).strip().lower()
    key = ALIASES.get(key, key)
    if key not in _FORMATS:
        raise ValueError(f"unknown weight format {spec!r}; choose one of {weight_format_names()} "
                         f"(aliases: {', '.join(sorted(ALIASES))})")
    return _FORMATS[key]


def weight_format_names() -> list[str]:
    return sorted(_FORMATS)


# Convenience wrappers: dispatch on the format a QuantizedWeight records.

def quantize(w, spec: str | WeightFormat, name: str = "weight") -> QuantizedWeight:
    """w [..., K, N] float (host) -> QuantizedWeight in format ``spec``."""
    return get_weight_format(spec).quantize(w, name=name)


def dequantize(qw: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """-> [..., K, N] in ``dtype``."""
    return qw.fmt.dequantize(qw, dtype)


def nbytes(qw: QuantizedWeight) -> int:
    return qw.fmt.nbytes(qw)


def bytes_per_param(qw: QuantizedWeight) -> float:
    return nbytes(qw) / float(np.prod(qw.shape))


__all__ = ["ALIASES", "Bf16Format", "Fp8BlockFormat", "Fp8ChannelFormat", "Int4GroupFormat", "Int8ChannelFormat",
           "QuantizedWeight", "WeightFormat", "bytes_per_param", "check_weight", "dequantize", "get_weight_format", "nbytes",
           "quantize", "weight_format_names"]
