"""Input checks for the int4 (W4A16) matmul kernels.

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
    if not is_pow2(group) or group < MIN_DOT:
        raise ValueError(f"group={group} must be a power of two >= {MIN_DOT} (32, 64 and 128 are the shipped ones)")


def check_tile(k: int, group: int, tile: int | None) -> int:
    """-> the packing tile T (None -> K). T must divide K and be `group` or a multiple of
    2 * group, so each half of a tile holds whole scale groups (or half of one group)."""
    t = k if tile is None else tile
    if t <= 0 or k % t or not (t == group or t % (2 * group) == 0):
        raise ValueError(f"tile={t} must divide K={k} and be group={group} or a multiple of 2 * group")
    return t


def kernel_step(group: int, tile: int) -> int:
    """Packed rows per inner step: a whole group, or half a tile when tile == group. The step
    is a dot dimension, so it must be a power of two >= 16 (group 32 at least when tile == group)."""
    step = min(group, tile // 2)
    if not is_pow2(step) or step < MIN_DOT:
        raise ValueError(f"group={group}, tile={tile}: inner step {step} rows must be a power of two >= {MIN_DOT}")
    return step


def block_n_for(n: int, max_block: int = 128) -> int:
    """Largest power of two <= max_block (>= 16) dividing N: the column tile."""
    b = max_block
    while b >= MIN_DOT:
        if n % b == 0:
            return b
        b //= 2
    raise ValueError(f"N={n} must be a multiple of {MIN_DOT} (column tiles are powers of two >= {MIN_DOT})")


def check_weights(x, packed, scales, group: int, experts: int | None, tile: int | None = None) -> dict:
    """x [M, K]; packed [(E,) K/2, N] uint8; scales [(E,) K/g, N]. -> dims (incl. tile, step)."""
    check_group(group)
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
    t = check_tile(k, group, tile)
    step = kernel_step(group, t)
    n = packed.shape[-1]
    if tuple(packed.shape) != lead + (k // 2, n):
        raise ValueError(f"packed: expected shape {lead + (k // 2, n)} for K={k}, got {tuple(packed.shape)}")
    if tuple(scales.shape) != lead + (k // group, n):
        raise ValueError(f"scales: expected shape {lead + (k // group, n)} (group {group}), got {tuple(scales.shape)}")
    if not _dtype_in(scales, SCALE_DTYPES):
        raise TypeError(f"scales: dtype {jnp.dtype(scales.dtype).name}; expected one of {_names(SCALE_DTYPES)}")
    return dict(m=m, k=k, n=n, block_n=block_n_for(n), tile=t, step=step)


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
