"""The Pallas int4 (W4A16) kernel calls of the ``gpu`` / ``interpret`` matmul paths: which
weights the kernel takes (``plan``: the same answer for the trace and for what the server
reports), and the call itself, on one device or per device under a mesh.

A Pallas kernel is a per-device program (XLA cannot partition its call), so under a mesh
(``sharding.kernel_mesh``, set by the runner while tracing) each device runs the kernel on its
own blocks inside shard_map, by how the weight is split (``QuantizedWeight.specs``):

- ``columns`` (N split: q/k/v, gate/up, the head): every device reads the whole activation
  and its own columns; its output columns are its own (no communication);
- ``rows`` (K split: o_proj, down): every device multiplies its K slice of the activation by
  its rows; the f32 partial sums are added over the mesh (psum), then rounded to bf16 once;
- ``experts`` (E split, expert-parallel MoE): every device runs its own experts on their rows
  (the sorted rows shifted so its first expert's rows come first), other rows are zero, and
  a psum puts every row's one result in place;
- ``replicated``: every device runs the whole call.

A weight the kernel cannot take (a local N that is not a multiple of 16, K split inside a
scale group, scales split differently from the values, ...) is *refused*: ``plan`` says why,
its matmuls run the tile-wise dequantized path instead, and the runner reports the weight
(GetModelInfo, the start-up log, a metric). No exception is caught to fall back.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxserve.quant.qweight import QuantizedWeight
from jaxserve.sharding import MODEL_AXIS, current_kernel_mesh, per_device

S = jax.ShapeDtypeStruct


@dataclasses.dataclass(frozen=True)
class Plan:
    split: str  # "one" (no mesh) | "replicated" | "columns" | "rows" | "experts"
    refused: str | None = None  # why the kernel does not take this weight (None: it does)


def _local(shape, spec, n: int) -> tuple[int, ...]:
    return tuple(d // n if a == MODEL_AXIS else d for d, a in zip(shape, spec))


def _split_of(qw: QuantizedWeight, n: int) -> tuple[str | None, str | None]:
    """-> (the split of the values, a refusal) from ``qw.specs`` and the stored dims."""
    vspec, sspec = qw.specs if qw.specs is not None else ((None,) * qw.values.ndim, None)
    sspec = sspec or (None,) * qw.values.ndim
    split = [i for i, a in enumerate(vspec) if a == MODEL_AXIS]
    if any(a not in (None, MODEL_AXIS) for a in vspec):
        return None, f"values split over mesh axes {vspec}"
    if not split:
        return "replicated", None if all(a is None for a in sspec) else f"scales split {sspec}, values replicated"
    (axis,) = split
    ndim = qw.values.ndim
    if axis == ndim - 2 and (2 * qw.values.shape[-2] // n) % qw.fmt.group:
        return None, (f"a device's block of {2 * qw.values.shape[-2] // n} K rows (of {2 * qw.values.shape[-2]}, "
                      f"split over {n} devices) is not whole scale groups of {qw.fmt.group}")
    if tuple(sspec) != tuple(vspec):
        return None, f"scales split {tuple(sspec)} unlike the values {tuple(vspec)}"
    if axis == ndim - 1:
        return "columns", None
    if axis == ndim - 2 and ndim == 2:
        return "rows", None
    if axis == 0 and ndim == 3:
        return "experts", None
    return None, f"values split on dim {axis} of {ndim}"


def plan(qw: QuantizedWeight, mesh=None) -> Plan:
    """How the kernel runs ``qw`` on ``mesh`` (None: one device), or why it cannot: the
    kernel's own static checks (validate.check_weights) on each device's block shapes."""
    from pallas_kernels.int4_matmul import validate  # only when a gpu / interpret path asks

    n = 1 if mesh is None else mesh.shape[MODEL_AXIS]
    split, refused = ("one", None) if n == 1 else _split_of(qw, n)
    if refused:
        return Plan("refused", refused)
    vspec, sspec = qw.specs if n > 1 else (None, None)
    values = _local(qw.values.shape, vspec, n) if n > 1 else tuple(qw.values.shape)
    scales = _local(qw.scales.shape, sspec, n) if n > 1 else tuple(qw.scales.shape)
    group, experts = qw.fmt.group, (values[0] if len(values) == 3 else None)
    try:
        validate.check_weights(S((1, 2 * values[-2]), jnp.bfloat16), S(values, jnp.uint8), S(scales, qw.scales.dtype),
                               group, experts, tile=group)
    except (TypeError, ValueError) as e:
        where = f" (each of {n} devices' {split} block: values {values})" if n > 1 else ""
        return Plan("refused", f"{e}{where}")
    return Plan(split)


def _pad(x, qw):
    """x [M, K] -> bf16 [M, Kp]: zero columns up to the stored (group-padded) K."""
    kp = 2 * qw.values.shape[-2]
    return jnp.pad(x, ((0, 0), (0, kp - x.shape[1]))).astype(jnp.bfloat16)


def _specs(qw: QuantizedWeight):
    return P(*qw.specs[0]), P(*qw.specs[1])


def dense(x, qw: QuantizedWeight, interpret: bool, p: Plan):
    """x [M, K] @ qw [K, N] -> f32 [M, N] by the kernel, as ``p`` (not refused) says."""
    from pallas_kernels.int4_matmul import int4_matmul

    g, xp = qw.fmt.group, _pad(x, qw)
    call = functools.partial(int4_matmul, group=g, tile=g, interpret=interpret)
    mesh = current_kernel_mesh()
    if p.split == "one" or mesh is None:
        return call(xp, qw.values, qw.scales).astype(jnp.float32)
    vs, ss = _specs(qw)
    if p.split == "columns":
        return per_device(lambda a, v, s: call(a, v, s), mesh, (xp, qw.values, qw.scales), (P(), vs, ss),
                          P(None, MODEL_AXIS)).astype(jnp.float32)
    if p.split == "rows":
        def body(a, v, s):  # this device's K slice: an f32 partial sum, added over the mesh
            return jax.lax.psum(call(a, v, s, out_dtype=jnp.float32), MODEL_AXIS).astype(xp.dtype)

        return per_device(body, mesh, (xp, qw.values, qw.scales), (P(None, MODEL_AXIS), vs, ss),
                          P()).astype(jnp.float32)
    return per_device(call, mesh, (xp, qw.values, qw.scales), (P(), P(), P()), P()).astype(jnp.float32)


def ragged(x, qw: QuantizedWeight, sizes, interpret: bool, p: Plan):
    """x [M, K] sorted by expert @ qw [E, K, N], sizes [E] -> f32 [M, N] by the kernel."""
    from pallas_kernels.int4_matmul import int4_grouped_matmul

    g, xp, sizes = qw.fmt.group, _pad(x, qw), sizes.astype(jnp.int32)
    call = functools.partial(int4_grouped_matmul, group=g, tile=g, interpret=interpret)
    mesh = current_kernel_mesh()
    if p.split == "one" or mesh is None:
        return call(xp, qw.values, qw.scales, sizes).astype(jnp.float32)
    vs, ss = _specs(qw)
    if p.split == "columns":
        return per_device(call, mesh, (xp, qw.values, qw.scales, sizes), (P(), vs, ss, P()),
                          P(None, MODEL_AXIS)).astype(jnp.float32)
    if p.split == "experts":
        return per_device(functools.partial(_own_experts, call=call), mesh, (xp, qw.values, qw.scales, sizes),
                          (P(), vs, ss, P()), P()).astype(jnp.float32)
    return per_device(call, mesh, (xp, qw.values, qw.scales, sizes), (P(),) * 4, P()).astype(jnp.float32)


def _own_experts(x, values, scales, sizes, *, call):
    """One device of an expert-split call: its E/n experts over their rows of x [M, Kp]
    (every device holds all rows, sorted by expert) -> [M, N] with every row in place."""
    local = values.shape[0]
    first = jax.lax.axis_index(MODEL_AXIS) * local
    own = jax.lax.dynamic_slice(sizes, (first,), (local,))
    start = jnp.sum(jnp.where(jnp.arange(sizes.shape[0]) < first, sizes, 0))  # rows of earlier experts
    y = call(jnp.roll(x, -start, axis=0), values, scales, own)  # rows past its own come back 0
    return jax.lax.psum(jnp.roll(y, start, axis=0), MODEL_AXIS)  # one non-zero term per row: exact
