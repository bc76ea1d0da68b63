"""The decode attention backends beside XLA: the Pallas paged-attention kernels (GPU, or
interpreted on CPU for tests), on one device or per device under a mesh (shard_map over the
query heads).

The step has already written its new token's K/V into its page, so the kernel attends over
the row's cached context and that token (ctx_len = cached + new): the new token is seen as
the cache stores it (rounded / quantized by the KV format), exactly as every later step will
see it, so decode numbers do not depend on the schedule.
"""
from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec as P

from jaxserve.kv import paged
from jaxserve.sharding import MODEL_AXIS

BACKENDS = ("xla", "pallas", "pallas_interpret")


def mla_decode_pallas(q_lat, q_rope, kv, fmt, step, scale: float, interpret: bool, mesh=None):
    """q_lat [B, 1, H, R], q_rope [B, 1, H, Dr] -> [B, 1, H, R] over pages holding the new token.

    Under a ``mesh`` the kernel runs per device on its query heads (the latent pools are
    replicated); see ``_decode_on_mesh``.
    """
    scales = (kv["latent_scale"], kv["rope_scale"]) if "latent_scale" in kv else ()
    args = (q_lat[:, 0], q_rope[:, 0], step.page_table, step.cached_lens + step.new_lens,
            paged.values_view(kv["latent"], fmt), paged.values_view(kv["rope"], fmt), *scales)
    body = functools.partial(_mla_decode, scale=scale, interpret=interpret)
    if mesh is None:
        return body(*args)[:, None]
    n, h = mesh.shape[MODEL_AXIS], q_lat.shape[2]
    heads = P(None, MODEL_AXIS) if h % n == 0 else P()  # else (never under the weight rules) replicated
    return _decode_on_mesh(body, mesh, args, (heads, heads) + (P(),) * (len(args) - 2), heads)[:, None]


def _mla_decode(ql, qr, page_table, lens, lat_pool, rope_pool, *scales, scale, interpret):
    """One device's (or the only) MLA decode: ql [B, H, R], qr [B, H, Dr] -> [B, H, R]."""
    from pallas_kernels.paged_attention import paged_attention_mla

    ls, rs = scales or (None, None)
    out, _ = paged_attention_mla(ql, qr, lat_pool, rope_pool, ls, rs, page_table, lens, scale=scale,
                                 interpret=interpret)
    return out


def gqa_decode_pallas(q, kv, fmt, step, scale: float, interpret: bool, mesh=None):
    """q [B, 1, H, D] -> [B, 1, H, D] over pages holding the new token.

    Under a ``mesh`` the kernel runs per device on its query heads: with the KV heads split
    over the mesh (K divides over the devices), each device's pools hold exactly its heads'
    KV heads; with replicated pools, each device slices the KV head(s) its query heads read
    (when its heads do not straddle a KV head; else every device runs all heads). The slice
    is of whole pools (the kernel takes no head offset), so XLA may copy one KV head's pool
    per layer and step: no more than the kernel's own reads at a full pool, and less than
    running every KV head on every device.
    """
    scales = (kv["k_scale"], kv["v_scale"]) if "k_scale" in kv else ()
    args = (q[:, 0], step.page_table, step.cached_lens + step.new_lens,
            paged.values_view(kv["k"], fmt), paged.values_view(kv["v"], fmt), *scales)
    if mesh is None:
        return _gqa_decode(*args, scale=scale, interpret=interpret, kv_slice=None)[:, None]
    n, h, k = mesh.shape[MODEL_AXIS], q.shape[2], kv["k"].shape[0]
    g, local = h // k, h // n
    heads = P(None, MODEL_AXIS)
    if k % n == 0:  # pools split by KV head (runner.kv_sharding): each device has its heads' KV heads
        specs, slice_, out = (heads,) + (P(),) * 2 + (P(MODEL_AXIS),) * (len(args) - 3), None, heads
    elif h % n == 0 and (local % g == 0 or g % local == 0):  # replicated pools, query heads split
        specs, slice_, out = (heads,) + (P(),) * (len(args) - 1), (local, g), heads
    else:  # query heads straddle KV heads: every device runs all heads
        specs, slice_, out = (P(),) * len(args), None, P()
    body = functools.partial(_gqa_decode, scale=scale, interpret=interpret, kv_slice=slice_)
    return _decode_on_mesh(body, mesh, args, specs, out)[:, None]


def _gqa_decode(q1, page_table, lens, k_pool, v_pool, *scales, scale, interpret, kv_slice):
    """One device's (or the only) GQA decode: q1 [B, H, D] -> [B, H, D].

    ``kv_slice`` = (local query heads, group): the pools hold every KV head and this device
    reads only those of its query heads (a dynamic slice at its mesh index).
    """
    from pallas_kernels.paged_attention import paged_attention_gqa

    if kv_slice is not None:
        local, g = kv_slice
        count = max(local // g, 1)
        first = jax.lax.axis_index(MODEL_AXIS) * local // g
        take = lambda x: jax.lax.dynamic_slice_in_dim(x, first, count, 0)  # noqa: E731
        k_pool, v_pool = take(k_pool), take(v_pool)
        scales = tuple(take(s) for s in scales)
    ks, vs = scales or (None, None)
    out, _ = paged_attention_gqa(q1, k_pool, v_pool, ks, vs, page_table, lens, scale=scale, interpret=interpret)
    return out


# ----------------------------------------------------------------------------- under a mesh
# The Pallas kernels are per-device programs: XLA cannot partition a kernel call, so under a
# mesh each decode runs inside shard_map (the kernel per device, per head: no communication).
# The runner hands the mesh down with the backend name (``on_mesh``), the one argument every
# attention layer already takes.


class MeshBackend(str):
    """An attention backend name that carries the device mesh its kernels run over; it
    compares and prints as the plain name."""

    mesh = None


def on_mesh(backend: str, mesh) -> str:
    """``backend`` for a model sharded over ``mesh`` (None: single device, the plain name)."""
    if mesh is None:
        return str(backend)
    out = MeshBackend(backend)
    out.mesh = mesh
    return out


def backend_mesh(backend: str):
    """The mesh ``on_mesh`` attached to ``backend`` (None: single device)."""
    return getattr(backend, "mesh", None)


def _decode_on_mesh(body, mesh, args, in_specs, out_specs):
    """``body(*args)`` per device over ``mesh`` (axis ``MODEL_AXIS``). A context mesh of the
    same shape (an abstract target-device mesh while lowering for another platform) stands
    in for ``mesh``: shard_map requires the two to agree."""
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
