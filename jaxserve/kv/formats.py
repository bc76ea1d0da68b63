"""KV-cache storage formats: one registry entry per format.

A format says how a float tensor is stored in the page pool and read back. Scaled formats
(fp8) carry one float32 scale per stored vector (per token, or per token and head): the
scale is the vector's absolute maximum over the format's largest finite value, so nothing
saturates. Quantize on write, dequantize on read.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes


@dataclasses.dataclass(frozen=True)
class KVFormat:
    name: str
    dtype: jnp.dtype  # storage dtype of the values
    scaled: bool  # carries a float32 scale per stored vector
    max_value: float = 0.0  # largest finite value (scaled formats)

    @property
    def bytes_per_value(self) -> int:
        return jnp.dtype(self.dtype).itemsize

    def quantize(self, x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray | None]:
        """x [..., D] float -> (values [..., D] storage dtype, scale [...] f32 | None)."""
        if not self.scaled:
            return x.astype(self.dtype), None
        x32 = x.astype(jnp.float32)
        amax = jnp.max(jnp.abs(x32), axis=-1)
        scale = amax / self.max_value
        safe = jnp.where(scale > 0, scale, 1.0)
        q = (x32 / safe[..., None]).astype(self.dtype)
        return q, scale

    def dequantize(self, q: jnp.ndarray, scale: jnp.ndarray | None, dtype) -> jnp.ndarray:
        """values [..., D] + scale [...] -> [..., D] in `dtype`."""
        if scale is None:
            return q.astype(dtype)
        return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


_FORMATS: dict[str, KVFormat] = {
    "bf16": KVFormat("bf16", jnp.bfloat16, scaled=False),
    "fp8_e4m3": KVFormat(
        "fp8_e4m3", jnp.float8_e4m3fn, scaled=True, max_value=float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
    ),
    # Reference format: the model's own precision, for exactness tests and format experiments.
    "float32": KVFormat("float32", jnp.float32, scaled=False),
}
ALIASES = {"bfloat16": "bf16", "fp8": "fp8_e4m3", "f32": "float32"}


def get_kv_format(name: str) -> KVFormat:
    key = ALIASES.get(name, name)
    if key not in _FORMATS:
        raise ValueError(f"unknown KV format {name!r}; choose one of {sorted(_FORMATS)}")
    return _FORMATS[key]


def kv_format_names() -> list[str]:
    return sorted(_FORMATS)


__all__ = ["KVFormat", "get_kv_format", "kv_format_names"]
