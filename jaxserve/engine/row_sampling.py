"""After a program call: each row's token sampled with its own parameters and allowed tokens,
then appended to its request (``emit``: detokenization, stop conditions, the grammar's end). A
row whose own inputs cannot be sampled, or whose detokenization / stop check raises, fails
alone (``fail``: aborted with a ``RequestFailed``); the other rows keep their tokens."""
from __future__ import annotations

import logging
import time

from jaxserve.engine.outputs import RequestFailed
from jaxserve.engine.sampler import RowError, sample_sequences

log = logging.getLogger("jaxserve.engine")


class RowSampling:
    """runner: the ModelRunner (its ProgramSet holds the built samplers); outputs, constraints:
    the engine's output processor and grammar constraints; finish(seq, reason, error=None)."""

    def __init__(self, runner, vocab_size: int, batch_invariant: bool, outputs, constraints, finish):
        self.runner, self.vocab_size, self.batch_invariant = runner, vocab_size, batch_invariant
        self.outputs, self.constraints, self.finish = outputs, constraints, finish

    def sample(self, logits, rows, events, prefetched=None) -> None:
        """rows: (logits row index, Sequence): sample each row's token and emit it."""
        while rows:
            try:
                masks = self.constraints.rows([s for _, s in rows], prefetched)  # grammars' allowed tokens
                tokens, lp, top_ids, top_lp, n_lp = sample_sequences(
                    logits, rows, self.vocab_size, self.batch_invariant, self.runner.programs,
                    build=not self.runner.warm, masks=masks)
                break
            except RowError as e:  # sample the others again without that row
                self.fail(rows[e.row][1], "sample", e.cause)
                rows = rows[: e.row] + rows[e.row + 1:]
        else:
            return
        now = time.perf_counter()
        for j, (_, s) in enumerate(rows):
            if s.finished:
                continue
            n = s.params.logprobs or 0
            top = {int(a): float(c) for a, c in zip(top_ids[j, :n], top_lp[j, :n])} if n_lp else None
            self.emit(s, int(tokens[j]), float(lp[j]), top, now, events)

    def emit(self, s, tok: int, logprob: float, top, now: float, events) -> bool:
        """Append one token to ``s``; -> whether the request finished with it (or failed alone)."""
        events.setdefault(s.request_id, []).append(tok)
        try:
            reason = self.outputs.append(s, tok, logprob, top, now)
            if s.grammar is not None:  # the grammar ends the request once complete
                reason = reason or self.constraints.advance(s, tok)
        except Exception as e:
            self.fail(s, "detokenize / stop check", e)
            return True
        if reason is not None:
            self.finish(s, reason)
        return s.finished

    def fail(self, s, stage: str, cause: Exception) -> None:
        """Abort one request whose own processing raised: its pages are freed and its last
        output carries a ``RequestFailed``; logged once, with the traceback (a bug to fix)."""
        log.error("request %s failed in %s; aborting it alone", s.request_id, stage, exc_info=cause)
        self.finish(s, "abort", RequestFailed(s.request_id, stage, cause))
