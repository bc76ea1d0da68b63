"""Device mesh and the logical-axis -> mesh-axis rules.

One mesh axis, ``model``, over N devices: attention is tensor-parallel over heads, dense
MLPs over their intermediate width, routed experts are expert-parallel (whole experts per
device), the vocabulary is split for the embedding and the LM head, and the MLA latent
cache is replicated (every head reads the whole latent). XLA's SPMD partitioner inserts
the collectives. A dimension that does not divide evenly over the mesh is an error, not a
silent replication, with two exceptions, both as vLLM does: KV heads are replicated when they
do not divide, and the vocabulary is zero-padded at load to a multiple of the devices
(``config_for_mesh``, ``pad_vocab``); the model cuts the padded ids' logits off, so they are
never sampled and never appear in log-probs.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.config import ModelConfig

MODEL_AXIS = "model"

# logical axis name -> mesh axis (None = replicated)
RULES: dict[str | None, str | None] = {
    "heads": MODEL_AXIS,
    "kv_heads": MODEL_AXIS,
    "mlp": MODEL_AXIS,
    "expert": MODEL_AXIS,
    "vocab": MODEL_AXIS,
    "embed": None,
    None: None,
}


class ShardingError(ValueError):
    pass


def make_mesh(num_devices: int) -> Mesh:
    """The first ``num_devices`` of ``jax.devices()``: under ``jax.distributed`` those are every
    process's devices (process 0's first), so one mesh spans the processes."""
    devices = jax.devices()
    if num_devices < 1:
        raise ShardingError(f"num_devices must be >= 1, got {num_devices}")
    if num_devices > len(devices):
        raise ShardingError(
            f"num_devices={num_devices} but only {len(devices)} {devices[0].platform} device(s) are visible "
            "(on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before importing jax)"
        )
    return Mesh(np.array(devices[:num_devices]), (MODEL_AXIS,))


def padded_vocab_size(vocab_size: int, mesh: Mesh | None) -> int:
    """The vocabulary rounded up to a multiple of the devices it is split over (no mesh: as is)."""
    n = 1 if mesh is None else mesh.shape[MODEL_AXIS]
    return -(-vocab_size // n) * n


def config_for_mesh(cfg: ModelConfig, mesh: Mesh | None) -> ModelConfig:
    """`cfg` with its vocabulary padded to split evenly over `mesh` (unchanged if it already does)."""
    rows = padded_vocab_size(cfg.vocab_size, mesh)
    return cfg if rows == cfg.vocab_size else dataclasses.replace(cfg, padded_vocab_size=rows)


def unpadded_shape(cfg: ModelConfig, shape, logical_axes) -> tuple[int, ...]:
    """A parameter's shape as a checkpoint stores it: the "vocab" dim without padding."""
    axes = tuple(logical_axes or (None,) * len(shape))
    return tuple(cfg.vocab_size if a == "vocab" else int(d) for d, a in zip(shape, axes))


def pad_vocab(arr: np.ndarray, logical_axes, shape, name: str = "") -> np.ndarray:
    """Zero-pad ``arr``'s "vocab" dimension up to ``shape``'s (the model's padded parameter).

    Any other difference is an error: only the vocabulary is ever padded."""
    axes = tuple(logical_axes or ())
    if tuple(arr.shape) == tuple(shape):
        return arr
    if "vocab" not in axes or len(arr.shape) != len(shape):
        raise ShardingError(f"{name}: shape {tuple(arr.shape)} cannot be padded to {tuple(shape)}")
    i = axes.index("vocab")
    extra = shape[i] - arr.shape[i]
    if extra < 0 or any(a != b for j, (a, b) in enumerate(zip(arr.shape, shape)) if j != i):
        raise ShardingError(f"{name}: shape {tuple(arr.shape)} cannot be padded to {tuple(shape)}")
    widths = [(0, extra if j == i else 0) for j in range(arr.ndim)]
    return np.pad(np.asarray(arr), widths)


