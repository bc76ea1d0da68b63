"""Padding buckets: the one table of shapes every bucketed program is built for, and the
programs' names.

Every padded dimension is a power of two from a floor (``bucket``, ``pow2_buckets``): step rows,
sampler rows and top-n log-probs, speculative verify rows, generation-update sizes (from 8), KV
handoff page counts (from 4); prefill token counts add the 3/4 points (``token_buckets``).
"""
from __future__ import annotations

import numpy as np

UPDATES_MIN = 8  # the smallest padded generation update
HANDOFF_MIN_PAGES = 4  # the smallest KV handoff page-count bucket


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


def pow2_buckets(lo: int, hi: int) -> list[int]:
    """The powers of two from ``bucket(lo)`` below ``hi``, then ``bucket(hi)``."""
    out, b = [], bucket(lo)
    while b < hi:
        out.append(b)
        b *= 2
    return out + [bucket(hi)]


def token_buckets(lo: int, hi: int) -> list[int]:
    """Prefill token-count buckets: the powers of two from ``lo`` up to cover ``hi``, plus the
    3/4 point below each one from 64 on (48, 96, 192, ...), which cuts the padding of a chunk
    just past a power of two (a 70-token prompt pads to 96, not 128)."""
    out = set()
    for b in pow2_buckets(lo, hi):
        out.add(b)
        if b >= 64 and b * 3 // 4 >= lo:
            out.add(b * 3 // 4)
    return sorted(out)


def pick_bucket(n: int, buckets: list[int]) -> int:
    """The smallest bucket >= n (buckets sorted); an n past the last is a caller bug."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def update_sizes(num_pages: int) -> list[int]:
    """Every padded size a generation update over ``num_pages`` pages can have."""
    return pow2_buckets(UPDATES_MIN, max(UPDATES_MIN, num_pages))


def handoff_buckets(max_pages: int) -> list[int]:
    """The page-count buckets of a KV handoff of at most ``max_pages`` pages."""
    return pow2_buckets(HANDOFF_MIN_PAGES, max(HANDOFF_MIN_PAGES, max_pages))


def pad_updates(pages: np.ndarray, counts: np.ndarray, min_size: int = UPDATES_MIN
                ) -> tuple[np.ndarray, np.ndarray]:
    """Pad host generation updates with (page 0, count 0) to their bucket (``bucket(K, min_size)``).

    pages, counts: int32[K] -> int32[K'] with K' in {min_size, 2*min_size, ...}, so the
    jitted update compiles once per bucket rather than once per K.
    """
    k = len(pages)
    size = bucket(k, min_size)
    out_p = np.zeros(size, dtype=np.int32)
    out_c = np.zeros(size, dtype=np.int32)
    out_p[:k] = pages
    out_c[:k] = counts
    return out_p, out_c


def step_name(phase: str, batch: int, tokens: int) -> str:
    """The ProgramSet name of a serving step program for one bucket."""
    return f"{phase}/{batch}x{tokens}"


def weights_phase(program: str) -> str:
    """The phase whose weights a step program reads: a speculative decoding "verify" program
    (the decode step over k + 1 positions, logits at each) and "draft" program (the MTP block's
    k draft tokens) read the decode weights."""
    return "decode" if program in ("verify", "draft") else program
