"""KV-cache memory: bytes per cached token and per page, and the page count a byte budget buys.

One function, ``kv_token_bytes``, gives the bytes one cached token costs in a KV format from
its layout (values stored, and separately scaled vectors): the engine applies it to the pools
its model allocates (``token_layout``), the capacity planner to the layout it derives from a
config (jaxserve.planner), so a plan and an engine agree. Scaled formats (fp8) add one float32
scale per vector.

Budgets: ``kv_cache_memory`` bytes (``parse_size`` reads "48GiB"-style sizes), or a fraction
of the memory left after the weights: on a GPU the device's limit minus what is in use, on
CPU the host's available memory (``/proc/meminfo`` MemAvailable), read when the engine is built
(after the checkpoint is loaded, before the phase copies are). Neither given: the engine keeps
its ``num_pages`` (default 256).
"""
from __future__ import annotations

import math
import re

import jax
import numpy as np

from jaxserve.kv.formats import KVFormat

SCALE_BYTES = 4  # one float32 scale per stored vector in scaled formats

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(s) -> int:
    """'11GB' -> 11e9, '10GiB' -> 10 * 2**30, '123' or 123 -> 123 bytes."""
    if isinstance(s, (int, np.integer)):
        return int(s)
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(s))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"bad size {s!r} (e.g. 11GB, 10GiB, 512MiB, 0)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def kv_token_bytes(bytes_per_value: int, scaled: bool, values: int, vectors: int,
                   scale_bytes: int = SCALE_BYTES) -> int:
    """Bytes of one cached token: ``values`` stored values, ``vectors`` separately scaled rows
    (the planner calls this for its formats, the engine through ``format_token_bytes``)."""
    return values * bytes_per_value + (vectors * scale_bytes if scaled else 0)


def format_token_bytes(fmt: KVFormat, values: int, vectors: int) -> int:
    return kv_token_bytes(fmt.bytes_per_value, fmt.scaled, values, vectors)


def token_layout(pools, num_pages: int, page_size: int) -> tuple[int, int]:
    """(values, vectors) per token of a model's KV pools (a pytree of arrays or shapes whose
    leaves named ``*_scale`` hold the per-vector scales), over all layers."""
    values = vectors = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(pools)[0]:
        per_token = math.prod(leaf.shape) // (num_pages * page_size)
        if str(path[-1]).strip("[]'\"").endswith("_scale"):
            vectors += per_token
        else:
            values += per_token
    return values, vectors


def model_token_layout(model, fmt: KVFormat) -> tuple[int, int]:
    """(values, vectors) per token of ``model.init_kv`` in ``fmt``, from shapes alone."""
    pools = jax.eval_shape(lambda: model.init_kv(2, 1, fmt))
    return token_layout(pools, 2, 1)


def pages_for_budget(budget_bytes: int, page_bytes: int) -> int:
    """Pages (the reserved null page included) that fit in ``budget_bytes``."""
    pages = int(budget_bytes) // int(page_bytes)
    if pages < 2:
        raise ValueError(f"a KV budget of {budget_bytes:,} B holds {pages} page(s) of {page_bytes:,} B; "
                         "at least 2 are needed (page 0 is the reserved null page)")
    return pages


def free_memory() -> int:
    """Bytes a KV cache could take: the accelerator's limit minus its use (weights already
    placed), or on CPU the host's available memory (the weights already counted in)."""
    dev = jax.devices()[0]
    stats = dev.memory_stats() if dev.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


def kv_budget(kv_cache_memory, memory_fraction: float | None) -> int | None:
    """The KV byte budget asked for: an explicit size, else a fraction of the free memory
    (None: neither asked, the caller keeps its page count)."""
    if kv_cache_memory is not None:
        return parse_size(kv_cache_memory)
    if memory_fraction is None:
        return None
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    return int(free_memory() * memory_fraction)
