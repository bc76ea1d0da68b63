"""The quantized-weight pytree and the interface every weight format implements.

A weight is ``[..., K, N]`` = ``[..., in, out]`` (our orientation; HF checkpoints store
``[out, in]``), optionally with leading stacked dims such as experts ``[E, K, N]``.
A ``QuantizedWeight`` holds the stored arrays as pytree children (so it passes through
``jit`` and can be sharded) and the format name and the unquantized shape as static aux
data (so two weights of the same format and shape share one compiled program).

Field layouts per format (see the format modules for details):

| format           | values                          | scales (float32)               |
|------------------|---------------------------------|--------------------------------|
| bf16             | bf16  [..., K, N]               | None                           |
| fp8_e4m3         | e4m3  [..., K, N]               | [..., 1, N]     per out channel |
| fp8:block128     | e4m3  [..., K, N]               | [..., ceil(K/128), ceil(N/128)] |
| int4:g<G>        | uint8 [..., ceil(K/G)*G/2, N]   | [..., ceil(K/G), N]             |

Every scale is the multiplier of dequantization: ``w ~= values * scale`` (the same
convention as DeepSeek's ``weight_scale_inv``).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from .sizes import matrix_bytes


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values", "scales"],
                   meta_fields=["format", "shape", "specs"])
@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: no elementwise array comparisons
class QuantizedWeight:
    values: jax.Array | np.ndarray  # stored values, layout per format (table above)
    scales: jax.Array | np.ndarray | None  # float32 dequantization multipliers, or None
    format: str  # canonical registry name, e.g. "int4:g128"
    shape: tuple[int, ...]  # the unquantized weight's shape [..., K, N]
    # How values and scales are split over a mesh (one mesh axis name or None per stored dim):
    # ((values), (scales) or None); None off a mesh. Recorded from the placed arrays
    # (``record_specs``): the per-device kernels (shard_map) read each device's own blocks by it.
    specs: tuple | None = None

    @property
    def fmt(self) -> "WeightFormat":
        return REGISTERED[self.format]  # filled by jaxserve.quant.formats (imported with the package)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return self.fmt.dequantize(self, dtype)

    @property
    def nbytes(self) -> int:
        return self.fmt.nbytes(self)


# Canonical format name -> format: jaxserve.quant.formats registers every format here, so a
# QuantizedWeight finds its format without this module importing the registry module.
REGISTERED: dict[str, "WeightFormat"] = {}


def _arr_nbytes(a) -> int:
    return 0 if a is None else int(math.prod(a.shape)) * np.dtype(a.dtype).itemsize


class WeightFormat:
    """One way of storing a ``[..., K, N]`` weight. Subclasses implement ``quantize`` and
    ``dequantize``; the rest is shared. The matmuls that read a format are registered per
    backend in ``jaxserve.quant.paths`` and called through ``jaxserve.quant.linear``.

    ``scale_block`` says how many weight rows/cols one scale entry covers along K and N
    (0 = the whole dim); it drives the logical-axes rule in ``logical_axes_for``.
    """

    name: str = ""
    scale_block: tuple[int, int] | None = None  # (rows along K, cols along N); None: no scales

    def quantize(self, w) -> QuantizedWeight:
        """w [..., K, N] float (numpy, host side; runs once at load) -> QuantizedWeight."""
        raise NotImplementedError

    def dequantize(self, qw: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
        """-> [..., K, N] in ``dtype``; pure jnp, jittable."""
        raise NotImplementedError

    def padded_k(self, k: int) -> int:
        """Rows of K actually stored (int4 pads K up to a whole number of groups)."""
        return k

    def nbytes(self, qw: QuantizedWeight) -> int:
        """True storage bytes: values plus scales (padding included)."""
        return _arr_nbytes(qw.values) + _arr_nbytes(qw.scales)

    @property
    def size_kind(self) -> tuple[str, int]:
        """(kind, group) for ``jaxserve.quant.sizes.matrix_bytes``."""
        raise NotImplementedError

    def storage_bytes(self, shape, scale_bytes: int = 4) -> int:
        """Bytes a weight of ``shape`` [..., K, N] takes in this format, from its shape alone
        (``matrix_bytes``, the function the capacity planner uses); ``scale_bytes`` 2 for a
        checkpoint's shipped bf16 scales."""
        *lead, k, n = shape
        kind, group = self.size_kind
        return math.prod(lead) * matrix_bytes(kind, k, n, group, scale_bytes)

    def _wrap(self, values, scales, shape) -> QuantizedWeight:
        return QuantizedWeight(values, scales, self.name, tuple(int(d) for d in shape))


