"""The engine: requests in, token deltas out, one ``step()`` at a time.

Public interface (what the server, ``LLM``, benchmarks and experiments use): ``add_request``,
``abort``, ``step``, ``has_unfinished``, ``snapshot`` (queue, pages, integrity and compile
counts), ``add_step_observer`` (a callback per program call, for measurement),
``prompt_logprobs`` (scoring through the checked prefill program), ``warmup`` and
``memory_report``.

Each step: the scheduler picks a prefill batch and a decode batch; the block manager's
generation bumps are applied on device; the prefill program and then the decode program
run (each checks every row's pages first); rows that fail the check are aborted with an
``IntegrityError`` and emit nothing; sampled tokens go to the output processor, which
detokenizes, checks stop conditions and builds the outputs. The engine holds its parts: the
runner (``jaxserve.executor``), ``ModelCalls`` (each program call on one ``StepBatch``),
``RowSampling`` (sampling and emitting each row's token), ``KvHandoff`` (``jaxserve.disagg``).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Callable

import jax
import numpy as np

from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.model_calls import ModelCalls, make_runner
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.outputs import Completion, EngineSnapshot, RequestOutput, StepRecord
from jaxserve.engine.row_sampling import RowSampling
from jaxserve.engine.warming import step_bucket, warm_engine
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.scheduler import Scheduler
from jaxserve.disagg.engine_part import KvHandoff
from jaxserve.disagg.handoff_request import KvImport
from jaxserve.engine.sequence import Sequence, check_prompt
from jaxserve.kv import memory as kv_memory
from jaxserve.structured.constraints import Constraints
from jaxserve.executor.buckets import bucket, pick_bucket, step_name, token_buckets
from jaxserve.engine.speculative.setup import make_speculative

log = logging.getLogger("jaxserve.engine")


class LLMEngine:
    def __init__(self, model, config: EngineConfig, fmt, tokenizer=None, mesh=None):
        page_bytes = kv_memory.format_token_bytes(fmt, *kv_memory.model_token_layout(model, fmt)) * config.page_size
        budget = kv_memory.kv_budget(config.kv_cache_memory, config.memory_fraction)
        if budget is not None:  # the byte budget decides the page count
            config = dataclasses.replace(config, num_pages=kv_memory.pages_for_budget(budget, page_bytes))
        self.kv_page_bytes = page_bytes
        self.config = config
        self.cfg = model.cfg
        self.tokenizer = tokenizer
        self.pool_tokens = (config.num_pages - 1) * config.page_size
        self.max_model_len = min(config.max_model_len or self.cfg.max_position_embeddings, self.cfg.max_position_embeddings)
        self.bm = BlockManager(config.num_pages, config.page_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler_config(), self.bm)
        self.runner, self.programs = make_runner(model, config, fmt, mesh, self.max_model_len)
        # Prefill programs: rows in powers of two, tokens in token_buckets (compiled at warm-up).
        self.prefill_token_buckets = token_buckets(16, min(config.prefill_chunk, config.max_num_batched_tokens))
        eos = set(self.cfg.eos_token_id) | set(tokenizer.eos_token_ids if tokenizer is not None else [])
        self.eos_token_ids = frozenset(eos)
        self.outputs = OutputProcessor(tokenizer, self.eos_token_ids, self.max_model_len, config.keep_finished)
        # Structured outputs: grammars compiled against the tokenizer, masks into the sampler.
        self.constraints = Constraints(tokenizer, self.cfg.vocab_size, self.eos_token_ids, config.max_grammar_bytes,
                                       config.grammar_compile_ms)
        self._ids = itertools.count()
        self._seed_rng = np.random.default_rng(config.seed)
        self._just_finished: list[Sequence] = []
        # The step's parts: the program calls (integrity counters, observers) and the sampling after them.
        self.calls = ModelCalls(self.runner, config.page_size, lambda: len(self.scheduler.running),
                                lambda rid, err: self._finish(self.outputs.get(rid), "abort", err))
        self.stats = self.calls.stats
        self.rows = RowSampling(self.runner, self.cfg.vocab_size, config.batch_invariant, self.outputs,
                                self.constraints, self._finish)
        # The KV handoff (disaggregated serving: jaxserve.disagg), and the worker role it checks.
        self.kv_handoff = KvHandoff(self.runner, config, self.cfg.vocab_size, self.cfg.architecture, self.bm,
                                    self.scheduler, self.outputs, self.constraints, self._finish)
        self.spec = make_speculative(config, self.cfg, self.max_model_len, self.bm)
        if self.spec is not None:  # its auto-off weighs acceptance against the calls' measured cost
            self.add_step_observer(self.spec.observe)

    def memory_report(self) -> dict:
        """What the engine holds: weight bytes per phase (and resident: shared arrays once), the
        KV pool's bytes and pages (the null page included in the bytes, not in kv_pages), and
        the tokens those pages cache."""
        usable = self.config.num_pages - 1
        return {
            "weight_bytes": self.runner.weight_bytes(),
            "kv_format": self.runner.fmt.name,
            "kv_bytes": int(sum(x.nbytes for x in jax.tree.leaves(self.runner.kv))),
            "kv_bytes_per_page": self.kv_page_bytes,
            "kv_bytes_per_token": self.kv_page_bytes // self.config.page_size,
            "kv_pages": usable,
            "max_cached_tokens": usable * self.config.page_size,
        }

    def snapshot(self) -> EngineSnapshot:
        st, bm = self.stats, self.bm
        return EngineSnapshot(
            waiting=len(self.scheduler.waiting), running=len(self.scheduler.running),
            kv_pages_total=bm.num_pages - 1, kv_pages_used=bm.num_used_pages, kv_pages_free=bm.num_free_pages,
            integrity_checks=st.checks_run, integrity_rows=st.rows_checked,
            integrity_mismatches=dict(st.mismatches_by_cause), compiles_after_warmup=self.runner.compiles_after_warmup,
            preemptions=self.scheduler.num_preemptions,
            programs_compiled=self.programs.compiled, programs_loaded=self.programs.loaded,
            constraints=dict(dataclasses.asdict(self.constraints.stats),
                             compile_seconds=self.constraints.compile_seconds()),
            **(self.spec.totals() if self.spec is not None else {}),
        )

    def add_step_observer(self, fn: Callable[[StepRecord], None]) -> Callable[[], None]:
        """Call ``fn(StepRecord)`` after every program call; returns a function that removes it."""
        self.calls.observers.append(fn)
        return lambda: self.calls.observers.remove(fn)

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_ids, params: SamplingParams, request_id: str | None = None,
                    export_kv: str | None = None, kv_import: KvImport | None = None, client: str = "") -> str:
        """Validate and queue a request; returns its id. Bad input raises ValueError.
        ``client``: who sent it, for the scheduler's fair share between clients (any string:
        the server passes a hashed API key or the connection; "" is one client like any other).

        KV handoff: with ``export_kv`` (a KV format name) the request stops after its first
        token and its last output carries the prompt's pages in that format (``kv_export``);
        with ``kv_import`` its prompt's pages come from another engine (mapped under this
        engine's own page ids at admission, digest checked on device) and it continues from
        the first token that engine sampled."""
        self.kv_handoff.check_request(export_kv)
        if export_kv is not None:
            params = dataclasses.replace(params, max_tokens=1)
        ids = check_prompt(prompt_ids, params.max_tokens, self.cfg.vocab_size, self.max_model_len, self.pool_tokens)
        if kv_import is not None:
            self.kv_handoff.check_import(kv_import, ids)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        old = self.outputs.get(rid)
        if old is not None and not old.finished:
            raise ValueError(f"request id {rid!r} is already running")
        # Any integer seed works: it is folded into the 31-bit range the PRNG key takes.
        seed = params.seed % 2**31 if params.seed is not None else int(self._seed_rng.integers(0, 2**31 - 1))
        seq = Sequence(rid, ids, params, seed, client=str(client), export_kv=export_kv, kv_import=kv_import)
        if params.structured is not None:  # compiled now: a grammar that cannot compile runs nothing
            seq.grammar = self.constraints.start(params.structured)
        self.outputs.add(seq)
        self.scheduler.add(seq)
        return rid

    def check_structured(self, spec) -> None:
        """Raise ValueError naming the problem if the grammar ``spec`` (a StructuredOutput)
        cannot compile; compiled once, so the request that follows reuses it. Thread-safe."""
        self.constraints.compiler.check(spec)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its pages; its final output (finish_reason "abort") comes
        from the next ``step()``. False if unknown or already finished."""
        seq = self.outputs.get(request_id)
        if seq is None or seq.finished:
            return False
        self._finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        """Requests queued or running, or final outputs not yet returned by ``step()``."""
        return self.scheduler.num_unfinished > 0 or bool(self._just_finished)

    def get_request(self, request_id: str) -> Sequence | None:
        """The engine's record of a request (unfinished, or among the last ``keep_finished``
        finished ones): for inspection and fault-injection tests; not for changing it."""
        return self.outputs.get(request_id)

    def completion(self, request_id: str) -> Completion | None:
        """The request's completion so far (finished ones are kept for ``keep_finished`` more)."""
        seq = self.outputs.get(request_id)
        return self.outputs.completion(seq) if seq is not None else None

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        if self.spec is not None:  # draft tokens first: the scheduler maps their slots
            self.spec.propose(self.scheduler.running, waiting=bool(self.scheduler.waiting))
        sched = self.scheduler.schedule()
        self.runner.apply_generation_updates(*self.bm.take_generation_updates())
        events: dict[str, list[int]] = {}  # request id -> token ids sampled this step
        for seq in sched.imported:
            self.kv_handoff.map_imported(seq, events)
        if sched.prefill:
            chunks = [c for c in sched.prefill if not c.seq.finished]
            rows = [(c.seq, c.seq.all_ids[c.start : c.start + c.num_tokens], c.start) for c in chunks]
            t = pick_bucket(max(len(r[1]) for r in rows), self.prefill_token_buckets)
            res = self.calls.run("prefill", rows, *step_bucket(self, "prefill", bucket(len(rows)), t))
            to_sample = []
            for i, c in enumerate(chunks):
                if not res.ok[i] or c.seq.finished:
                    continue
                c.seq.num_computed += c.num_tokens
                self.bm.commit_full_pages(c.seq.request_id, c.seq.all_ids[: c.seq.num_computed])
                if c.completes_prompt and not c.seq.output_ids:
                    to_sample.append((i, c.seq))
            self.rows.sample(res.logits, to_sample, events)
        decode = [s for s in sched.decode if not s.finished]
        verify = self._verify_bucket(len(decode)) if decode and self.spec is not None else None
        if decode and self.spec is not None and self.spec.verifies(decode, verify):
            self.spec.verify(decode, lambda rows: self.calls.run("verify", rows, *verify), self.rows.emit, events,
                             draft=lambda rows: self.calls.run("draft", rows, *verify), constraints=self.constraints)
        elif decode:
            rows = [(s, [s.output_ids[-1]], s.total_len - 1) for s in decode]
            masks = self.constraints.prefetch(decode)  # on a worker thread while the device runs the step
            res = self.calls.run("decode", rows, *step_bucket(self, "decode", bucket(len(rows)), 1))
            to_sample = []
            for i, s in enumerate(decode):
                if res.ok[i] and not s.finished:
                    s.num_computed += 1
                    self.bm.commit_full_pages(s.request_id, s.all_ids[: s.num_computed])
                    to_sample.append((i, s))
            self.rows.sample(res.logits, to_sample, events, masks)
        return self._collect(events, sched)

    def _collect(self, events, sched) -> list[RequestOutput]:
        """Outputs of this step: sampled tokens, finished requests, and admissions (the first
        output of each request says started=True, with or without tokens)."""
        seqs = {rid: self.outputs.get(rid) for rid in events}
        seqs.update((s.request_id, s) for s in self._just_finished)
        seqs.update((c.seq.request_id, c.seq) for c in sched.prefill)
        seqs.update((s.request_id, s) for s in sched.imported)
        self._just_finished = []
        outs = []
        for rid, s in seqs.items():
            started = not s.started and (s.admitted or s.finished)
            s.started = s.started or started
            if started or events.get(rid) or s.finished:
                outs.append(self.outputs.output(s, events.get(rid, []), started=started))
        return outs

    def prompt_logprobs(self, token_ids) -> np.ndarray:
        """float32 [T, vocab]: row t is log p(next token | token_ids[: t + 1]), through the
        checked prefill program (one chunk; pages from the block manager, never from under a
        cached prefix, released afterwards). Only between requests."""
        if self.has_unfinished():
            raise RuntimeError("prompt_logprobs() cannot run while requests are in flight")
        ids = check_prompt(token_ids, 0, self.cfg.vocab_size, self.max_model_len, self.pool_tokens)
        key = ("logprobs", next(self._ids))
        alloc = self.bm.allocate_prompt(key, ids, use_prefix_cache=False)
        try:
            self.runner.apply_generation_updates(*self.bm.take_generation_updates())
            seq = Sequence(str(key), ids, SamplingParams(), 0, pages=list(alloc.pages),
                           expected=self.bm.expected_generations(key))
            res = self.calls.run("prefill", [(seq, ids, 0)], 1, bucket(len(ids), 16), all_logits=True)
            if not res.ok[0]:
                raise RuntimeError("the integrity check failed for the scoring pages")
            return np.asarray(jax.nn.log_softmax(res.logits[0, : len(ids)], axis=-1), np.float32)
        finally:
            self.bm.free(key)

    def _verify_bucket(self, n: int) -> tuple[int, int] | None:
        """The verify bucket for n decode rows, or None while warm-up has not built one."""
        b, t = step_bucket(self, "verify", bucket(n), self.spec.verify_tokens)
        names = [step_name(p, b, t) for p in (("verify", "draft") if self.spec.proposer.on_device else ("verify",))]
        built = not self.runner.warm or self.runner.programs is None or all(n in self.programs for n in names)
        return (b, t) if built else None

    def _finish(self, s: Sequence, reason: str, error: Exception | None = None) -> None:
        if s.finished:
            return
        self.kv_handoff.export(s, reason)  # a prefill for a handoff: the prompt's pages, before they are released
        self.scheduler.finish(s, reason, error)
        self.outputs.finished(s, reason)
        self._just_finished.append(s)

    # ------------------------------------------------------------------ warm-up
    def warmup(self, progress: Callable[[int, int], None] | None = None,
               on_serviceable: Callable[[], None] | None = None) -> None:
        """Build every serving program the configuration can use (``jaxserve.engine.warming``),
        from the program cache when it holds them, and a worker role's KV handoff programs;
        ``progress(done, total)`` follows them. With ``on_serviceable`` (serving while warming,
        from another thread than ``step``'s) the guard is on from the start and it is called
        once any batch can run (padded)."""
        warm_engine(self, progress, on_serviceable)

    def kv_layout(self, fmt: str | None = None) -> str:
        """This engine's KV layout signature (in ``fmt``; default its pool's format)."""
        return self.kv_handoff.layout(fmt)

    def handoff_fingerprint(self) -> str:
        """The weights-and-formats fingerprint a prefill and a decode worker compare ('' for "both")."""
        return self.kv_handoff.fingerprint()

    def mark_warm(self) -> None:
        """Count every later compilation of a serving program (after a warm-up of one's own
        that compiled only the shapes a run needs; ``warmup()`` marks it itself)."""
        self.runner.mark_warm()

    def run_until_done(self) -> None:
        """Step until every request has finished (their outputs are dropped)."""
        while self.has_unfinished():
            self.step()
