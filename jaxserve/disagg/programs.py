"""The jitted programs of a KV handoff, one per page-count bucket: export (gather a request's
pages, convert them to a target KV format, digest) and import (digest, then scatter into the
pool only if the digest matches), and ``HandoffCalls``, the runner's component that runs them on
its pools (mirrored over several processes, counted by the recompilation guard); see
``jaxserve.kv.handoff`` for the device functions, layouts and digest.
"""
from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.executor.buckets import handoff_buckets, pick_bucket
from jaxserve.kv import handoff
from jaxserve.kv.formats import KVFormat, get_kv_format, kv_format_names
from jaxserve.kv.handoff import KvPayload, digest_hex
from jaxserve.sharding import place, replicated


class HandoffPrograms:
    """init_kv: the model's ``init_kv``; fmt: the pool's format; max_pages: the most pages one
    request can hold (the largest bucket)."""

    def __init__(self, init_kv, architecture: str, fmt: KVFormat, page_size: int, max_pages: int, mesh=None,
                 spans_processes: bool = False):
        self.fmt, self.page_size, self.architecture = fmt, page_size, architecture
        # Over several processes an export's payload is gathered onto every device (a pool
        # split by KV head has other processes' heads), so process 0 holds all of it.
        self._out = replicated(mesh) if spans_processes else None
        self.spans_processes = spans_processes
        self.buckets = handoff_buckets(max_pages)
        self._shapes = {name: handoff.pool_shapes(init_kv, get_kv_format(name), page_size) for name in kv_format_names()}
        self._axes = {name: handoff.page_axes(*shapes) for name, shapes in self._shapes.items()}
        self.axes = self._axes[fmt.name]  # the page axis of every pool of this engine
        self._jitted: dict = {}

    def bucket(self, num_pages: int) -> int:
        if num_pages > self.buckets[-1]:
            raise ValueError(f"{num_pages} pages exceed the largest handoff bucket {self.buckets[-1]}")
        return pick_bucket(num_pages, self.buckets)

    def layout(self, fmt: str | None = None) -> str:
        """The layout signature of this model's pools in ``fmt`` (default: the pool's own)."""
        f = get_kv_format(fmt or self.fmt.name)
        return handoff.layout_signature(self.architecture, self._shapes[f.name][0], self._axes[f.name], f,
                                        self.page_size)

    def format_for_layout(self, layout: str) -> str | None:
        """The KV format whose layout signature is ``layout`` ('' = the pool's own); None if none."""
        if not layout:
            return self.fmt.name
        return next((name for name in kv_format_names() if self.layout(name) == layout), None)

    def specs(self, fmt: str, num_pages: int) -> list[jax.ShapeDtypeStruct]:
        """The payload of ``num_pages`` pages in ``fmt``, bucketed: one spec per pool."""
        f = get_kv_format(fmt).name
        return handoff.payload_specs(self._shapes[f][0], self._axes[f], self.bucket(num_pages))

    def leaf_axes(self, fmt: str | None = None) -> list[int]:
        """The page axis of every payload leaf in ``fmt`` (default the pool's own), in leaf order."""
        return jax.tree.leaves(self._axes[get_kv_format(fmt or self.fmt.name).name])

    # ------------------------------------------------------------------ programs
    def _export_fn(self, dst: str):
        key = ("export", dst)
        if key not in self._jitted:
            src, axes, target = self.fmt, self.axes, get_kv_format(dst)
            dst_axes = self._axes[target.name]

            def export(kv, pages, n):
                payload, d = handoff.gather_convert(kv, pages, n, src, target, axes, dst_axes)
                return jax.tree.leaves(payload), d

            self._jitted[key] = jax.jit(export, out_shardings=self._out) if self._out else jax.jit(export)
        return self._jitted[key]

    def _import_fn(self):
        if "import" not in self._jitted:
            axes, shapes = self.axes, self._shapes[self.fmt.name][0]

            def import_(kv, leaves, pages, expected):
                payload = jax.tree.unflatten(jax.tree.structure(shapes), leaves)
                return handoff.verify_scatter(kv, payload, pages, expected, axes)

            self._jitted["import"] = jax.jit(import_, donate_argnums=(0,))
        return self._jitted["import"]

    def export(self, kv, pages: list[int], dst: str) -> handoff.KvPayload:
        """The pages ``pages`` of ``kv`` converted to ``dst`` (a KV format name), digested."""
        dst = get_kv_format(dst).name
        b = self.bucket(len(pages))
        idx = np.zeros(b, np.int32)
        idx[: len(pages)] = pages
        leaves, d = self._export_fn(dst)(kv, jnp.asarray(idx), jnp.int32(len(pages)))
        if self.spans_processes:  # replicated: this process's own copy
            leaves, d = [x.addressable_data(0) for x in leaves], d.addressable_data(0)
        return handoff.KvPayload(dst, len(pages), b, leaves, d)

    def import_(self, kv, num_pool_pages: int, pages: list[int], payload: handoff.KvPayload, expected):
        """-> (kv, ok, digest): ``payload`` written at ``pages`` if its digest is ``expected``
        (its arrays are placed as the pools are, e.g. split by KV head under a mesh)."""
        if payload.fmt != self.fmt.name or payload.num_pages != len(pages):
            raise ValueError(f"a {payload.fmt} payload of {payload.num_pages} pages cannot fill {len(pages)} "
                             f"{self.fmt.name} pages")
        idx = np.full(payload.bucket, num_pool_pages, np.int32)
        idx[: len(pages)] = pages
        if self.spans_processes:  # every process places its own devices' slices of the same host payload
            leaves = [place(np.asarray(x), pool.sharding) for x, pool in zip(payload.leaves, jax.tree.leaves(kv))]
        else:
            leaves = [jax.device_put(x, pool.sharding) for x, pool in zip(payload.leaves, jax.tree.leaves(kv))]
        return self._import_fn()(kv, leaves, jnp.asarray(idx), jnp.asarray(expected, jnp.uint32))

    def compiled(self) -> int:
        """Programs compiled so far (every bucket of every variant)."""
        return sum(f._cache_size() for f in self._jitted.values())


