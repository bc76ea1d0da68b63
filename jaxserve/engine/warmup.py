"""Which serving programs an engine needs, and building them at warm-up.

``serving_buckets`` lists the buckets a configuration can use: decode rows up to
``max_num_seqs`` (and no more rows than the pool has pages: each running request holds one),
prefill rows up to ``max_prefill_seqs`` (and ``max_num_seqs``) by the prefill token buckets.

``Warmup`` builds them into the engine's ProgramSet: every checked step (largest bucket
first), the generation updates, and the plain greedy and sampling variants of the sampler for
each (logits rows, sampled rows) pair a step can meet (a call with fewer sampled rows pads up to a
built one). With ``on_serviceable`` it builds first the programs
that let any batch run (the largest decode and prefill buckets, the updates, the samplers of
those row counts), calls it, and then builds the rest; meanwhile ``bucket_for`` gives each
step the smallest *built* bucket that holds it (a batch padded further is slower, never
compiled), so a server can answer requests while it warms up.

``warm_engine`` is what ``LLMEngine.warmup`` runs: the plan above, or for a runner without a
ProgramSet (a mesh over several processes) the jit path, whose every device call process 0
mirrors to the followers; then a prefill or decode worker's KV handoff programs (before
``on_serviceable``: they run on the pools). A worker without decode weights
(``role="prefill"``) has no decode bucket. In batch-invariant mode the samplers built are the
per-row ones (``per_row``; their own names and cache keys). ``step_bucket`` is the engine's
bucket choice while warming; ``warm_in_background`` runs a warm-up on a thread of its own and
returns once serviceable (``serve --serve-while-warming``).
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

import numpy as np

from jaxserve.engine.sampler import sample_rows, sampler_spec
from jaxserve.buckets import pow2_buckets, step_name

log = logging.getLogger("jaxserve.engine")


def serving_buckets(config, token_buckets: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """-> (decode rows, [(prefill rows, tokens)]) the configuration can use."""
    usable = config.num_pages - 1
    decode = pow2_buckets(1, max(1, min(config.max_num_seqs, usable)))
    rows = pow2_buckets(1, max(1, min(config.max_prefill_seqs, config.max_num_seqs, usable)))
    return decode, [(b, t) for b in rows for t in token_buckets]


class Warmup:
    def __init__(self, runner, programs, decode: list[int], prefill: list[tuple[int, int]], vocab_size: int,
                 per_row: bool = False, verify_tokens: int = 0):
        self.runner, self.programs, self.vocab_size, self.per_row = runner, programs, vocab_size, per_row
        if "decode" not in runner.phase_params:  # a prefill worker: no decode program
            decode = []
        self.decode, self.prefill = decode, prefill
        # Specs are made now, on the engine's thread, from the runner's current arrays.
        self.steps = runner.program_specs(decode, prefill, verify_tokens)
        # A step samples at most the rows of its bucket: fewer (a prefill step's rows that complete
        # a prompt, a decode row that failed its check) pad up to the built sampler for all of them
        # (``sample_sequences``), so one sampler per row count: a smaller one would save
        # microseconds per step and cost seconds of compile at start.
        pairs = {(r, r) for r in decode} | {(r, r) for r, _ in prefill}
        self.samplers = [(r, n, greedy) for r, n in sorted(pairs) for greedy in (True, False)]
        self.total = len(self.steps) + len(self.samplers)

    def core(self) -> tuple[set[str], set[int]]:
        """The step names and logits row counts that let any batch run (padded)."""
        largest = max(self.prefill, key=lambda s: s[0] * s[1])
        names = {step_name("prefill", *largest)} | {step_name("decode", d, 1) for d in self.decode[-1:]}
        names |= {s.name for s in self.steps if s.name.startswith("updates/")}
        return names, {largest[0], *self.decode[-1:]}

    def run(self, progress: Callable[[int, int], None] | None = None,
            on_serviceable: Callable[[], None] | None = None) -> None:
        report = (lambda *_: progress(len(self.programs.names()), self.total)) if progress else None
        names, rows = self.core() if on_serviceable else (None, None)
        first = [s for s in self.steps if names is None or s.name in names]
        self.programs.build(first, report)
        # The sampler reads the logits where the step programs leave them (their sharding).
        sharding = self.programs.get(first[0].name).output_shardings[0]
        samplers = [sampler_spec(sharding, r, n, self.vocab_size, g, self.per_row) for r, n, g in self.samplers]
        if on_serviceable is not None:
            self.programs.build([s for s, (r, _, _) in zip(samplers, self.samplers) if r in rows], report)
            on_serviceable()
        self.programs.build([s for s in self.steps if s.name not in names] if names else [], report)
        self.programs.build(samplers, report)


def warm_engine(engine, progress: Callable[[int, int], None] | None = None,
                on_serviceable: Callable[[], None] | None = None) -> None:
    """Build every serving program ``engine`` (an LLMEngine) can use; see the module doc. The
    KV handoff programs run on the pools, so they warm up before ``on_serviceable`` (serving
    steps then run on another thread)."""
    runner, config = engine.runner, engine.config
    decode, prefill = serving_buckets(config, engine.prefill_token_buckets)
    verify = engine.spec.verify_tokens if engine.spec is not None else 0

    def handoff_then_serve():
        if config.role != "both":  # the KV handoff programs: export on a prefill worker, import on a decode one
            exports = [] if config.role != "prefill" else sorted({runner.fmt.name,
                                                                 config.kv_handoff_format or "fp8_e4m3"})
            runner.warmup_handoff(exports, imports=config.role == "decode")
        if on_serviceable is not None:
            on_serviceable()

    if runner.programs is not None:
        if on_serviceable is not None:  # the guard is on from the start: steps pick built buckets
            runner.warm = True
        plan = Warmup(runner, runner.programs, decode, prefill, engine.cfg.vocab_size, config.batch_invariant,
                      verify)
        plan.run(progress, handoff_then_serve if on_serviceable is not None else None)
        if on_serviceable is None:
            handoff_then_serve()
    else:
        runner.warmup(decode, prefill, verify)
        for rows in sorted(set(decode) | {b for b, _ in prefill}):
            for n in pow2_buckets(1, rows):
                f32, i32 = np.zeros(n, np.float32), np.zeros(n, np.int32)
                for greedy in (True, False):
                    sample_rows(np.zeros((rows, engine.cfg.vocab_size), np.float32), i32, f32, i32,
                                np.ones(n, np.float32), f32, i32, i32, all_greedy=greedy, penalties=False,
                                num_logprobs=0, per_row=config.batch_invariant)
        handoff_then_serve()
    if engine.spec is not None and "decode" in runner.phase_params:
        engine.spec.warm(lambda: _verify_logits(runner, decode, verify, engine.cfg.vocab_size))
    runner.warm = True


def _verify_logits(runner, decode: list[int], t: int, vocab_size: int):
    """(rows, zero logits [rows, t, V] placed where the verify program leaves its logits) per
    decode bucket: what speculative decoding's acceptance is compiled for."""
    import jax

    for b in decode:
        built = runner.programs.get(step_name("verify", b, t)) if runner.programs is not None else None
        logits = np.zeros((b, t, vocab_size), np.float32)
        yield b, jax.device_put(logits, built.output_shardings[0]) if built is not None else logits