def check_weight(w, name: str) -> np.ndarray:
    """Host-side input validation shared by the quantizers: [..., K, N] float -> float32."""
    w = np.asarray(w)
    if w.ndim < 2:
        raise ValueError(f"{name}: weight must be [..., K, N], got shape {w.shape}")
    if not np.issubdtype(w.dtype, np.floating) and w.dtype.name != "bfloat16":
        raise ValueError(f"{name}: weight must be floating point, got {w.dtype}")
    w = w.astype(np.float32)
    if not np.all(np.isfinite(w)):
        raise ValueError(f"{name}: weight has non-finite values")
    return w


def logical_axes_for(qw: QuantizedWeight, field: str, weight_axes) -> tuple:
    """Logical axes of ``qw.<field>`` given the unquantized weight's axes (e.g. ("embed", "mlp")).

    Rule: a stored dim keeps the weight dim's axis when splitting it evenly over devices
    splits the weight dim the same way, i.e. each entry covers a fixed, contiguous run of
    the weight dim and nothing is padded; otherwise the dim is replicated (None). So
    - values keep every axis (int4's packed [K'/2, N] keeps K's axis because each packed
      row pair-tile covers contiguous rows of K; not when K was padded to a group multiple);
    - per-channel scales [..., 1, N] keep N's axis; int4 group scales [K/G, N] keep both;
      128x128 block scales keep an axis only where that dim is a multiple of 128.
    Leading (stacked, e.g. expert) dims always keep their axis. Under jit, a "wrong" axis
    costs communication, never correctness; it matters for per-device kernels (shard_map).
    """
    weight_axes = tuple(weight_axes)
    if len(weight_axes) != len(qw.shape):
        raise ValueError(f"weight_axes {weight_axes} do not match weight shape {qw.shape}")
    if field not in ("values", "scales"):
        raise ValueError(f"unknown QuantizedWeight field {field!r}")
    if field == "scales" and qw.scales is None:
        return None
    *lead, k_axis, n_axis = weight_axes
    *_, k, n = qw.shape
    arr = getattr(qw, field)
    k_stored, n_stored = arr.shape[-2:]  # scale grid (values: the stored rows)
    if field == "values":
        return (*lead, k_axis if qw.fmt.padded_k(k) == k else None, n_axis)
    bk, bn = qw.fmt.scale_block
    k_ok = k_stored > 1 and (bk == 0 or k % bk == 0)
    n_ok = n_stored > 1 and (bn == 0 or n % bn == 0)
    return (*lead, k_axis if k_ok else None, n_axis if n_ok else None)


def shardings_for(qw: QuantizedWeight, weight_axes, mesh, name: str = "") -> QuantizedWeight:
    """A QuantizedWeight-shaped pytree of NamedShardings, for ``jax.device_put(qw, ...)``
    or jit's in_shardings. Uses jaxserve.sharding's rules (errors on uneven splits of the
    values). A scale-grid dim whose length does not divide over the mesh is replicated
    instead: e.g. an fp8 128-block grid has 2 blocks along a 256-wide head axis, which 8
    devices would split into 32 columns each. A small replicated scale costs a little
    memory, never correctness."""
    from jaxserve.sharding import MODEL_AXIS, RULES, named

    size = mesh.shape[MODEL_AXIS]

    def one(field):
        arr = getattr(qw, field)
        if arr is None:
            return None
        axes = logical_axes_for(qw, field, weight_axes)
        if field == "scales":
            axes = tuple(a if RULES.get(a) is None or d % size == 0 else None for a, d in zip(axes, arr.shape))
        return named(mesh, axes, arr.shape, f"{name}.{field}")

    return dataclasses.replace(qw, values=one("values"), scales=one("scales"))


def _spec_of(arr) -> tuple | None:
    sharding = getattr(arr, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if arr is None or spec is None:
        return None
    return tuple(spec) + (None,) * (arr.ndim - len(spec))


def record_specs(qw: QuantizedWeight) -> QuantizedWeight:
    """``qw`` with ``specs`` read from where its arrays are placed (NamedShardings; else None)."""
    values = _spec_of(qw.values)
    if values is None:
        return qw
    return dataclasses.replace(qw, specs=(values, _spec_of(qw.scales)))
