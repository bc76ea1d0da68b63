"""Device mesh and the logical-axis -> mesh-axis rules.

One mesh axis, ``model``, over N devices: attention is tensor-parallel over heads, dense
MLPs over their intermediate width, routed experts are expert-parallel (whole experts per
device), the vocabulary is split for the embedding and the LM head, and the MLA latent
cache is replicated (every head reads the whole latent). XLA's SPMD partitioner inserts
the collectives. A dimension that does not divide evenly over the mesh is an error, not a
silent replication (except KV heads, replicated when they do not divide, as in vLLM).
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

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
    devices = jax.devices()
    if num_devices < 1:
        raise ShardingError(f"num_devices must be >= 1, got {num_devices}")
    if num_devices > len(devices):
        raise ShardingError(
            f"num_devices={num_devices} but only {len(devices)} {devices[0].platform} device(s) are visible "
            "(on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before importing jax)"
        )
    return Mesh(np.array(devices[:num_devices]), (MODEL_AXIS,))


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
