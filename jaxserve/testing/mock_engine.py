"""``MockEngine``: ``LLMEngine``'s public interface with arithmetic in place of the model.

The host side is the engine's own (``Scheduler`` with fair share and chunked prefill, the
``BlockManager`` with its prefix cache, the ``OutputProcessor``'s stop conditions, text and
deltas), so pages, cached tokens, admissions and stops behave as they do in a real engine. Only
the programs are replaced by ``next_token``, which a test computes by hand:

    greedy (temperature 0):  next = (last + 1) % vocab_size
    sampled:                 next = (last + 1 + seed % 7) % vocab_size

where ``last`` is the request's last token (prompt or output) and ``seed`` the request's
(``SamplingParams.seed``, else one the engine draws). Log-probs: the sampled token's is
``-ln 2``, and the top n are ``next + j`` (mod vocab_size) with ``-(j + 1) ln 2``.

Not modelled: grammars (``check_structured`` and a structured request raise ValueError), the KV
handoff (export_kv / kv_import raise ValueError) and the page integrity check. For fault
injection a test calls ``fail_next_step(error)`` (the next ``step()`` raises it); to watch a server
before it is ready, it sets ``warmup_gate`` (a ``threading.Event`` warm-up waits for); for a
scripted answer (tool calls, reasoning), ``script``: the output ids every request generates
in order (then EOS) in place of ``next_token``'s.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import time
from typing import Callable

import numpy as np

from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.outputs import Completion, EngineSnapshot, RequestFailed, RequestOutput, StepRecord
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.sequence import Sequence, check_prompt

LN2 = math.log(2.0)
SEED_STRIDE = 7  # sampled requests step by 1 + seed % SEED_STRIDE


def next_token(last: int, params: SamplingParams, seed: int, vocab_size: int) -> int:
    """The mock model: the token after ``last`` (see the module docstring)."""
    step = 1 if params.greedy else 1 + seed % SEED_STRIDE
    return (last + step) % vocab_size


def top_logprobs(token: int, n: int, vocab_size: int) -> dict[int, float]:
    """The top ``n`` alternatives of a sampled ``token``: ``token + j`` with ``-(j + 1) ln 2``."""
    return {(token + j) % vocab_size: -(j + 1) * LN2 for j in range(n)}


@dataclasses.dataclass
class MockPrograms:
    """What the server reads of the engine's ``ProgramSet``: its counts."""

    compiled: int = 0
    loaded: int = 0
    total: int = 4  # "programs" the mock warm-up reports progress over

    def __contains__(self, name) -> bool:
        return True