def spec_for(logical_axes, shape, mesh: Mesh, name: str = "") -> PartitionSpec:
    size = mesh.shape[MODEL_AXIS]
    used: set[str] = set()
    out = []
    for dim, axis in zip(shape, logical_axes):
        if axis not in RULES:
            raise ShardingError(f"no sharding rule for logical axis {axis!r} of {name}")
        mesh_axis = RULES[axis]
        if mesh_axis is None or size == 1 or mesh_axis in used:
            out.append(None)
            continue
        if dim % size and axis == "kv_heads":
            # Fewer KV heads than devices (or not a multiple): every device keeps all KV heads,
            # as vLLM does; the query heads are still split.
            out.append(None)
            continue
        if dim % size:
            raise ShardingError(f"{name}: dimension {axis!r} of size {dim} does not divide over {size} devices")
        used.add(mesh_axis)
        out.append(mesh_axis)
    return PartitionSpec(*out)


def named(mesh: Mesh, logical_axes, shape, name: str = "") -> NamedSharding:
    return NamedSharding(mesh, spec_for(logical_axes, shape, mesh, name))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def place(arr, sharding: NamedSharding, dtype=None) -> jax.Array:
    """A host array (e.g. a memory-mapped checkpoint tensor) on ``sharding``, as ``dtype``.

    On a mesh over several processes each process reads and converts only the slices its
    own devices hold (``jax.make_array_from_callback``): no host holds a full copy of a
    sharded weight, and a memory-mapped tensor's other slices are never read."""
    if sharding.is_fully_addressable:
        return jax.device_put(np.asarray(arr) if dtype is None else np.asarray(arr).astype(dtype), sharding)
    dtype = np.dtype(dtype or arr.dtype)
    return jax.make_array_from_callback(tuple(arr.shape), sharding,
                                        lambda index: np.ascontiguousarray(arr[index], dtype=dtype))


# ----------------------------------------------------------------------------- per-device kernels
# A Pallas kernel is a per-device program: XLA cannot partition its call, so under a mesh every
# kernel call runs inside shard_map on each device's shards. The mesh the kernels of a program
# run over is a trace-time setting (the runner sets it around tracing, as the matmul backend).
_KERNEL_MESH = contextvars.ContextVar("jaxserve_kernel_mesh", default=None)


@contextlib.contextmanager
def kernel_mesh(mesh: Mesh | None):
    """Trace the kernel calls inside per device over ``mesh`` (None: one device)."""
    token = _KERNEL_MESH.set(mesh)
    try:
        yield
    finally:
        _KERNEL_MESH.reset(token)


def current_kernel_mesh() -> Mesh | None:
    """The mesh set by ``kernel_mesh`` (None outside it, or for a 1-device mesh)."""
    mesh = _KERNEL_MESH.get()
    return mesh if mesh is not None and mesh.shape[MODEL_AXIS] > 1 else None


def per_device(body, mesh: Mesh, args, in_specs, out_specs):
    """``body(*args)`` per device over ``mesh`` (axis ``MODEL_AXIS``) with shard_map: each device
    gets the blocks ``in_specs`` give it. A context mesh of the same shape (an abstract
    target-device mesh while lowering for another platform) stands in for ``mesh``: shard_map
    requires the two to agree."""
    ctx = jax.sharding.get_abstract_mesh() if hasattr(jax.sharding, "get_abstract_mesh") else None
    if ctx is not None and not ctx.empty:
        if dict(ctx.shape) != dict(mesh.shape):
            raise ValueError(f"the context mesh {dict(ctx.shape)} does not match the model's mesh {dict(mesh.shape)}")
        mesh = ctx
    if hasattr(jax, "shard_map"):
        f = jax.shard_map(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs, check_vma=False)
    else:  # older jax
        from jax.experimental.shard_map import shard_map

        f = shard_map(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs, check_rep=False)
    return f(*args)
