"""INT8 weight format: symmetric, one float32 scale per output channel.

Quantization (host side, once at load): per output column n, ``scale[n] = max_k |w[k, n]| / 127``
and ``q = clip(round(w / scale), -127, 127)`` (-128 is never produced, so the grid is
symmetric and negating a weight negates its code). Dequantization is ``q * scale``; each
element's error is at most ``scale / 2``.

Storage: ``values`` int8 [..., K, N], ``scales`` float32 [..., 1, N]: 1 + 4/K B/param.

Why per channel (not per group): the scale then factors out of the K sum, so a matmul can
run entirely in integers, ``y[m, n] = sx[m] * scale[n] * sum_k xq[m, k] * q[k, n]`` with the
activations quantized per token (W8A8), which is the fastest weight path XLA:CPU has on this
machine (s8 x s8 -> s32 dots, AVX512-VNNI; see ``jaxserve.quant.linear``).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .qweight import QuantizedWeight, WeightFormat, check_weight

QMAX = 127


@dataclasses.dataclass(frozen=True)
class Int8ChannelFormat(WeightFormat):
    """int8 values [..., K, N], float32 scales [..., 1, N] (one per output channel)."""

    scale_block = (0, 1)
    size_kind = ("int8", 0)

    @property
    def name(self) -> str:
        return "int8"

    def quantize(self, w, name: str = "weight") -> QuantizedWeight:
        w = check_weight(w, name)
        scale = (np.abs(w).max(axis=-2, keepdims=True) / QMAX).astype(np.float32)  # [..., 1, N]
        safe = np.where(scale > 0, scale, 1.0)
        q = np.clip(np.rint(w / safe), -QMAX, QMAX).astype(np.int8)
        return self._wrap(q, scale, w.shape)

    def dequantize(self, qw: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
        return (jnp.asarray(qw.values).astype(jnp.float32) * qw.scales).astype(dtype)
