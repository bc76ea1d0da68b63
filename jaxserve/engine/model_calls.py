"""The engine's calls into the executor: building the runner (and its ProgramSet) from an
``EngineConfig``, and ``ModelCalls.run``: one checked program call on a ``StepBatch`` built
from the scheduled rows, its integrity counters, the rows it aborts, the step observers."""
from __future__ import annotations

import os
import time
from typing import Callable

from jaxserve.engine.input_batch import build_batch
from jaxserve.engine.outputs import StepRecord
from jaxserve.executor.program_cache import ProgramCache
from jaxserve.executor.programs import ProgramSet
from jaxserve.executor.runner import ModelRunner
from jaxserve.kv.page_tracker import NoOpTracker, PageTracker, TrackerStats, integrity_errors
from jaxserve.models.attention_backends import default_backend


def make_runner(model, config, fmt, mesh, max_model_len: int) -> tuple[ModelRunner, ProgramSet]:
    """The runner ``config`` describes, and the ProgramSet every serving program is built into
    ahead of time (from the program cache on disk when it holds it): all at warm-up, or each on
    first use before it."""
    runner = ModelRunner(
        model, fmt, config.num_pages, config.page_size, mesh,
        PageTracker() if config.integrity_check else NoOpTracker(),
        max_pages_per_seq=-(-max_model_len // config.page_size),
        prefill_weights=config.prefill_weights, decode_weights=config.decode_weights,
        attention_backend=config.attention_backend or default_backend(),
        matmul_backend=config.matmul_backend,
        quantize_tied_head=config.tied_head_weights or config.quantize_tied_head,
        prefill_from_decode_weights=config.prefill_from_decode_weights, strict=config.strict_compiles,
        batch_invariant=config.batch_invariant, role=config.role,
    )
    cache = None if config.program_cache in (None, "off") else ProgramCache(config.program_cache)
    programs = ProgramSet(cache, runner.key_parts(), config.compile_workers or os.cpu_count() or 1)
    runner.use_programs(programs)
    return runner, programs


class ModelCalls:
    """runner: the ModelRunner; page_size: the engine's; running(): how many requests run now
    (for the step records); abort(request_id, error): the engine's end of a row that failed
    its integrity check."""

    def __init__(self, runner, page_size: int, running: Callable[[], int], abort: Callable):
        self.runner, self.page_size, self.running, self.abort = runner, page_size, running, abort
        self.stats = TrackerStats()
        self.observers: list[Callable[[StepRecord], None]] = []

    def run(self, phase: str, rows, b: int, t: int, all_logits: bool = False):
        """rows: (seq, new token ids, start position) -> the checked program's StepResult over
        a b x t bucket; rows that fail the integrity check are aborted."""
        batch = build_batch(phase, [(toks, start, seq.pages, seq.expected) for seq, toks, start in rows], b, t,
                            self.runner.max_pages_per_seq, self.page_size, all_logits)
        t0 = time.perf_counter()
        res = self.runner.step(batch)
        if self.observers:
            rec = StepRecord(phase, len(rows), int(batch.new_lens.sum()), b, t, self.running(),
                             time.perf_counter() - t0)
            for fn in list(self.observers):
                fn(rec)
        self.stats.record(res.ok, res.cause, len(rows))
        for err in integrity_errors([r[0].request_id for r in rows], res.ok, res.cause):
            self.abort(err.request_id, err)
        return res
