"""The one quantized linear op: every matmul weight of every model goes through here.

A weight is a plain array (the checkpoint's dtype, e.g. float32) or a ``PhaseWeight`` (a
``QuantizedWeight`` in a phase's format plus the parameter's own shape). The op takes the
activations and the stored weight (values + scales) and computes in the stored format: it
never builds the whole dense weight. Which formulation runs is looked up in one registry,
``PATHS[(family, backend)]`` (``jaxserve.quant.paths``), by the weight's format family and
the backend the program is traced for:

- ``cpu``: the fastest XLA:CPU formulation measured on this machine (bf16 x bf16 dots,
  int8 x int8 -> int32 dots with per-token int8 activations, tile-wise dequantization for
  the formats XLA:CPU cannot multiply directly);
- ``gpu``: the Pallas int4 kernels (dense and grouped by expert), XLA's native float8 dot,
  int8 and bf16 dots;
- ``interpret``: the GPU formulations run on CPU (Pallas in interpret mode), for tests.

The backend is a trace-time setting: ``use_backend(name)`` around the tracing of a program
(the runner does this per phase); outside it, ``auto`` picks gpu on a GPU host, else cpu.

Public entry points (shapes: ``...`` = leading activation dims):
- ``linear(x, w, contract=1, out_dtype=None)``: x [..., *in] . w [*in, *out] -> [..., *out],
  contracting x's last ``contract`` dims with w's first ``contract`` dims;
- ``expert_linear(x, w, group_sizes)``: x [M, K] sorted by expert . w [E, K, N] -> [M, N];
- ``head_columns(w, per_head, fn)``: MLA's absorbed forms, per tile of whole heads;
- ``matmul`` / ``ragged_matmul``: the same on a bare ``QuantizedWeight`` (2-D / 3-D).
"""
from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.quant.paths import PATHS, Path, dequantize_columns, dequantize_tile, family_of, slice_columns, tile_cols
from jaxserve.quant.qweight import QuantizedWeight

BACKENDS = ("auto", "cpu", "gpu", "interpret")
_BACKEND = contextvars.ContextVar("jaxserve_linear_backend", default="auto")
_ROW_TILE = contextvars.ContextVar("jaxserve_linear_row_tile", default=0)


def resolve_backend(name: str = "auto") -> str:
    """'auto' -> 'gpu' on a GPU host, else 'cpu'; other names are checked and returned."""
    if name not in BACKENDS:
        raise ValueError(f"matmul backend must be one of {BACKENDS}, got {name!r}")
    if name != "auto":
        return name
    return "gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") else "cpu"


@contextlib.contextmanager
def use_backend(name: str):
    """Trace the ops inside with backend ``name`` (a trace-time choice, not a runtime one)."""
    token = _BACKEND.set(resolve_backend(name))
    try:
        yield
    finally:
        _BACKEND.reset(token)


@contextlib.contextmanager
def fixed_row_tiles(rows: int):
    """Trace the matmuls inside as a loop over tiles of ``rows`` rows (0: off), so every dot
    has one shape whatever the batch: a row's result then does not depend on how many other
    rows the program carries (XLA:CPU's dot kernels block by shape, and a row's last bits
    change with the row count). Batch-invariant numerics at the cost of a loop per matmul."""
    token = _ROW_TILE.set(int(rows))
    try:
        yield
    finally:
        _ROW_TILE.reset(token)


def row_tile() -> int:
    """The current fixed row tile (0: matmuls see the whole batch)."""
    return _ROW_TILE.get()


