"""The engine's side of structured outputs: each constrained sequence's grammar state, the
packed token masks of a sampling batch, and advancing the grammars with the sampled tokens.

Masks are int32 [rows, ceil(V / 32)], bit ``t % 32`` of word ``t // 32`` set when token t is
allowed (llguidance's layout); an unconstrained row is all ones, so the sampler's mask input
is always there and one program serves constrained and unconstrained rows alike. A decode
batch's masks depend only on tokens already sampled, so ``prefetch`` computes them on a worker
thread while the device runs the decode step (llguidance releases the GIL while it computes).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time

import numpy as np

from jaxserve.structured.compiler import GrammarCompiler
from jaxserve.structured.spec import StructuredOutput


@dataclasses.dataclass(eq=False)
class GrammarState:
    """One sequence's grammar: its matcher, and whether it constrains yet (``after``)."""

    matcher: object  # llguidance.LLMatcher
    after: str | None = None  # the constraint starts once the output text contains this
    active: bool = True
    failed: bool = False  # a token the grammar refused was consumed (never with the mask on)


@dataclasses.dataclass
class ConstraintStats:
    """Counters the server's metrics export (engine thread writes, scrapes read)."""

    requests: int = 0  # constrained requests started
    rejected: int = 0  # grammars that did not compile
    mask_rows: int = 0  # masks computed
    mask_seconds: float = 0.0  # host time computing them
    mask_steps: int = 0  # sampling calls with at least one constrained row
    mask_wait_seconds: float = 0.0  # the sampler's wait for masks (prefetched ones not ready yet, or computed then)
    invalid_outputs: int = 0  # a sampled token the grammar refused (the row runs on unconstrained)
    grammar_stops: int = 0  # requests the grammar ended (complete, nothing more allowed)
    draft_tokens_cut: int = 0  # speculative draft tokens dropped because the grammar forbids them


class Constraints:
    def __init__(self, tokenizer, vocab_size: int, eos_ids, max_bytes: int, compile_ms: int):
        self._args = (tokenizer, vocab_size, frozenset(eos_ids), max_bytes, compile_ms)
        self.words = (vocab_size + 31) // 32
        self.stats = ConstraintStats()
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def compiler(self) -> GrammarCompiler:
        """Built on first use (the llguidance tokenizer takes about a second)."""
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(*self._args)
            return self._compiler

    def compile_seconds(self) -> tuple[int, list[float]]:
        """(compilations so far, the latest ones' seconds, oldest first)."""
        c = self._compiler
        return (c.compiles, list(c.compile_seconds)) if c is not None else (0, [])

    def start(self, spec: StructuredOutput) -> GrammarState:
        """A fresh state for a new request; GrammarError (a ValueError) if it cannot compile."""
        try:
            matcher = self.compiler.matcher(spec)
        except ValueError:
            self.stats.rejected += 1
            raise
        self.stats.requests += 1
        return GrammarState(matcher, spec.after, active=spec.after is None)

    # ------------------------------------------------------------------ masks
    def _compute(self, seqs) -> dict[str, np.ndarray]:
        t0 = time.perf_counter()
        out = {}
        for s in seqs:
            g = s.grammar
            if g is None or not g.active or g.failed:
                continue
            row = np.full((1, self.words), -1, np.int32)
            g.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            out[s.request_id] = row[0]
        if out:
            self.stats.mask_rows += len(out)
            self.stats.mask_steps += 1
            self.stats.mask_seconds += time.perf_counter() - t0
        return out

    def prefetch(self, seqs):
        """Start computing the masks of ``seqs`` on the worker thread (None: none constrained)."""
        if not any(s.grammar is not None for s in seqs):
            return None
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-grammar")
        return self._pool.submit(self._compute, list(seqs))

    def rows(self, seqs, prefetched=None) -> np.ndarray | None:
        """int32 [len(seqs), words] masks for a sampling call (None: no row constrained, the
        sampler takes all ones). ``prefetched``: a ``prefetch`` future over these sequences."""
        if not any(s.grammar is not None for s in seqs):
            return None
        t0 = time.perf_counter()
        got = prefetched.result() if prefetched is not None else self._compute(seqs)
        self.stats.mask_wait_seconds += time.perf_counter() - t0
        mask = np.full((len(seqs), self.words), -1, np.int32)
        for j, s in enumerate(seqs):
            if s.request_id in got:
                mask[j] = got[s.request_id]
        return mask

    def draft_masks(self, s, drafts: list[int]) -> tuple[list[int], np.ndarray | None]:
        """Speculative decoding: ``drafts`` of ``s`` cut before the first one its grammar forbids,
        and the mask of every verify position (int32 [len(kept) + 1, words]: position j after the
        kept drafts before j; all ones after a draft that completes the grammar, which ends the
        request there). None: unconstrained (no grammar, or a failed one). A grammar still
        waiting for its marker (the text decides when it starts) takes no drafts. The matcher
        is left as it was."""
        g = s.grammar
        if g is None or g.failed:
            return drafts, None
        if not g.active:
            return [], None
        rows, kept = [], []
        for d in list(drafts) + [None]:
            row = np.full(self.words, -1, np.int32)
            g.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            rows.append(row)
            if d is None or not (int(row[d >> 5]) >> (d & 31)) & 1 or not g.matcher.consume_token(int(d)):
                break
            kept.append(int(d))
            if g.matcher.is_stopped():
                rows.append(np.full(self.words, -1, np.int32))
                break
        g.matcher.rollback(len(kept))
        self.stats.mask_rows += len(rows)
        self.stats.draft_tokens_cut += len(drafts) - len(kept)
        return kept, np.stack(rows)

    # ------------------------------------------------------------------ tokens
    def advance(self, s, tok: int) -> str | None:
        """Feed the token just sampled for ``s``; -> "stop" when its grammar is complete and
        allows nothing more."""
        g = s.grammar
        if g is None or g.failed:
            return None
        if not g.active:
            g.active = g.after in s.text  # the marker just completed: constrain from the next token
            return None
        if not g.matcher.consume_token(int(tok)):
            g.failed = True
            self.stats.invalid_outputs += 1
            return None
        if g.matcher.is_stopped():
            self.stats.grammar_stops += 1
            return "stop"
        return None
