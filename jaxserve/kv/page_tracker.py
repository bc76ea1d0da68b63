"""Page tracker: the device-side generation check that catches bad page mappings.

The device keeps ``generation: int32[num_pages]`` beside the KV pages (a copy of the
host mirror in ``BlockManager``; odd = owned, even = free/evictable, page 0 = null, always
0). Every sequence's page-table row carries the generation each page had when the
sequence mapped it. Before attention reads the pages, ``PageTracker.check`` compares
them; rows that fail are redirected to the null page (so a bad mapping never reads live
data), their output is discarded and the request is aborted with an ``IntegrityError``.

``NoOpTracker`` has the same interface and does no work, for deployments that turn the
check off; with nothing wrong, outputs are identical either way.

All device methods are pure and jittable; the host helpers at the bottom are numpy only.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

import jax.numpy as jnp
import numpy as np

# Failure causes, one int32 per row. Several may hit one row; the most severe wins,
# in the fixed priority of _PRIORITY (an out-of-range id is reported first because the
# other two causes could not even be computed for it).
OK = 0
STALE_GENERATION = 1  # page owned (odd generation) but not at the generation expected
OUT_OF_RANGE = 2  # page id < 0 or >= num_pages
NOT_OWNED = 3  # generation even (free / evictable) or the null page 0

CAUSE_NAMES: dict[int, str] = {
    OK: "ok",
    STALE_GENERATION: "stale_generation",
    OUT_OF_RANGE: "out_of_range_page",
    NOT_OWNED: "page_not_owned",
}
_PRIORITY = (OUT_OF_RANGE, NOT_OWNED, STALE_GENERATION)

NULL_PAGE = 0


class PageTracker:
    """Generation-counter integrity check for paged KV.

    Stateless: the generation array is carried by the caller (in the KV state), and
    every method is a pure function of its arguments, safe to call inside ``jax.jit``.
    """

    enabled = True

    def init(self, num_pages: int) -> jnp.ndarray:
        """int32[num_pages] zeros: every page unowned, matching a fresh BlockManager."""
        return jnp.zeros((num_pages,), dtype=jnp.int32)

    def apply_updates(self, generation: jnp.ndarray, pages: jnp.ndarray,
                      counts: jnp.ndarray) -> jnp.ndarray:
        """Add host bumps to the device copy.

        generation: int32[num_pages]; pages, counts: int32[K], padded with (0, 0) to a
        bucketed K so the step does not recompile (see ``jaxserve.executor.buckets.pad_updates``). Add, not set,
        so padding on page 0 with count 0 and repeated ids are harmless.
        """
        return generation.at[pages].add(counts.astype(generation.dtype))

    def check(self, generation: jnp.ndarray, page_table: jnp.ndarray,
              expected: jnp.ndarray, num_pages_used: jnp.ndarray
              ) -> tuple[jnp.ndarray, jnp.ndarray]:
        """Verify every mapped page of every row.

        generation: int32[P]; page_table, expected: int32[B, M];
        num_pages_used: int32[B], only entries j < num_pages_used[b] are checked (so
        padding rows with 0 are always ok).
        Returns ok: bool[B] and cause: int32[B] (OK or the most severe failure).
        """
        num_pages = generation.shape[0]
        m = page_table.shape[1]
        active = jnp.arange(m, dtype=jnp.int32)[None, :] < num_pages_used[:, None]  # [B, M]
        # Range first: a jnp gather clips (and negative ids wrap), so gathering an
        # out-of-range id would silently read some other page's generation.
        in_range = (page_table >= 0) & (page_table < num_pages)  # [B, M]
        safe = jnp.where(in_range, page_table, NULL_PAGE)
        gen = jnp.take(generation, safe, axis=0)  # [B, M]; every index valid
        owned = ((gen & 1) == 1) & (safe != NULL_PAGE)
        bad = {
            OUT_OF_RANGE: active & ~in_range,
            NOT_OWNED: active & in_range & ~owned,
            STALE_GENERATION: active & in_range & owned & (gen != expected),
        }
        cause = jnp.full(page_table.shape[:1], OK, dtype=jnp.int32)
        for c in reversed(_PRIORITY):  # least severe first, so the most severe lands last
            cause = jnp.where(jnp.any(bad[c], axis=1), jnp.int32(c), cause)
        return cause == OK, cause

    def redirect(self, page_table: jnp.ndarray, ok: jnp.ndarray) -> jnp.ndarray:
        """page_table: int32[B, M], ok: bool[B] -> rows that failed set to the null page."""
        return jnp.where(ok[:, None], page_table, jnp.asarray(NULL_PAGE, page_table.dtype))


class NoOpTracker:
    """Same interface as PageTracker, no work: everything passes, nothing changes."""

    enabled = False

    def init(self, num_pages: int) -> jnp.ndarray:
        # Same shape as the real tracker so the KV-state pytree is identical either way.
        return jnp.zeros((num_pages,), dtype=jnp.int32)

    def apply_updates(self, generation, pages, counts):
        return generation

    def check(self, generation, page_table, expected, num_pages_used):
        b = page_table.shape[0]
        return jnp.ones((b,), dtype=jnp.bool_), jnp.zeros((b,), dtype=jnp.int32)

    def redirect(self, page_table, ok):
        return page_table


# ---- host side (numpy only) ------------------------------------------------------------


class IntegrityError(RuntimeError):
    """A request's page mapping failed the tracker check; the request is aborted."""

    def __init__(self, request_id: Hashable, cause: str):
        if cause not in CAUSE_NAMES.values() or cause == CAUSE_NAMES[OK]:
            raise ValueError(f"unknown integrity cause {cause!r}")
        super().__init__(f"request {request_id!r}: KV page integrity check failed ({cause})")
        self.request_id = request_id
        self.cause = cause

    def __reduce__(self):  # whole across a process boundary
        return (IntegrityError, (self.request_id, self.cause))


def integrity_errors(request_ids: Sequence[Hashable], ok: np.ndarray,
                     cause: np.ndarray) -> list[IntegrityError]:
    """One IntegrityError per failing row; row b belongs to request_ids[b].

    ok, cause: host copies of ``check``'s outputs, [B] with B >= len(request_ids)
    (rows past the ids are batch padding and are ignored).
    """
    return [IntegrityError(rid, CAUSE_NAMES[int(cause[b])])
            for b, rid in enumerate(request_ids) if not ok[b]]


@dataclasses.dataclass
class TrackerStats:
    """Host counters for metrics: how many checks ran and what they caught."""

    checks_run: int = 0
    rows_checked: int = 0
    mismatches_by_cause: dict[str, int] = dataclasses.field(default_factory=dict)

    def record(self, ok: np.ndarray, cause: np.ndarray, num_rows: int | None = None) -> None:
        """Count one check. ok: bool[B], cause: int32[B]; num_rows: real (unpadded) rows."""
        ok = np.asarray(ok)[:num_rows]
        cause = np.asarray(cause)[:num_rows]
        self.checks_run += 1
        self.rows_checked += int(ok.shape[0])
        for c in cause[~ok].tolist():
            name = CAUSE_NAMES[int(c)]
            self.mismatches_by_cause[name] = self.mismatches_by_cause.get(name, 0) + 1

    @property
    def total_mismatches(self) -> int:
        return sum(self.mismatches_by_cause.values())