class MockEngine:
    """LLMEngine's public interface over a mock model (see the module docstring).

    vocab_size: the ids a prompt may hold and the mock produces; max_model_len: the context
    (default 4096); step_seconds: how long each step takes (a sleep: requests stay in flight
    long enough for a test to act on them, as a model's would); engine_kwargs: EngineConfig fields (num_pages, page_size, max_num_seqs, ...).
    """

    def __init__(self, tokenizer=None, vocab_size: int = 49152, max_model_len: int = 4096,
                 eos_token_ids=(1,), step_seconds: float = 0.0, **engine_kwargs):
        self.config = config = EngineConfig(**engine_kwargs)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = min(config.max_model_len or max_model_len, max_model_len)
        self.pool_tokens = (config.num_pages - 1) * config.page_size
        self.bm = BlockManager(config.num_pages, config.page_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler_config(), self.bm)
        eos = set(eos_token_ids) | set(tokenizer.eos_token_ids if tokenizer is not None else [])
        self.eos_token_ids = frozenset(eos)
        self.outputs = OutputProcessor(tokenizer, self.eos_token_ids, self.max_model_len, config.keep_finished)
        self.programs = MockPrograms()
        self.steps = 0  # step() calls that ran
        self.step_seconds = step_seconds
        self._ids = itertools.count()
        self._seed_rng = np.random.default_rng(config.seed)
        self._just_finished: list[Sequence] = []
        self._observers: list[Callable[[StepRecord], None]] = []
        self._fail_next: Exception | None = None
        self.warm = False
        self.warmup_gate = None  # a threading.Event warm-up waits for (at most 120 s), if set
        self.script: list[int] | None = None  # set: every request's output ids (then EOS)

    # ------------------------------------------------------------------ what the server reads
    def memory_report(self) -> dict:
        usable = self.config.num_pages - 1
        return {"weight_bytes": {"prefill": 0, "decode": 0, "resident": 0}, "kv_format": "float32",
                "kv_bytes": 0, "kv_bytes_per_page": 0, "kv_bytes_per_token": 0, "kv_pages": usable,
                "max_cached_tokens": usable * self.config.page_size}

    def kv_layout(self, fmt: str | None = None) -> str:
        return f"mock/{fmt or 'float32'}/page{self.config.page_size}"

    def handoff_fingerprint(self) -> str:
        return ""

    def snapshot(self) -> EngineSnapshot:
        bm = self.bm
        return EngineSnapshot(
            waiting=len(self.scheduler.waiting), running=len(self.scheduler.running),
            kv_pages_total=bm.num_pages - 1, kv_pages_used=bm.num_used_pages, kv_pages_free=bm.num_free_pages,
            integrity_checks=0, integrity_rows=0, integrity_mismatches={}, compiles_after_warmup=0,
            preemptions=self.scheduler.num_preemptions,
            programs_compiled=self.programs.compiled, programs_loaded=self.programs.loaded)

    def add_step_observer(self, fn: Callable[[StepRecord], None]) -> Callable[[], None]:
        self._observers.append(fn)
        return lambda: self._observers.remove(fn)

    def warmup(self, progress: Callable[[int, int], None] | None = None,
               on_serviceable: Callable[[], None] | None = None) -> None:
        """Reports ``MockPrograms.total`` programs built, one by one; compiles nothing."""
        if self.warmup_gate is not None:
            self.warmup_gate.wait(120)
        total = self.programs.total
        for done in range(1, total + 1):
            self.programs.compiled = done
            if progress is not None:
                progress(done, total)
            if on_serviceable is not None and done == 1:
                on_serviceable()
        self.warm = True

    def mark_warm(self) -> None:
        self.warm = True

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_ids, params: SamplingParams, request_id: str | None = None,
                    export_kv: str | None = None, kv_import=None, client: str = "") -> str:
        if export_kv is not None or kv_import is not None:
            raise ValueError("the mock engine has no KV handoff")
        if params.structured is not None:
            raise ValueError("the mock engine has no grammars")
        ids = check_prompt(prompt_ids, params.max_tokens, self.vocab_size, self.max_model_len, self.pool_tokens)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        old = self.outputs.get(rid)
        if old is not None and not old.finished:
            raise ValueError(f"request id {rid!r} is already running")
        seed = params.seed % 2**31 if params.seed is not None else int(self._seed_rng.integers(0, 2**31 - 1))
        seq = Sequence(rid, ids, params, seed, client=str(client))
        self.outputs.add(seq)
        self.scheduler.add(seq)
        return rid

    def check_structured(self, spec) -> None:
        raise ValueError("the mock engine has no grammars")

    def abort(self, request_id: str) -> bool:
        seq = self.outputs.get(request_id)
        if seq is None or seq.finished:
            return False
        self._finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._just_finished)

    def get_request(self, request_id: str) -> Sequence | None:
        return self.outputs.get(request_id)

    def completion(self, request_id: str) -> Completion | None:
        seq = self.outputs.get(request_id)
        return self.outputs.completion(seq) if seq is not None else None

    def fail_next_step(self, error: Exception) -> None:
        """The next ``step()`` raises ``error`` (once), as a failed program call would."""
        self._fail_next = error

    def run_until_done(self) -> None:
        while self.has_unfinished():
            self.step()

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        if self._fail_next is not None:
            error, self._fail_next = self._fail_next, None
            raise error
        if self.step_seconds:
            time.sleep(self.step_seconds)
        sched = self.scheduler.schedule()
        self.bm.take_generation_updates()  # no device generations to update
        events: dict[str, list[int]] = {}
        prefill = [c for c in sched.prefill if not c.seq.finished]
        for c in prefill:
            c.seq.num_computed += c.num_tokens
            self.bm.commit_full_pages(c.seq.request_id, c.seq.all_ids[: c.seq.num_computed])
            if c.completes_prompt and not c.seq.output_ids:
                self._emit(c.seq, events)
        decode = [s for s in sched.decode if not s.finished]
        for s in decode:
            s.num_computed += 1
            self.bm.commit_full_pages(s.request_id, s.all_ids[: s.num_computed])
            self._emit(s, events)
        self.steps += 1
        self._observe(prefill, decode)
        return self._collect(events, sched)

    def _observe(self, prefill, decode) -> None:
        running = len(self.scheduler.running)
        for phase, rows, tokens in (("prefill", len(prefill), sum(c.num_tokens for c in prefill)),
                                    ("decode", len(decode), len(decode))):
            if rows:
                rec = StepRecord(phase, rows, tokens, rows, max(1, tokens // rows), running, 0.0)
                for fn in list(self._observers):
                    fn(rec)

    def _emit(self, s: Sequence, events) -> None:
        tok = next_token(s.all_ids[-1], s.params, s.seed, self.vocab_size)
        if self.script is not None:
            k = len(s.output_ids)
            tok = self.script[k] if k < len(self.script) else min(self.eos_token_ids)
        n = s.params.logprobs or 0
        events.setdefault(s.request_id, []).append(tok)
        try:
            reason = self.outputs.append(s, tok, -LN2, top_logprobs(tok, n, self.vocab_size) if n else None,
                                         time.perf_counter())
        except Exception as e:  # detokenization or a stop check raised: this request alone fails
            self._finish(s, "abort", RequestFailed(s.request_id, "detokenize / stop check", e))
            return
        if reason is not None:
            self._finish(s, reason)

    def _finish(self, s: Sequence, reason: str, error: Exception | None = None) -> None:
        if s.finished:
            return
        self.scheduler.finish(s, reason, error)
        self.outputs.finished(s, reason)
        self._just_finished.append(s)

    def _collect(self, events, sched) -> list[RequestOutput]:
        """As LLMEngine's: sampled tokens, finished requests, and admissions (started=True once)."""
        seqs = {rid: self.outputs.get(rid) for rid in events}
        seqs.update((s.request_id, s) for s in self._just_finished)
        seqs.update((c.seq.request_id, c.seq) for c in sched.prefill)
        self._just_finished = []
        outs = []
        for rid, s in seqs.items():
            started = not s.started and (s.admitted or s.finished)
            s.started = s.started or started
            if started or events.get(rid) or s.finished:
                outs.append(self.outputs.output(s, events.get(rid, []), started=started))
        return outs

