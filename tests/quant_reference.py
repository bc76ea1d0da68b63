"""Independent numpy decoding of stored weights, the reference the quantized paths are tested against."""
from __future__ import annotations

import jax
import numpy as np

from jaxserve.quant import get_weight_format
from jaxserve.quant.phase import PhaseWeight


def np_dequant32(qw) -> np.ndarray:
    """The stored weight decoded by numpy: float32 [..., K, N] (values * scales in float32)."""
    *lead, k, n = qw.shape
    v = np.asarray(qw.values)
    if qw.format == "bf16":
        return v.astype(np.float32)
    s = np.asarray(qw.scales, np.float32)
    if qw.format.startswith("int4"):
        g = get_weight_format(qw.format).group
        b = v.view(np.int8).reshape(*lead, -1, g // 2, n)  # [..., tile, row in half, N]
        lo = np.left_shift(b, 4) >> 4  # numpy's >> on int8 is arithmetic: sign extension
        hi = b >> 4
        q = np.stack([lo, hi], axis=-3).reshape(*lead, -1, n)[..., :k, :]
        return q.astype(np.float32) * np.repeat(s, g, axis=-2)[..., :k, :]
    if qw.format == "fp8:block128":
        s = np.repeat(np.repeat(s, 128, axis=-2), 128, axis=-1)[..., :k, :n]
    return v.astype(np.float32) * s


def dense_leaves(leaves, treedef):
    """A phase's parameter leaves with every PhaseWeight replaced by its numpy-decoded float32
    array in the parameter's shape: the dense model built from the dequantized weights."""
    state = jax.tree.unflatten(treedef, leaves)
    def one(x):
        if not isinstance(x, PhaseWeight):
            return x
        w = np_dequant32(x.qw)
        return (w.T if x.transposed else w).reshape(x.shape)  # a tied table is stored as the head

    dense = jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, PhaseWeight))
    return jax.tree.flatten(dense)
