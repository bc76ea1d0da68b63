"""Moving one request's KV pages between two page pools (a prefill and a decode worker).

The sending side gathers the request's pages out of its pool into a fresh array per pool
(the *payload*: an immutable snapshot, so later reuse of the pages cannot change it),
converts them to the receiver's KV format on device (e.g. bf16 -> fp8_e4m3 with a new
per-vector scale) and digests them on device. The receiving side digests what landed and
scatters it into pages of its own choosing, in one program: a digest mismatch writes nothing.

Shapes. Every pool has a page axis (axis 0 for the MLA layout ``[P, S, X]``, axis 1 for the
headed GQA layout ``[KVH, P, S, D]``; ``page_axes`` finds it from the model's own pool shapes).
A payload holds ``n`` pages padded to a page-count bucket ``B`` (``[B, S, X]`` /
``[KVH, B, S, D]``; rows past ``n`` are zero), so the programs compile once per bucket.

Digest. Two uint32 lanes, each a wrapping sum over every stored element (as its unsigned
bits) times an odd multiplier keyed by the element's position and its array: one changed
element always changes both lanes (an odd multiplier is invertible mod 2^32), and moved or
reshaped bytes change them too. It is an integrity check against corruption and mix-ups,
not a cryptographic hash.

Layout signature: one string both sides compute the same way from their pool shapes, format
and page size; a receiver refuses an offer whose signature differs from its own.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kv.formats import KVFormat
from jaxserve.kv.paged import storage_dtype, values_view

SCALE_SUFFIX = "_scale"
PAYLOAD_SHARDING = "whole"  # payloads travel as whole (unsharded) arrays on one device


def page_axes(shapes_1, shapes_2):
    """Pools shaped for 1 and for 2 pages (``jax.eval_shape`` of ``init_kv``) -> the page axis
    of every pool (same pytree structure)."""

    def axis(a, b):
        diff = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
        if len(diff) != 1:
            raise ValueError(f"cannot find the page axis of a pool shaped {a.shape} / {b.shape}")
        return diff[0]

    return jax.tree.map(axis, shapes_1, shapes_2)


def pool_shapes(init_kv, fmt: KVFormat, page_size: int):
    """Abstract pools of ``init_kv(num_pages, page_size, fmt)`` for 1 and 2 pages."""
    return (jax.eval_shape(lambda: init_kv(1, page_size, fmt)), jax.eval_shape(lambda: init_kv(2, page_size, fmt)))


def layout_signature(architecture: str, shapes_1, axes, fmt: KVFormat, page_size: int) -> str:
    """A KV layout as one string: layers, page size, every pool's shape (P for the page axis)
    and storage dtype (heads, dims and scale layout follow from them), format and sharding.
    Runs of identical layers are written once with a count."""
    layers = []
    for pools, ax in zip(shapes_1, axes):
        parts = []
        for name in sorted(pools):
            dims = ["P" if i == ax[name] else str(d) for i, d in enumerate(pools[name].shape)]
            parts.append(f"{name}:{jnp.dtype(pools[name].dtype).name}[{','.join(dims)}]")
        layers.append(" ".join(parts))
    runs: list[list] = []
    for spec in layers:
        if runs and runs[-1][1] == spec:
            runs[-1][0] += 1
        else:
            runs.append([1, spec])
    body = "; ".join(f"{n}x{{{spec}}}" for n, spec in runs)
    scale = "per_vector_f32" if fmt.scaled else "none"
    return (f"kv1 arch={architecture} layers={len(layers)} page_size={page_size} format={fmt.name} "
            f"scales={scale} sharding={PAYLOAD_SHARDING} pools={body}")


def payload_specs(shapes_1, axes, num_pages: int) -> list[jax.ShapeDtypeStruct]:
    """The payload of ``num_pages`` (bucketed) pages: one ShapeDtypeStruct per pool, in the
    pytree's leaf order (layers, then pool names sorted)."""

    def spec(s, ax):
        shape = list(s.shape)
        shape[ax] = num_pages
        return jax.ShapeDtypeStruct(tuple(shape), s.dtype)

    return jax.tree.leaves(jax.tree.map(spec, shapes_1, axes))


# ---------------------------------------------------------------------- device functions
def as_u32(x):
    """Stored bits as uint32 (floats of 32 bits bit-cast; narrower unsigned containers widened)."""
    if x.dtype == jnp.uint32:
        return x
    if jnp.dtype(x.dtype).itemsize == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if jnp.issubdtype(x.dtype, jnp.unsignedinteger):
        return x.astype(jnp.uint32)
    bits = {1: jnp.uint8, 2: jnp.uint16}[jnp.dtype(x.dtype).itemsize]
    return jax.lax.bitcast_convert_type(x, bits).astype(jnp.uint32)


DIGEST_MULT = (np.uint32(0x9E3779B1), np.uint32(0x85EBCA77))
DIGEST_SALT = (np.uint32(0x7F4A7C15), np.uint32(0xC2B2AE3D))


def digest(leaves) -> jax.Array:
    """uint32 [2]: the position-keyed checksum of a list of arrays (see the module docstring)."""
    lanes = [jnp.uint32(0), jnp.uint32(0)]
    for k, leaf in enumerate(leaves):
        u = as_u32(leaf).reshape(-1)
        pos = jnp.arange(u.shape[0], dtype=jnp.uint32) + jnp.uint32((k * 0x632BE5AB) & 0xFFFFFFFF)
        for lane in range(2):
            mult = (pos * DIGEST_MULT[lane] + DIGEST_SALT[lane]) | jnp.uint32(1)
            lanes[lane] = lanes[lane] + jnp.sum(u * mult, dtype=jnp.uint32)
    return jnp.stack(lanes)


