"""Padded device inputs for one program call, built in one place for every path (serving
prefill and decode, prompt scoring).

A row is (new token ids, start position, page table, expected generations). Padding rows and
padding slots are zero: page 0 is the null page, and a padding row has no new tokens.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class InputBatch:
    tokens: np.ndarray  # int32 [B, T]
    cached_lens: np.ndarray  # int32 [B]  tokens already in pages
    new_lens: np.ndarray  # int32 [B]     new tokens of the row (0: padding)
    page_table: np.ndarray  # int32 [B, M]
    expected: np.ndarray  # int32 [B, M] generation each page must have (the integrity check)
    pages_used: np.ndarray  # int32 [B]  pages the row's tokens reach

    @classmethod
    def build(cls, rows, batch: int, tokens: int, width: int, page_size: int) -> "InputBatch":
        """rows: (new token ids, start, pages, expected) -> arrays padded to [batch, tokens] and
        page tables of ``width`` pages (the width the programs were compiled for)."""
        if len(rows) > batch:
            raise ValueError(f"{len(rows)} rows do not fit a batch of {batch}")
        tok = np.zeros((batch, tokens), np.int32)
        cached, new, used = (np.zeros((batch,), np.int32) for _ in range(3))
        table, expected = np.zeros((batch, width), np.int32), np.zeros((batch, width), np.int32)
        for i, (ids, start, pages, gens) in enumerate(rows):
            if len(pages) > width:
                raise ValueError(f"row {i} maps {len(pages)} pages > {width} per sequence")
            if len(ids) > tokens:
                raise ValueError(f"row {i} has {len(ids)} new tokens > {tokens}")
            tok[i, : len(ids)] = ids
            cached[i], new[i] = start, len(ids)
            table[i, : len(pages)], expected[i, : len(gens)] = pages, gens
            used[i] = -(-(start + len(ids)) // page_size)
        return cls(tok, cached, new, table, expected, used)
