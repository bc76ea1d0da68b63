"""Padded device inputs for one program call, built in one place for every path (serving
prefill and decode, speculative verify, prompt scoring): one ``StepBatch``.

A row is (new token ids, start position, page table, expected generations). Padding rows and
padding slots are zero: page 0 is the null page, and a padding row has no new tokens.
"""
from __future__ import annotations

import numpy as np

from jaxserve.step_batch import StepBatch


def build_batch(phase: str, rows, batch: int, tokens: int, width: int, page_size: int,
                all_logits: bool = False) -> StepBatch:
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
    return StepBatch(tok, cached, new, table, expected, used, phase=phase, all_logits=all_logits)
