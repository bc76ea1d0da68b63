"""Input checks for the int4 (W4A16) matmul kernels (layout: reference.py, i.e.
jaxserve.quant.int4's: group-wise scales, packing tile = group).

Static checks always run (also under jit); group_sizes values are checked on the host when
they are concrete (non-negative, sum <= M), skipped for tracers.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

X_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
SCALE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MIN_DOT = 16  # Triton tl.dot: every dimension >= 16


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _dtype_in(x, allowed) -> bool:
    return jnp.dtype(x.dtype) in [jnp.dtype(d) for d in allowed]


def _names(allowed) -> str:
    return ", ".join(jnp.dtype(d).name for d in allowed)


def check_group(group: int) -> None:
    """The kernel steps over one scale group at a time: G/2 packed rows, whose low nibbles are
    K rows [i*G, i*G + G/2) and high nibbles [i*G + G/2, (i+1)*G). G/2 is a dot dimension,
    so G must be a power of two >= 2 * 16."""
    if not is_pow2(group) or group < 2 * MIN_DOT:
        raise ValueError(f"group={group} must be a power of two >= {2 * MIN_DOT} "
                         "(32, 64 and 128 are the shipped ones)")


def check_tile(group: int, tile: int | None) -> None:
    """The packing tile is the group (jaxserve.quant's layout, the only one); ``tile`` may
    state it (None or ``group``), nothing else is accepted."""
    if tile is not None and tile != group:
        raise ValueError(f"tile={tile}: int4 weights are packed with tile = group = {group} "
                         "(jaxserve.quant.int4's layout), no other tile is supported")


def block_n_for(n: int, max_block: int = 128) -> int:
    """Largest power of two <= max_block (>= 16) dividing N: the column tile."""
    b = max_block
    while b >= MIN_DOT:
        if n % b == 0:
            return b
        b //= 2
    raise ValueError(f"N={n} must be a multiple of {MIN_DOT} (column tiles are powers of two >= {MIN_DOT})")


def check_weights(x, packed, scales, group: int, experts: int | None, tile: int | None = None) -> dict:
    """x [M, K]; packed [(E,) K/2, N] uint8; scales [(E,) K/g, N]. -> dims.

    K is the padded K (a multiple of the group): callers pad x with zero columns."""
    check_group(group)
    check_tile(group, tile)
    if x.ndim != 2:
        raise ValueError(f"x: expected [M, K], got shape {tuple(x.shape)}")
    if not _dtype_in(x, X_DTYPES):
        raise TypeError(f"x: dtype {jnp.dtype(x.dtype).name} not supported; expected one of {_names(X_DTYPES)}")
    lead = () if experts is None else (experts,)
    want_rank = 2 + len(lead)
    if packed.ndim != want_rank:
        layout = "[E, K/2, N]" if lead else "[K/2, N]"
        raise ValueError(f"packed: expected rank {want_rank} {layout}, got {tuple(packed.shape)}")
    if jnp.dtype(packed.dtype) != jnp.uint8:
        raise TypeError(f"packed: dtype {jnp.dtype(packed.dtype).name}; int4 weights are stored as uint8 (two nibbles)")
    m, k = x.shape
    if k % group:
        raise ValueError(f"x: K={k} must be a multiple of group={group} (pad x with zero columns to "
                         "the weights' padded K)")
    n = packed.shape[-1]
    if tuple(packed.shape) != lead + (k // 2, n):
        raise ValueError(f"packed: expected shape {lead + (k // 2, n)} for K={k}, got {tuple(packed.shape)}")
    if tuple(scales.shape) != lead + (k // group, n):
        raise ValueError(f"scales: expected shape {lead + (k // group, n)} (group {group}), got {tuple(scales.shape)}")
    if not _dtype_in(scales, SCALE_DTYPES):
        raise TypeError(f"scales: dtype {jnp.dtype(scales.dtype).name}; expected one of {_names(SCALE_DTYPES)}")
    return dict(m=m, k=k, n=n, block_n=block_n_for(n))


def check_group_sizes(group_sizes, experts: int, rows: int) -> None:
    if tuple(group_sizes.shape) != (experts,):
        raise ValueError(f"group_sizes: expected shape ({experts},), got {tuple(group_sizes.shape)}")
    if jnp.dtype(group_sizes.dtype) != jnp.int32:
        raise TypeError(f"group_sizes: dtype {jnp.dtype(group_sizes.dtype).name}; expected int32")
    if isinstance(group_sizes, jax.core.Tracer):
        return
    gs = np.asarray(group_sizes)
    if (gs < 0).any():
        raise ValueError(f"group_sizes must be >= 0, got {gs.tolist()}")
    if gs.sum() > rows:
        raise ValueError(f"sum(group_sizes) = {int(gs.sum())} exceeds the {rows} rows of x")
