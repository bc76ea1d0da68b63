"""From sampled tokens to what a caller sees: detokenization, stop conditions, streamed deltas,
completions, and how long finished requests stay known.

The engine hands each sampled token to ``OutputProcessor.append``; the processor appends it
(text, logprobs, timings), decides whether the request stops (stop token ids, EOS, stop
strings, length) and builds the ``RequestOutput`` deltas and the final ``Completion``.

Stop strings cost the same per token however many a request gives: they are grouped by length
(``StopMatcher``), and each new character is checked once per distinct length with a set
lookup of the text ending there. Text that could still grow into a stop string is held back
from the stream until it is decided.
"""
from __future__ import annotations

import collections
import time

from jaxserve.engine.outputs import Completion, RequestOutput, Timing, Usage
from jaxserve.engine.sequence import Sequence


class StopMatcher:
    """The earliest stop string in a growing text, at a cost per new character set by the
    number of distinct stop-string lengths (not the number of strings)."""

    def __init__(self, stops):
        by_len: dict[int, set[str]] = collections.defaultdict(set)
        for s in stops:
            by_len[len(s)].add(s)
        self.lengths = sorted(by_len)
        self.sets = by_len
        self.hold = max(self.lengths, default=1) - 1  # characters that may still start a match

    def find(self, text: str, new_from: int) -> int:
        """Start of the earliest stop string ending at or after ``new_from`` (the first new
        character), or -1."""
        for end in range(max(new_from, 0), len(text)):
            for n in self.lengths:  # shortest first: at one end position, the later start
                start = end + 1 - n
                if start < 0:
                    break
                if text[start:end + 1] in self.sets[n]:
                    return self._earliest(text, end, start)
        return -1

    def _earliest(self, text: str, end: int, start: int) -> int:
        """Among the strings ending at ``end``, the longest one (the earliest start)."""
        for n in reversed(self.lengths):
            s = end + 1 - n
            if 0 <= s < start and text[s:end + 1] in self.sets[n]:
                return s
        return start


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: frozenset[int], max_model_len: int, keep_finished: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.keep_finished = keep_finished
        self.requests: dict[str, Sequence] = {}  # unfinished, and the most recent finished ones
        self._finished_order: collections.deque[str] = collections.deque()
        self._matchers: dict[str, StopMatcher] = {}

    def add(self, seq: Sequence) -> None:
        if self.tokenizer is not None:
            from jaxserve.tokenizer import IncrementalDetokenizer

            seq.detok = IncrementalDetokenizer(self.tokenizer)
        if seq.params.stop:
            self._matchers[seq.request_id] = StopMatcher(seq.params.stop)
        self.requests[seq.request_id] = seq

    def get(self, request_id: str) -> Sequence | None:
        return self.requests.get(request_id)

    def append(self, s: Sequence, tok: int, logprob, top: dict | None, now: float) -> str | None:
        """Add one sampled token; -> the finish reason when the request stops now, else None."""
        s.output_ids.append(tok)
        if s.first_token_time is None:
            s.first_token_time = now
        if s.params.logprobs is not None:
            s.logprobs.append((logprob, top))
        before = len(s.text)
        s.text += s.detok.push(tok) if s.detok is not None else ""
        p = s.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            return "stop"
        matcher = self._matchers.get(s.request_id)
        if matcher is not None and len(s.text) > before:
            at = matcher.find(s.text, before)
            if at >= 0:
                s.text = s.text[:at]
                s.stopped_by_string = True
                return "stop"
        if len(s.output_ids) >= p.max_tokens or s.total_len >= self.max_model_len:
            return "length"
        return None

    def finished(self, s: Sequence, reason: str) -> None:
        """The request has ended (``reason``): complete its text and keep it known for a while."""
        if s.detok is not None and reason != "abort" and not s.stopped_by_string:
            s.text += s.detok.flush()
        s.finish_time = time.perf_counter()
        self._matchers.pop(s.request_id, None)
        self._finished_order.append(s.request_id)
        while len(self._finished_order) > self.keep_finished:
            old = self._finished_order.popleft()
            if old in self.requests and self.requests[old].finished:
                del self.requests[old]

    def output(self, s: Sequence, new_ids: list[int], started: bool = False) -> RequestOutput:
        """The delta since the last output; text that may still become a stop string is held."""
        matcher = self._matchers.get(s.request_id)
        hold = 0 if s.finished or matcher is None else matcher.hold
        end = max(s.emitted_text, len(s.text) - hold)
        delta = s.text[s.emitted_text:end]
        s.emitted_text = end
        lps = s.logprobs[len(s.logprobs) - len(new_ids):] if s.params.logprobs is not None and new_ids else None
        return RequestOutput(
            s.request_id, list(new_ids), delta, s.finished, s.finish_reason, s.error,
            self.completion(s) if s.finished else None,
            started=started, prompt_tokens=len(s.prompt_ids), cached_tokens=s.num_cached_tokens,
            new_logprobs=lps,
            kv_export=s.kv_export if s.finished else None,
        )

    def completion(self, s: Sequence) -> Completion:
        end = s.finish_time or time.perf_counter()
        return Completion(
            list(s.output_ids),
            s.text if s.detok is not None else None,
            s.finish_reason,
            list(s.prompt_ids),
            usage=Usage(len(s.prompt_ids), len(s.output_ids), s.num_cached_tokens,
                        *((s.spec.drafted, s.spec.accepted) if s.spec is not None else ())),
            timing=Timing(
                s.first_token_time - s.arrival_time if s.first_token_time is not None else None,
                end - s.arrival_time,
            ),
            logprobs=list(s.logprobs) if s.params.logprobs is not None else None,
            request_id=s.request_id,
            error=s.error,
        )