def by_row_tiles(fn, x: jax.Array, *extra: jax.Array) -> jax.Array:
    """``fn(x_tile, *extra_tiles)`` over fixed tiles of x's rows (axis 0) when a row tile is
    set, else ``fn(x, *extra)``. ``fn`` must treat rows independently; ``extra`` arrays are
    tiled along axis 0 with x; ``fn`` may return a pytree of arrays with rows on axis 0."""
    t = _ROW_TILE.get()
    if not t:
        return fn(x, *extra)
    m = x.shape[0]
    n = -(-m // t)
    pad = lambda a: jnp.pad(a, [(0, n * t - m)] + [(0, 0)] * (a.ndim - 1)).reshape(n, t, *a.shape[1:])  # noqa: E731
    y = jax.lax.map(lambda args: fn(*args), (pad(x), *(pad(a) for a in extra)))
    return jax.tree.map(lambda a: a.reshape(n * t, *a.shape[2:])[:m], y)


def ragged_by_row_tiles(fn, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``fn(rows, group_sizes)`` for rows sorted by group, over fixed row tiles when a row tile
    is set: each tile gets the part of every group that falls inside it."""
    group_sizes = group_sizes.astype(jnp.int32)
    t = _ROW_TILE.get()
    if not t:
        return fn(x, group_sizes)
    m = x.shape[0]
    n = -(-m // t)
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    lo = jnp.arange(n, dtype=jnp.int32)[:, None] * t
    sizes = jnp.clip(jnp.minimum(ends[None], lo + t) - jnp.maximum(starts[None], lo), 0)  # [n, E]
    tiles = jnp.pad(x, ((0, n * t - m), (0, 0))).reshape(n, t, x.shape[1])
    y = jax.lax.map(lambda a: fn(*a), (tiles, sizes.astype(jnp.int32)))
    return y.reshape(n * t, -1)[:m]


def current_backend() -> str:
    return resolve_backend(_BACKEND.get())


def path_for(format_name: str | None, backend: str | None = None) -> Path:
    """The registered path for a weight format (None: a plain array) on ``backend``."""
    return PATHS[(family_of(format_name), resolve_backend(backend or current_backend()))]


def describe(format_name: str | None, backend: str | None = None) -> str:
    """'int8 -> cpu:w8a8 (int8 activations per token, int32 accumulation)': for logs and GetModelInfo."""
    p = path_for(format_name, backend)
    return f"{format_name or 'as loaded'} -> {p.name} ({p.numerics})"


def _value(w):
    """A Param (or its value) -> the array or PhaseWeight it holds."""
    return w.get_value() if isinstance(w, nnx.Variable) else w


def _split(w):
    """-> (QuantizedWeight or None, the parameter's shape, the plain array or None)."""
    w = _value(w)
    qw = getattr(w, "qw", None)
    if qw is not None:
        return qw, tuple(w.shape), None
    return None, tuple(w.shape), w


def matmul(x: jax.Array, qw: QuantizedWeight, out_dtype=None, backend: str | None = None) -> jax.Array:
    """x [..., K] @ qw [K, N] -> [..., N] (x's dtype unless ``out_dtype``), on ``backend``
    (None: the current one). The backend is read at trace time and is not part of jit's cache
    key: jit a function per backend (as the runner does per program), or pass it here."""
    if len(qw.shape) != 2:
        raise ValueError(f"matmul takes a 2-D weight, got shape {qw.shape}; use ragged_matmul for experts")
    k, n = qw.shape
    if x.shape[-1] != k:
        raise ValueError(f"matmul: x has {x.shape[-1]} input features, the weight {k}")
    lead = x.shape[:-1]
    path = path_for(qw.format, backend)
    y = by_row_tiles(lambda rows: path.dense(rows, qw), x.reshape(-1, k))
    return y.reshape(*lead, n).astype(out_dtype or x.dtype)


def ragged_matmul(x: jax.Array, qw: QuantizedWeight, group_sizes: jax.Array, out_dtype=None,
                  backend: str | None = None) -> jax.Array:
    """x [M, K] rows sorted by expert, qw [E, K, N], group_sizes int32 [E] -> [M, N].

    Rows past sum(group_sizes) come out as zeros (lax.ragged_dot semantics)."""
    if len(qw.shape) != 3:
        raise ValueError(f"ragged_matmul takes stacked experts [E, K, N], got shape {qw.shape}")
    path = path_for(qw.format, backend)
    y = ragged_by_row_tiles(lambda r, sizes: path.ragged(r, qw, sizes), x, group_sizes)
    return y.astype(out_dtype or x.dtype)


def linear(x: jax.Array, w, contract: int = 1, out_dtype=None) -> jax.Array:
    """x [..., *in] . w [*in, *out] -> [..., *out] (``contract`` = len(in)).

    A plain weight runs as the dot it always was (f32 accumulation); a PhaseWeight runs on
    its format's path, viewed as the matrix [prod(in), prod(out)] it was quantized as."""
    qw, shape, dense = _split(w)
    lead = x.shape[: x.ndim - contract]
    out_shape = shape[contract:]
    k = math.prod(shape[:contract])
    if qw is None:
        rows = x.reshape(-1, k)
        y = by_row_tiles(lambda r: jnp.dot(r, dense.reshape(k, -1), preferred_element_type=jnp.float32), rows)
        return y.reshape(*lead, *out_shape).astype(out_dtype or x.dtype)
    if qw.shape != (k, math.prod(out_shape)):
        raise ValueError(f"linear: weight stored as {qw.shape} cannot serve {shape} contracted over {contract} dims")
    y = matmul(x.reshape(*lead, k), qw, out_dtype=jnp.float32)
    return y.reshape(*lead, *out_shape).astype(out_dtype or x.dtype)


def embedding(tokens: jax.Array, w) -> jax.Array:
    """Rows of the table [V, D] for ``tokens`` [...] -> [..., D]. A tied table stored as the
    head [D, V] in a phase format gathers only the tokens' columns and dequantizes those."""
    w = _value(w)
    if getattr(w, "qw", None) is None:
        return jnp.take(w, tokens, axis=0)
    cols = dequantize_columns(w.qw, tokens.reshape(-1), jnp.float32)  # [D, n]
    return cols.T.reshape(*tokens.shape, w.qw.shape[0])


def tied_head(x: jax.Array, w) -> jax.Array:
    """Logits from a tied table: x [..., D] . table[V, D]^T -> f32 [..., V]."""
    w = _value(w)
    if getattr(w, "qw", None) is None:
        rows = x.reshape(-1, x.shape[-1])
        y = by_row_tiles(lambda r: jnp.dot(r, w.T, preferred_element_type=jnp.float32), rows)
        return y.reshape(*x.shape[:-1], -1)
    return matmul(x, w.qw, out_dtype=jnp.float32)


def expert_linear(x: jax.Array, w, group_sizes: jax.Array) -> jax.Array:
    """Routed experts: x [M, K] sorted by expert, w [E, K, N] -> [M, N] in x's dtype."""
    qw, _, dense = _split(w)
    if qw is None:
        path = path_for(None)
        return ragged_by_row_tiles(lambda r, sizes: path.ragged(r, dense, sizes), x, group_sizes).astype(x.dtype)
    return ragged_matmul(x, qw, group_sizes)


def head_columns(w, per_head: int, fn, heads_per_tile: int | None = None):
    """Apply ``fn(dense_tile [R, h, per_head], h0, h1)`` to tiles of whole heads of a
    [R, H, per_head] weight and concatenate the results along axis ``-2`` of each (the head axis
    of the caller's output). MLA's absorbed W_uk / W_uv contract kv_b over different axes
    per head; a plain weight is one tile, a quantized one is dequantized a tile at a time
    (``paths.tile_cols`` columns), so no whole dense copy exists."""
    qw, shape, dense = _split(w)
    r, h, _ = shape
    if qw is None:
        return fn(dense, 0, h)
    cols = tile_cols(qw)
    hpt = heads_per_tile or max(1, min(h, cols // per_head))
    block = qw.fmt.scale_block[1] if qw.fmt.scale_block else 1
    while hpt < h and (hpt * per_head) % max(block, 1):  # tiles must start on a scale block
        hpt += 1
    outs = []
    for h0 in range(0, h, hpt):
        h1 = min(h, h0 + hpt)
        tile = slice_columns(qw, h0 * per_head, h1 * per_head)
        outs.append(fn(dequantize_tile(tile).reshape(r, h1 - h0, per_head), h0, h1))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=-2)
