"""The attention backends, by name: how a layer attends over the paged KV cache.

Every layer writes its step's new K/V into their pages first, then asks its backend for the
attention of the step's queries over the row's cached context and the step's own tokens, both
as the cache stores them (rounded / quantized by the KV format), so a request's numbers do not
depend on the schedule. A backend is an object with one method per attention layout:

- ``mla(q_lat, q_rope, kv, fmt, new_lat, new_rope, step, scale, page_size)``: absorbed MLA;
- ``mla_sparse(q_lat, q_rope, kv, fmt, new_lat, new_rope, step, select, scale, page_size)``:
  absorbed MLA over only the positions ``select`` int32 [B, T, K] lists per query (DeepSeek
  sparse attention's top-k, causal by construction, -1: none; the step's own chosen tokens are
  read from their pages);
- ``gqa(q, kv, fmt, new_k, new_v, step, scale, page_size)``: grouped-query attention.

``new_*`` are the step's K/V as stored (``paged.as_stored``); a backend may read them from the
pages instead. Backends:

- ``xla``: pure jnp (``attention.*_paged``), one online softmax over pages in fixed position
  blocks (bitwise the same for a request whatever the schedule); sparse MLA gathers the K
  chosen rows per query for steps of at most ``SPARSE_GATHER_MAX_TOKENS`` tokens a row
  (decode), and masks the position blocks with the choice for longer ones (prefill), where a
  gather of [T, K] rows would outweigh one pass over the context;
- ``pallas``: the Pallas paged kernels (GPU, Triton) for the cached context, merged by
  log-sum-exp with the step's own tokens; sparse MLA through the sparse kernel fed each
  query's chosen slots; per device under a mesh (shard_map over heads);
- ``pallas_interpret``: the same kernels interpreted on CPU (tests);
- ``native``: CPU. Grouped-query attention of every step (decode, speculative verify, prefill
  chunks; in batch-invariant mode in query tiles) runs jaxserve's native kernel
  (``jaxserve.native.gqa_paged``: the pools read in their own format, the numbers of the ``xla``
  path, each query computed alone so a position's result does not depend on the batch or T);
  MLA runs the ``xla`` path. Prefill chunks ran the ``xla`` path once (more than 16 queries a
  row): the kernel took an 8 x 96-token prefill step from ~360 to ~220 ms (BENCHMARKS.md,
  "Prefill attention on the native kernel").
  Under a mesh the kernel runs per device on its KV heads (shard_map) where the pools split by
  KV head, else the ``xla`` path runs. The CPU default where the native kernels load.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxserve import native
from jaxserve.models import attention, attention_pallas
from jaxserve.quant.linear import row_tile
from jaxserve.sharding import MODEL_AXIS, per_device

# Queries per attention tile in batch-invariant mode: every prefill bucket is a multiple.
QUERY_TILE = 16


def by_query_tiles(fn, queries, step, select=None):
    """``fn(*queries, step, select)``, in batch-invariant mode (``quant.linear.fixed_row_tiles``)
    one row and up to QUERY_TILE queries at a time, so every attention dot and softmax
    reduction has one shape whatever the batch size or chunk bucket; else one call.
    queries [B, T, ...]; select None or [B, T, S]."""
    if not row_tile():
        return fn(*queries, step, select)
    b, t = queries[0].shape[:2]
    qt = min(t, QUERY_TILE)
    if t % qt:
        raise ValueError(f"batch-invariant attention needs a multiple of {QUERY_TILE} queries, got {t}")
    nt = t // qt
    grid = lambda a: a.reshape(b * nt, 1, qt, *a.shape[2:])  # noqa: E731  (row, tile) major

    def one(args):
        offset, row, qs, sel = args
        # Queries [offset, offset + qt) of one row: the same positions, the same keys.
        tile_step = dataclasses.replace(
            step, tokens=jnp.zeros((1, qt), jnp.int32), page_table=step.page_table[row][None],
            cached_lens=step.cached_lens[row][None] + offset, new_lens=step.new_lens[row][None] - offset)
        return fn(*qs, tile_step, sel)

    offsets = jnp.tile(jnp.arange(nt, dtype=jnp.int32) * qt, b)
    rows = jnp.repeat(jnp.arange(b, dtype=jnp.int32), nt)
    sel = None if select is None else grid(select)
    out = jax.lax.map(one, (offsets, rows, tuple(grid(q) for q in queries), sel))
    return out.reshape(b, t, *out.shape[3:])


SPARSE_GATHER_MAX_TOKENS = 4  # new tokens per row up to which XLA sparse MLA gathers the chosen rows


class XlaAttention:
    name = "xla"

    def mla(self, q_lat, q_rope, kv, fmt, new_lat, new_rope, step, scale: float, page_size: int):
        return self.mla_sparse(q_lat, q_rope, kv, fmt, new_lat, new_rope, step, None, scale, page_size)

    def mla_sparse(self, q_lat, q_rope, kv, fmt, new_lat, new_rope, step, select, scale: float, page_size: int):
        def one(ql, qr, st, sel):
            if sel is None:  # dense
                return attention.mla_attention_paged(ql, qr, kv, fmt, st.page_table, st.cached_lens, st.new_lens,
                                                     scale, page_size)
            if ql.shape[1] <= SPARSE_GATHER_MAX_TOKENS:
                return attention.mla_attention_selected(ql, qr, kv, fmt, st.page_table, sel, scale, page_size)
            mask = attention.selection_mask(sel, st.page_table.shape[1] * page_size)
            return attention.mla_attention_paged(ql, qr, kv, fmt, st.page_table, st.cached_lens, st.new_lens,
                                                 scale, page_size, select=mask)

        return by_query_tiles(one, (q_lat, q_rope), step, select)

    def gqa(self, q, kv, fmt, new_k, new_v, step, scale: float, page_size: int):
        return by_query_tiles(
            lambda qt, st, _: attention.gqa_attention_paged(qt, kv, fmt, st.page_table, st.cached_lens, st.new_lens,
                                                            scale, page_size),
            (q,), step)


@dataclasses.dataclass(frozen=True)
class PallasAttention:
    interpret: bool = False
    mesh: object = None  # the device mesh the kernels run over (None: one device)

    @property
    def name(self) -> str:
        return "pallas_interpret" if self.interpret else "pallas"

    def mla(self, q_lat, q_rope, kv, fmt, new_lat, new_rope, step, scale: float, page_size: int):
        return attention_pallas.mla_attention_pallas(q_lat, q_rope, kv, fmt, new_lat, new_rope, step, scale,
                                                     self.interpret, self.mesh)

    def mla_sparse(self, q_lat, q_rope, kv, fmt, new_lat, new_rope, step, select, scale: float, page_size: int):
        return attention_pallas.mla_sparse_attention_pallas(q_lat, q_rope, kv, fmt, step, select, scale, page_size,
                                                            self.interpret, self.mesh)

    def gqa(self, q, kv, fmt, new_k, new_v, step, scale: float, page_size: int):
        return attention_pallas.gqa_attention_pallas(q, kv, fmt, new_k, new_v, step, scale, self.interpret,
                                                     self.mesh)


@dataclasses.dataclass(frozen=True)
class NativeAttention:
    mesh: object = None  # the device mesh the model runs over (None: one device)
    name = "native"

    def mla(self, q_lat, q_rope, kv, fmt, new_lat, new_rope, step, scale: float, page_size: int):
        return XLA.mla(q_lat, q_rope, kv, fmt, new_lat, new_rope, step, scale, page_size)

    def mla_sparse(self, q_lat, q_rope, kv, fmt, new_lat, new_rope, step, select, scale: float, page_size: int):
        return XLA.mla_sparse(q_lat, q_rope, kv, fmt, new_lat, new_rope, step, select, scale, page_size)

    def gqa(self, q, kv, fmt, new_k, new_v, step, scale: float, page_size: int):
        split = self.kernel_devices(kv["k"].shape[0], q.shape[2])
        if split is None:
            return XLA.gqa(q, kv, fmt, new_k, new_v, step, scale, page_size)

        scales = (kv["k_scale"], kv["v_scale"]) if fmt.scaled else ()
        body = functools.partial(_native_gqa, scale=scale)

        def one(qt, st, _):
            args = (qt, st.page_table, st.cached_lens, st.new_lens, kv["k"], kv["v"], *scales)
            if split == 1:
                return body(*args)
            heads = P(None, None, MODEL_AXIS)
            return per_device(body, self.mesh, args, (heads, P(), P(), P()) + (P(MODEL_AXIS),) * (len(args) - 4),
                              heads)

        if row_tile():  # batch-invariant: every step in the same query tiles
            return by_query_tiles(one, (q,), step).astype(q.dtype)
        return one(q, step, None).astype(q.dtype)

    def kernel_devices(self, kv_heads: int, heads: int):
        """How many devices share the KV heads (1: one device), or None where the kernel cannot
        run (no native kernels; a mesh whose devices do not each hold whole KV heads)."""
        if not native.available():
            return None
        if self.mesh is None or self.mesh.size == 1:
            return 1
        n = dict(self.mesh.shape).get(MODEL_AXIS, 1)
        if self.mesh.size != n or kv_heads % n or heads % n:
            return None
        return n


def _native_gqa(q, page_table, cached_lens, new_lens, k, v, *scales, scale):
    """One device's (or the only) native GQA call; ``scales``: (k_scale, v_scale) for e4m3 pools."""
    k_scale, v_scale = scales or (None, None)
    return native.gqa_paged(q, k, v, k_scale, v_scale, page_table, cached_lens, new_lens, scale)


XLA = XlaAttention()
BACKENDS = {
    "xla": lambda mesh: XLA,
    "native": lambda mesh: NativeAttention(mesh),
    "pallas": lambda mesh: PallasAttention(False, mesh),
    "pallas_interpret": lambda mesh: PallasAttention(True, mesh),
}


def get_backend(name: str, mesh=None):
    """The backend called ``name`` for a model on ``mesh`` (None: one device)."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {tuple(BACKENDS)}, got {name!r}")
    return BACKENDS[name](mesh)


def default_backend() -> str:
    """The attention backend an engine takes when none is named: Pallas kernels on a GPU, the
    native kernels on a CPU where they load, pure jnp (XLA) elsewhere."""
    if jax.default_backend() == "gpu":
        return "pallas"
    return "native" if jax.default_backend() == "cpu" and native.available() else "xla"