class HandoffCalls:
    """The KV handoff calls on the runner's pools (``state.kv``): its ``HandoffPrograms`` run
    them, ``guard`` counts a compilation after warm-up. Over several processes each call is
    first sent to the others (``mirror``: "export", "import" with the payload's arrays,
    "handoff_warmup"), as the program steps are, so every process runs the same programs on its
    shards."""

    def __init__(self, programs: HandoffPrograms, state, guard, mirror, num_pages: int):
        self.programs, self.state, self.guard, self.mirror, self.num_pages = programs, state, guard, mirror, num_pages

    def export_pages(self, pages: list[int], fmt: str) -> KvPayload:
        """A request's pages gathered out of the pool, converted to KV format ``fmt`` and
        digested on device (``HandoffPrograms.export``): a snapshot, the pool is not changed."""
        self.mirror("export", (np.asarray(pages, np.int32),), {"fmt": fmt})
        return self._counted(lambda: self.programs.export(self.state.kv, pages, fmt), "KV export")

    def import_pages(self, pages: list[int], payload: KvPayload, expected) -> tuple[bool, str]:
        """Write ``payload`` into ``pages`` if its digest on device equals ``expected`` (uint32
        [2]); -> (ok, the digest found, as hex). A mismatch writes nothing."""
        if self.mirror.on:
            self.mirror("import", (np.asarray(pages, np.int32), np.asarray(expected, np.uint32),
                                   *(np.asarray(x) for x in payload.leaves)),
                        {"fmt": payload.fmt, "num_pages": payload.num_pages, "bucket": payload.bucket})

        def run():
            self.state.kv, ok, got = self.programs.import_(self.state.kv, self.num_pages, pages, payload, expected)
            return bool(ok), digest_hex(got)

        return self._counted(run, "KV import")

    def _counted(self, fn, what: str):
        return self.guard.counted(fn, self.programs.compiled, what)

    def warmup(self, export_formats: list[str], imports: bool) -> None:
        """Compile the KV export (to each of ``export_formats``) and import programs, every
        page-count bucket (the all-null page lists write nothing)."""
        self.mirror("handoff_warmup", (), {"formats": list(export_formats), "imports": bool(imports)})
        kv_fmt, n = self.programs.fmt.name, self.num_pages
        for b in self.programs.buckets:
            pages = [0] * b
            for fmt in export_formats:
                payload = self.programs.export(self.state.kv, pages, fmt)
            if imports:
                payload = self.programs.export(self.state.kv, pages, kv_fmt)
                self.state.kv, _, _ = self.programs.import_(self.state.kv, n, [n] * b, payload, np.zeros(2, np.uint32))


def weights_digest(leaves) -> str:
    """sha256 over every array's index, dtype and device digest (``array_digest``): the same
    for the same weights whatever the mesh and the processes (each device hashes its own
    blocks; the sums are added over the mesh), and zero padding (the vocabulary padded for a
    mesh) adds nothing. A collective over the arrays' devices: every process calls it."""
    h = hashlib.sha256()
    for i, leaf in enumerate(leaves):
        d = np.asarray(_local(_digest_fn(leaf)(leaf)), np.uint32)
        h.update(f"{i}:{np.dtype(leaf.dtype).name}:{int(d[0]):08x}{int(d[1]):08x};".encode())
    return h.hexdigest()


def _local(x):
    return x if x.is_fully_addressable else x.addressable_data(0)


_DIGEST_FNS: dict = {}


def _digest_fn(leaf):
    """``array_digest`` jitted (one program per leaf shape, so a model's layers share a few); its
    result replicated where the leaf spans processes, so every process holds it."""
    mesh = None if getattr(leaf, "is_fully_addressable", True) else leaf.sharding.mesh
    if mesh not in _DIGEST_FNS:
        _DIGEST_FNS[mesh] = jax.jit(array_digest, out_shardings=replicated(mesh) if mesh is not None else None)
    return _DIGEST_FNS[mesh]


_AXIS_KEY = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1, 0xD3A2646C)


def array_digest(x) -> jax.Array:
    """uint32 [2]: sum over elements of bits * key(position), keyed by the element's index on
    each axis (not its flat offset), so appending zeros along an axis changes nothing."""
    u = handoff.as_u32(x)
    pos = jnp.zeros(u.shape, jnp.uint32)
    for d in range(u.ndim):
        pos = pos + jax.lax.broadcasted_iota(jnp.uint32, u.shape, d) * jnp.uint32(_AXIS_KEY[d % len(_AXIS_KEY)])
    lanes = [jnp.sum(u * ((pos * m + s) | jnp.uint32(1)), dtype=jnp.uint32)
             for m, s in zip(handoff.DIGEST_MULT, handoff.DIGEST_SALT)]
    return jnp.stack(lanes)
