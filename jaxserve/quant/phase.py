"""Per-phase weight representations: one loaded model, a prefill copy and a decode copy.

``quantize_state`` turns an NNX state's matmul weights into ``PhaseWeight`` leaves in a
chosen format (norms, biases, the router and the embedding stay as loaded: they are small
or, for the embedding, a lookup table). Inside the jitted program ``dense_state`` turns
them back into arrays of the model's dtype just before use; XLA sees the stored bytes as
the program's inputs, so each phase reads its own representation from memory.

Weights are viewed as matrices [..., K, N] (K = input): 3-D attention weights
[in, heads, x] become [in, heads * x]; the output projection [heads, v, D] becomes
[heads * v, D]; stacked experts [E, K, N] keep their expert axis.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import numpy as np
from flax import nnx

from jaxserve.quant.formats import get_weight_format
from jaxserve.quant.qweight import QuantizedWeight, shardings_for

# Parameter paths (as "/"-joined NNX paths) holding matmul weights.
_MATMUL = re.compile(
    r"(^lm_head$)|(/attn/(q|k|v|o|q_a|q_b|q_proj|kv_a|kv_b)$)|(/mlp/(shared/)?(gate|up|down)$)|(/mlp/w_(gate|up|down)$)"
)
_EXPERTS = re.compile(r"/mlp/w_(gate|up|down)$")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["qw"], meta_fields=["shape"])
@dataclasses.dataclass(frozen=True, eq=False)
class PhaseWeight:
    qw: QuantizedWeight  # the weight as a matrix [..., K, N] in its phase format
    shape: tuple[int, ...]  # the parameter's own shape

    def dense(self, dtype):
        return self.qw.dequantize(dtype).reshape(self.shape)


def matrix_view(path: str, shape: tuple[int, ...], axes: tuple) -> tuple[tuple[int, ...], tuple]:
    """-> (matrix shape [..., K, N], its logical axes)."""
    if _EXPERTS.search(path) or len(shape) == 2:
        return tuple(shape), tuple(axes)
    if path.endswith("/attn/o"):  # [H, v, D]
        return (shape[0] * shape[1], shape[2]), (axes[0], axes[2])
    return (shape[0], math.prod(shape[1:])), (axes[0], axes[1])  # [in, H, x]


def is_matmul_weight(path: str) -> bool:
    return bool(_MATMUL.search(path))


def quantize_state(state, spec: str | None, mesh=None):
    """Copy of `state` with every matmul weight stored in format `spec` (None: unchanged)."""
    if spec is None:
        return state
    fmt = get_weight_format(spec)
    out = []
    for p, var in nnx.to_flat_state(state):
        path = "/".join(str(k) for k in p)
        if not is_matmul_weight(path):
            out.append((p, var))
            continue
        value = var.get_value()
        axes = var.get_metadata().get("logical_axes") or (None,) * value.ndim
        mshape, maxes = matrix_view(path, value.shape, axes)
        w = np.asarray(jax.device_get(value), np.float32).reshape(mshape)
        qw = fmt.quantize(w, name=path)
        if mesh is not None:
            qw = jax.device_put(qw, shardings_for(qw, maxes, mesh, path))
        else:
            qw = jax.device_put(qw)
        out.append((p, var.replace(PhaseWeight(qw, tuple(value.shape)))))
    return nnx.from_flat_state(out)


def dense_state(state, dtype):
    """Inside jit: PhaseWeight leaves -> arrays of `dtype` in the parameter's shape."""
    return jax.tree.map(
        lambda x: x.dense(dtype) if isinstance(x, PhaseWeight) else x,
        state,
        is_leaf=lambda x: isinstance(x, PhaseWeight),
    )


def state_nbytes(state) -> int:
    """Bytes of every array leaf (quantized values and scales included)."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))