def digest_hex(d) -> str:
    """A device digest (uint32 [2]) as the 16 hex digits the manifest carries."""
    a = np.asarray(d, np.uint32)
    return f"{int(a[0]):08x}{int(a[1]):08x}"


def parse_digest(text: str) -> np.ndarray:
    """The manifest's 16 hex digits -> uint32 [2]; ValueError if malformed."""
    if len(text) != 16:
        raise ValueError(f"a KV digest is 16 hex digits, got {text!r}")
    return np.array([int(text[:8], 16), int(text[8:], 16)], np.uint32)


def _rows_mask(ndim: int, axis: int, bucket: int, n) -> jax.Array:
    shape = [1] * ndim
    shape[axis] = bucket
    return (jnp.arange(bucket) < n).reshape(shape)


def gather_convert(pools, pages, n, src: KVFormat, dst: KVFormat, axes, dst_axes):
    """Gather ``pages`` (int32 [B], the first ``n`` real) of every pool, convert them from
    ``src`` to ``dst`` and zero the padding rows -> (payload pools, digest uint32 [2]).

    Same format: the stored bits are copied unchanged. Otherwise each vector is dequantized to
    float32 and quantized by ``dst`` (a fresh per-vector scale for a scaled format).
    axes / dst_axes: the page axis of every pool in ``src`` / ``dst``."""
    out = []
    for layer, ax, dax in zip(pools, axes, dst_axes):
        new = {}
        for name in layer:
            if name.endswith(SCALE_SUFFIX):
                continue
            a = ax[name]
            q = jnp.take(layer[name], pages, axis=a)
            if src == dst:
                new[name] = q
                if src.scaled:
                    new[name + SCALE_SUFFIX] = jnp.take(layer[name + SCALE_SUFFIX], pages, axis=a)
                continue
            scale = jnp.take(layer[name + SCALE_SUFFIX], pages, axis=a) if src.scaled else None
            x = src.dequantize(values_view(q, src), scale, jnp.float32)
            q2, s2 = dst.quantize(x)
            new[name] = jax.lax.bitcast_convert_type(q2, storage_dtype(dst)) if q2.dtype != storage_dtype(dst) else q2
            if s2 is not None:
                new[name + SCALE_SUFFIX] = s2
        for name in new:
            a = dax[name]
            mask = _rows_mask(new[name].ndim, a, pages.shape[0], n)
            new[name] = jnp.where(mask, new[name], jnp.zeros((), new[name].dtype))
        out.append(new)
    out = tuple(out)
    return out, digest(jax.tree.leaves(out))


def verify_scatter(pools, payload, pages, expected, axes):
    """Digest ``payload`` and, only if it equals ``expected`` (uint32 [2]), write it into
    ``pools`` at ``pages`` (int32 [B]; entries >= the pool's page count are padding and are
    dropped) -> (pools, ok bool, digest uint32 [2])."""
    got = digest(jax.tree.leaves(payload))
    ok = jnp.all(got == expected)
    out = []
    for layer, data, ax in zip(pools, payload, axes):
        new = dict(layer)
        for name, x in data.items():
            a = ax[name]
            num_pages = layer[name].shape[a]
            idx = jnp.where(ok, pages, num_pages)
            at = (slice(None),) * a + (idx,)
            new[name] = layer[name].at[at].set(x.astype(layer[name].dtype), mode="drop")
        out.append(new)
    return tuple(out), ok, got


# ---------------------------------------------------------------------- payloads
@dataclasses.dataclass
class KvPayload:
    """A request's KV pages in transit: ``leaves`` (one array per pool, in leaf order, the page
    axis bucketed to ``bucket``), of which the first ``num_pages`` pages are real."""

    fmt: str
    num_pages: int
    bucket: int
    leaves: list
    digest: object = None  # uint32 [2] (device or host) over the bucketed leaves, when known
    token_ids: list | None = None  # the tokens whose KV the pages hold (set by the exporting engine)

    @property
    def nbytes(self) -> int:
        """Bytes of the real pages (what the grpc stream carries)."""
        return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize * self.num_pages // self.bucket
                   for x in self.leaves)


def to_bytes(payload: KvPayload, leaf_axes: list[int]) -> bytes:
    """The real pages of every leaf, as raw bytes in leaf order (the grpc stream's payload)."""
    parts = []
    for x, ax in zip(jax.device_get(payload.leaves), leaf_axes):
        a = np.asarray(x)
        parts.append(np.ascontiguousarray(np.take(a, np.arange(payload.num_pages), axis=ax)).tobytes())
    return b"".join(parts)


def from_bytes(data: bytes, specs: list, leaf_axes: list[int], num_pages: int, fmt: str) -> KvPayload:
    """Host bytes of ``num_pages`` real pages -> a payload padded to the specs' bucket.
    ValueError if the byte count does not match the layout."""
    leaves, at = [], 0
    bucket = specs[0].shape[leaf_axes[0]] if specs else 0
    for spec, ax in zip(specs, leaf_axes):
        shape = list(spec.shape)
        shape[ax] = num_pages
        size = int(np.prod(shape)) * np.dtype(spec.dtype).itemsize
        if at + size > len(data):
            raise ValueError(f"KV payload too short: {len(data)} bytes")
        real = np.frombuffer(data, dtype=spec.dtype, count=int(np.prod(shape)), offset=at).reshape(shape)
        pad = [(0, 0)] * len(shape)
        pad[ax] = (0, spec.shape[ax] - num_pages)
        leaves.append(np.pad(real, pad))
        at += size
    if at != len(data):
        raise ValueError(f"KV payload has {len(data)} bytes, the layout needs {at}")
    return KvPayload(fmt, num_pages, bucket, leaves)