def step_bucket(engine, phase: str, b: int, t: int) -> tuple[int, int]:
    """(b, t), or while warm-up still builds programs, the smallest built bucket holding it."""
    if not engine.runner.warm or engine.runner.programs is None:
        return b, t
    decode, prefill = serving_buckets(engine.config, engine.prefill_token_buckets)
    steps = {"decode": [(d, 1) for d in decode], "verify": [(d, t) for d in decode]}.get(phase, prefill)
    return bucket_for(engine.runner.programs, phase, b, t, steps)


def warm_in_background(engine, progress: Callable[[int, int], None] | None = None) -> None:
    """``engine.warmup`` on a thread of its own; returns once any batch can run (the rest
    builds meanwhile) and raises what warm-up raised before that."""
    serviceable, failed = threading.Event(), []

    def build():
        try:
            engine.warmup(progress=progress, on_serviceable=serviceable.set)
        except BaseException as e:  # before serving, the caller gets it; after, built buckets serve on
            if serviceable.is_set():
                log.exception("warm-up failed after serving began")
            failed.append(e)
            serviceable.set()

    threading.Thread(target=build, name="jaxserve-warmup", daemon=True).start()
    serviceable.wait()
    if failed:
        raise failed[0]


def bucket_for(programs, phase: str, b: int, t: int, buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """The smallest built bucket (fewest rows x tokens) that holds b rows of t tokens; (b, t)
    itself when built, or when none is (the caller's program then compiles and is counted)."""
    if step_name(phase, b, t) in programs:
        return b, t
    ready = [(bb, tt) for bb, tt in buckets if bb >= b and tt >= t and step_name(phase, bb, tt) in programs]
    return min(ready, key=lambda s: (s[0] * s[1], s[0])) if ready else (b, t)
