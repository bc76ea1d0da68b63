"""The Pallas attention backend's body: the paged-attention kernels (GPU, or interpreted on
CPU for tests) for the cached context, merged by log-sum-exp with the step's own tokens, on one
device or per device under a mesh (shard_map over the query heads).

The step has already written its own K/V into their pages, and its own tokens are attended to
as stored (the caller passes ``paged.as_stored`` values: what reading them back gives), so the
numbers do not depend on the schedule (to float rounding: the kernel's blocks and the merge
group the sums differently from the XLA path's position blocks).

Prefill and decode take the same path: every query of a step reads all of its row's cached
context (the kernel; no causal mask is needed there) and its own step's tokens causally (a
dense [T, T] block in XLA). The kernels are decode kernels over rows of query heads, so a
prefill chunk's T tokens become more rows: MLA folds them into the head axis (the kernel
blocks heads); GQA orders them under their KV head and, for long chunks, splits the chunk into
blocks of ``GQA_ROWS // group`` tokens that become extra batch rows reading the same pages.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxserve.kv import paged
from jaxserve.sharding import MODEL_AXIS, per_device



GQA_ROWS = 64  # query rows per GQA kernel program (the tokens of a block x the group)


def _own_tokens(scores, new_lens):
    """Causal softmax over a step's own tokens: scores [B, T, H, U] f32 (scaled) -> (p, lse [B, T, H])."""
    t = scores.shape[1]
    valid = jnp.arange(t)[None, :] < new_lens[:, None]  # [B, T]
    mask = jnp.tril(jnp.ones((t, t), bool))[None, :, None, :] & valid[:, None, None, :] & valid[:, :, None, None]
    s = jnp.where(mask, scores, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    return p, lse


def mla_attention_pallas(q_lat, q_rope, kv, fmt, new_lat, new_rope, step, scale: float, interpret: bool, mesh=None):
    """q_lat [B, T, H, R], q_rope [B, T, H, Dr], new_lat [B, T, R], new_rope [B, T, Dr] -> [B, T, H, R].

    Under a ``mesh`` the kernel runs per device on its query heads (the latent pools are
    replicated); see ``_on_mesh``.
    """
    scales = (kv["latent_scale"], kv["rope_scale"]) if "latent_scale" in kv else ()
    args = (q_lat, q_rope, new_lat, new_rope, step.page_table, step.cached_lens, step.new_lens,
            paged.values_view(kv["latent"], fmt), paged.values_view(kv["rope"], fmt), *scales)
    body = functools.partial(_mla, scale=scale, interpret=interpret)
    if mesh is None:
        return body(*args)
    n, h = mesh.shape[MODEL_AXIS], q_lat.shape[2]
    heads = P(None, None, MODEL_AXIS) if h % n == 0 else P()  # else (never under the weight rules) replicated
    return _on_mesh(body, mesh, args, (heads, heads) + (P(),) * (len(args) - 2), heads)


def _mla(ql, qr, new_lat, new_rope, page_table, cached_lens, new_lens, lat_pool, rope_pool, *scales, scale,
         interpret):
    """One device's (or the only) MLA attention: ql [B, T, H, R], qr [B, T, H, Dr] -> [B, T, H, R]."""
    from pallas_kernels.paged_attention import merge_attention, paged_attention_mla

    b, t, h, r = ql.shape
    ls, rs = scales or (None, None)
    out_p, lse_p = paged_attention_mla(ql.reshape(b, t * h, r), qr.reshape(b, t * h, -1), lat_pool, rope_pool, ls, rs,
                                       page_table, cached_lens, scale=scale, interpret=interpret)
    s_new = jnp.einsum("bthr,bur->bthu", ql, new_lat, preferred_element_type=jnp.float32)
    s_new = s_new + jnp.einsum("bthd,bud->bthu", qr, new_rope, preferred_element_type=jnp.float32)
    p, lse_new = _own_tokens(s_new * scale, new_lens)
    out_new = jnp.einsum("bthu,bur->bthr", p, new_lat.astype(jnp.float32))
    out, _ = merge_attention(out_p.reshape(b, t, h, r), lse_p.reshape(b, t, h), out_new.astype(out_p.dtype), lse_new)
    return out


def mla_sparse_attention_pallas(q_lat, q_rope, kv, fmt, step, select, scale: float, page_size: int,
                                interpret: bool, mesh=None):
    """DeepSeek sparse attention: q_lat [B, T, H, R], q_rope [B, T, H, Dr], select int32
    [B, T, K] (each query's chosen positions, -1: none) -> [B, T, H, R].

    Every query is a row of the sparse kernel reading its K chosen slots from the pages (the
    step's own tokens are in the pages and chosen or not like any other), so there is no
    own-token block to merge. Under a ``mesh``, per device on its query heads, as ``mla``.
    """
    from pallas_kernels.paged_attention import physical_slots

    slots = physical_slots(step.page_table, select, page_size, kv["latent"].shape[0])
    scales = (kv["latent_scale"], kv["rope_scale"]) if "latent_scale" in kv else ()
    args = (q_lat, q_rope, slots, paged.values_view(kv["latent"], fmt), paged.values_view(kv["rope"], fmt), *scales)
    body = functools.partial(_mla_sparse, scale=scale, interpret=interpret)
    if mesh is None:
        return body(*args)
    n, h = mesh.shape[MODEL_AXIS], q_lat.shape[2]
    heads = P(None, None, MODEL_AXIS) if h % n == 0 else P()
    return _on_mesh(body, mesh, args, (heads, heads) + (P(),) * (len(args) - 2), heads)


def _mla_sparse(ql, qr, slots, lat_pool, rope_pool, *scales, scale, interpret):
    """One device's sparse MLA: ql [B, T, H, R], qr [B, T, H, Dr], slots [B, T, K] -> [B, T, H, R]."""
    from pallas_kernels.paged_attention import sparse_attention_mla

    b, t, h, r = ql.shape
    ls, rs = scales or (None, None)
    out, _ = sparse_attention_mla(ql.reshape(b * t, h, r), qr.reshape(b * t, h, -1), lat_pool, rope_pool, ls, rs,
                                  slots.reshape(b * t, -1), scale=scale, interpret=interpret)
    return out.reshape(b, t, h, r)


def gqa_attention_pallas(q, kv, fmt, new_k, new_v, step, scale: float, interpret: bool, mesh=None):
    """q [B, T, H, D], new_k/new_v [B, T, K, D] -> [B, T, H, D].

    Under a ``mesh`` the kernel runs per device on its query heads: with the KV heads split
    over the mesh (K divides over the devices), each device's pools hold exactly its heads'
    KV heads; with replicated pools, each device slices the KV head(s) its query heads read
    (when its heads do not straddle a KV head; else every device runs all heads). The slice
    is of whole pools (the kernel takes no head offset), so XLA may copy one KV head's pool
    per layer and step: no more than the kernel's own reads at a full pool, and less than
    running every KV head on every device.
    """
    scales = (kv["k_scale"], kv["v_scale"]) if "k_scale" in kv else ()
    args = (q, new_k, new_v, step.page_table, step.cached_lens, step.new_lens,
            paged.values_view(kv["k"], fmt), paged.values_view(kv["v"], fmt), *scales)
    if mesh is None:
        return _gqa(*args, scale=scale, interpret=interpret, kv_slice=None)
    n, h, k = mesh.shape[MODEL_AXIS], q.shape[2], new_k.shape[2]
    g, local = h // k, h // n
    heads = P(None, None, MODEL_AXIS)
    if k % n == 0:  # pools split by KV head (runner.kv_sharding): each device has its heads' KV heads
        specs, slice_, out = (heads, heads, heads) + (P(),) * 3 + (P(MODEL_AXIS),) * (len(args) - 6), None, heads
    elif h % n == 0 and (local % g == 0 or g % local == 0):  # replicated pools, query heads split
        specs, slice_, out = (heads,) + (P(),) * (len(args) - 1), (local, g), heads
    else:  # query heads straddle KV heads: every device runs all heads
        specs, slice_, out = (P(),) * len(args), None, P()
    body = functools.partial(_gqa, scale=scale, interpret=interpret, kv_slice=slice_)
    return _on_mesh(body, mesh, args, specs, out)


def _gqa(q, kn, vn, page_table, cached_lens, new_lens, k_pool, v_pool, *scales, scale, interpret, kv_slice):
    """One device's (or the only) GQA attention: q [B, T, H, D], kn/vn [B, T, K, D] -> [B, T, H, D].

    ``kv_slice`` = (local query heads, group): the pools and kn/vn hold every KV head and this
    device reads only those of its query heads (a dynamic slice at its mesh index).
    """
    from pallas_kernels.paged_attention import merge_attention

    if kv_slice is not None:
        local, g = kv_slice
        count = max(local // g, 1)
        first = jax.lax.axis_index(MODEL_AXIS) * local // g
        take = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, first, count, axis)  # noqa: E731
        kn, vn = take(kn, 2), take(vn, 2)
        k_pool, v_pool = take(k_pool, 0), take(v_pool, 0)
        scales = tuple(take(s, 0) for s in scales)
    b, t, h, d = q.shape
    group = h // kn.shape[2]
    out_p, lse_p = _gqa_cached(q, k_pool, v_pool, scales, page_table, cached_lens, scale, interpret)
    kr = jnp.repeat(kn, group, axis=2)  # [B, T, H, D]: each query head's KV head
    vr = jnp.repeat(vn, group, axis=2)
    s_new = jnp.einsum("bthd,buhd->bthu", q, kr, preferred_element_type=jnp.float32)
    p, lse_new = _own_tokens(s_new * scale, new_lens)
    out_new = jnp.einsum("bthu,buhd->bthd", p, vr.astype(jnp.float32))
    out, _ = merge_attention(out_p, lse_p, out_new.astype(out_p.dtype), lse_new)
    return out


def _gqa_cached(q, k_pool, v_pool, scales, page_table, cached_lens, scale, interpret):
    """The cached context for q [B, T, H, D] through the decode kernel -> (out [B, T, H, D], lse [B, T, H]).

    The kernel maps query row j to KV head j // (rows per KV head), so the rows go in KV-head
    order: [K, tokens, G]. A chunk longer than GQA_ROWS // G tokens is cut into token blocks,
    each an extra batch row with its sequence's page table and context length.
    """
    from pallas_kernels.paged_attention import paged_attention_gqa

    b, t, h, d = q.shape
    kvh = k_pool.shape[0]
    g = h // kvh
    tb = min(t, max(1, GQA_ROWS // g))
    nb = -(-t // tb)
    qb = jnp.pad(q, ((0, 0), (0, nb * tb - t), (0, 0), (0, 0))).reshape(b, nb, tb, kvh, g, d)
    rows = qb.transpose(0, 1, 3, 2, 4, 5).reshape(b * nb, kvh * tb * g, d)
    ks, vs = scales or (None, None)
    out, lse = paged_attention_gqa(rows, k_pool, v_pool, ks, vs, jnp.repeat(page_table, nb, axis=0),
                                   jnp.repeat(cached_lens, nb, axis=0), scale=scale, interpret=interpret)
    out = out.reshape(b, nb, kvh, tb, g, d).transpose(0, 1, 3, 2, 4, 5).reshape(b, nb * tb, h, d)[:, :t]
    lse = lse.reshape(b, nb, kvh, tb, g).transpose(0, 1, 3, 2, 4).reshape(b, nb * tb, h)[:, :t]
    return out, lse


# ----------------------------------------------------------------------------- under a mesh
# The Pallas kernels are per-device programs: XLA cannot partition a kernel call, so under a
# mesh each step's attention runs inside shard_map (kernel, own-token scores and the merge
# all per device, per head: no communication). The backend object carries the mesh.


def _on_mesh(body, mesh, args, in_specs, out_specs):
    """``body(*args)`` per device over ``mesh`` (``sharding.per_device``)."""
    return per_device(body, mesh, args, in_specs, out_specs)
