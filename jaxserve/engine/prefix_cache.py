"""Prefix-cache keys and lookups for the block manager: the chain hash of a full page and the
longest verified run of cached leading pages.

Plain Python + numpy. The block manager owns the pages and the two maps (hash -> page,
page -> ``CachedPage``); this module only reads them.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence

import numpy as np


def hash_page(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Stable 128-bit chain hash of one full page given its parent's hash.

    Python's ``hash()`` is salted per process; this one is not, so hashes are comparable
    across restarts and processes (e.g. a prefill and a decode worker).
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(b"root" if parent_hash is None else parent_hash.to_bytes(16, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little")


@dataclasses.dataclass
class CachedPage:
    """What a cached full page holds; used to verify a hash hit."""

    page_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]


def page_tokens(token_ids: Sequence[int], i: int, page_size: int) -> tuple[int, ...]:
    """The tokens of full page i, as the hashable tuple a CachedPage stores."""
    return tuple(int(t) for t in token_ids[i * page_size:(i + 1) * page_size])


def match_prefix(hash_to_page: Mapping[int, int], cached: Mapping[int, CachedPage], token_ids: Sequence[int],
                 page_size: int) -> tuple[list[int], list[int]]:
    """Longest verified run of cached leading full pages of token_ids, and their chain hashes."""
    # At least the last token must be computed (its logits start decoding), so only
    # pages lying entirely within the first len-1 tokens may be hits.
    max_hits = (len(token_ids) - 1) // page_size
    pages: list[int] = []
    hashes: list[int] = []
    parent = None
    for i in range(max_hits):
        block = page_tokens(token_ids, i, page_size)
        h = hash_page(parent, block)
        page = hash_to_page.get(h)
        if page is None:
            break
        entry = cached[page]
        # Verify, never trust the hash: a collision must not share someone else's KV.
        if entry.token_ids != block or entry.parent_hash != parent:
            break
        pages.append(page)
        hashes.append(h)
        parent = h
    return pages, hashes
