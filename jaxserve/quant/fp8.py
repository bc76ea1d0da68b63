"""FP8 (e4m3fn) weight formats: per-output-channel scales, or 128x128 block scales.

Scales are float32 ``amax / 448`` (448 = e4m3fn's largest finite value) over the scale's
region, so nothing saturates, and dequantization is ``values * scale``. e4m3 keeps 3
mantissa bits, so each element's error is at most 2**-4 of its own magnitude (half an
ulp), or 2**-10 * scale for values in the subnormal range (below 2**-6 * scale).

Block layout: DeepSeek-V3 / GLM FP8 checkpoints ship ``weight`` e4m3 ``[N, K]`` (HF
[out, in]) and ``weight_scale_inv`` float32 ``[ceil(N/128), ceil(K/128)]``; we store the
transposes, ``values [K, N]`` and ``scales [ceil(K/128), ceil(N/128)]`` (``from_hf_block``
converts without requantizing). A dim that is not a multiple of 128 ends in a partial
block, which has a scale of its own (the ceil).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .qweight import QuantizedWeight, WeightFormat, check_weight

E4M3 = ml_dtypes.float8_e4m3fn
E4M3_MAX = float(ml_dtypes.finfo(E4M3).max)  # 448.0


def _cast_e4m3(w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """w / scale rounded to e4m3 (round to nearest even); zero-scale regions are all-zero."""
    safe = np.where(scale > 0, scale, 1.0).astype(np.float32)
    # amax / (amax / 448) can land a hair above 448 in float32; clip so it rounds to 448.
    return np.clip(w / safe, -E4M3_MAX, E4M3_MAX).astype(E4M3)


@dataclasses.dataclass(frozen=True)
class Fp8ChannelFormat(WeightFormat):
    """e4m3 values [..., K, N], one float32 scale per output channel: scales [..., 1, N].

    Bytes: K*N + 4*N per matrix (1 + 4/K B/param).
    """

    scale_block = (0, 1)  # one scale covers all of K and one column of N
    size_kind = ("fp8", 0)

    @property
    def name(self) -> str:
        return "fp8_e4m3"

    def quantize(self, w, name: str = "weight") -> QuantizedWeight:
        w = check_weight(w, name)
        scale = np.abs(w).max(axis=-2, keepdims=True) / E4M3_MAX  # [..., 1, N]
        return self._wrap(_cast_e4m3(w, scale), scale.astype(np.float32), w.shape)

    def dequantize(self, qw: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
        return (jnp.asarray(qw.values).astype(jnp.float32) * qw.scales).astype(dtype)


@dataclasses.dataclass(frozen=True)
class Fp8BlockFormat(WeightFormat):
    """e4m3 values [..., K, N], one float32 scale per block x block tile:
    scales [..., ceil(K/block), ceil(N/block)].

    Bytes: K*N + 4*ceil(K/b)*ceil(N/b) per matrix (~1.0002 B/param at b=128).
    """

    block: int = 128

    @property
    def name(self) -> str:
        return f"fp8:block{self.block}"

    @property
    def size_kind(self) -> tuple[str, int]:
        return ("fp8", self.block)

    @property
    def scale_block(self):
        return (self.block, self.block)

    def quantize(self, w, name: str = "weight") -> QuantizedWeight:
        w = check_weight(w, name)
        *lead, k, n = w.shape
        b = self.block
        kb, nb = -(-k // b), -(-n // b)
        # Zero padding to whole blocks leaves each partial block's amax unchanged.
        wp = np.zeros((*lead, kb * b, nb * b), np.float32)
        wp[..., :k, :n] = w
        tiles = wp.reshape(*lead, kb, b, nb, b)
        scale = np.abs(tiles).max(axis=(-3, -1)) / E4M3_MAX  # [..., kb, nb]
        q = _cast_e4m3(tiles, scale[..., :, None, :, None]).reshape(*lead, kb * b, nb * b)
        return self._wrap(np.ascontiguousarray(q[..., :k, :n]), scale.astype(np.float32), w.shape)

    def dequantize(self, qw: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
        *_, k, n = qw.shape
        s = jnp.repeat(jnp.repeat(qw.scales, self.block, axis=-2)[..., :k, :], self.block, axis=-1)[..., :n]
        return (jnp.asarray(qw.values).astype(jnp.float32) * s).astype(dtype)

    def from_hf_block(self, weight, weight_scale_inv, name: str = "weight") -> QuantizedWeight:
        """Adopt a shipped FP8 block checkpoint tensor without requantizing.

        weight e4m3 [..., N, K] (HF [out, in]), weight_scale_inv f32 [..., ceil(N/b), ceil(K/b)]
        -> QuantizedWeight over [..., K, N].
        """
        weight, scale = np.asarray(weight), np.asarray(weight_scale_inv, np.float32)
        if weight.dtype != E4M3:
            raise ValueError(f"{name}: expected float8_e4m3fn weight, got {weight.dtype}")
        *lead, n, k = weight.shape
        want = (*lead, -(-n // self.block), -(-k // self.block))
        if scale.shape != want:
            raise ValueError(f"{name}: weight_scale_inv shape {scale.shape} does not match weight "
                             f"{weight.shape} with {self.block}x{self.block} blocks (expected {want})")
        return self._wrap(np.ascontiguousarray(np.swapaxes(weight, -1, -2)),
                          np.ascontiguousarray(np.swapaxes(scale, -1, -2)), (*lead, k, n))
