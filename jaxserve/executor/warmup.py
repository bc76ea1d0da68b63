"""Building every serving program of a ``WarmupPlan`` on the executor (the runner) at warm-up.

A plan names the buckets a configuration can use (decode rows; prefill rows x tokens; the verify
tokens of speculative decoding) and a worker role's KV handoff programs. With a ProgramSet
(``runner.programs``) ``Warmup`` builds into it every checked step (largest bucket first), the
generation updates, and the plain greedy and sampling variants of the sampler for each (logits
rows, sampled rows) pair a step can meet (a call with fewer sampled rows pads up to a built one).
With ``on_serviceable`` it builds first the programs that let any batch run (the largest decode
and prefill buckets, the updates, the samplers of those row counts), calls it, and then builds
the rest; meanwhile ``bucket_for`` gives each step the smallest *built* bucket that holds it (a
batch padded further is slower, never compiled), so a server can answer requests while it warms.

A runner without a ProgramSet (a mesh over several processes) warms through the jit path: each
bucket's step and update called once on null inputs, every call mirrored to the followers, so
every process compiles the same programs in the same order; the samplers at every row count.
The KV handoff programs run on the pools, so they warm up before ``on_serviceable``. The sampler
programs are the engine's (``Samplers``: their spec, or one jit call); the runner is marked warm
at the end (with ``on_serviceable``, from the start: steps then pick built buckets).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

import numpy as np

from jaxserve.executor.buckets import pow2_buckets, step_name
from jaxserve.executor.programs import ProgramSpec
from jaxserve.step_batch import StepBatch


@dataclasses.dataclass(frozen=True)
class WarmupPlan:
    decode: list[int]  # decode rows buckets
    prefill: list[tuple[int, int]]  # (prefill rows, tokens) buckets
    verify_tokens: int = 0  # speculative decoding's k + 1 (0: no verify program)
    handoff_exports: tuple[str, ...] = ()  # KV formats a prefill worker exports to
    handoff_imports: bool = False  # a decode worker imports


class Samplers(Protocol):
    """The sampler programs warm-up builds after the steps (``engine.sampler.SamplerPrograms``)."""

    def spec(self, logits_sharding, rows: int, n: int, greedy: bool) -> ProgramSpec: ...

    def run(self, rows: int, n: int, greedy: bool) -> None: ...


class Warmup:
    """The ahead-of-time build of ``plan`` into ``runner.programs``."""

    def __init__(self, runner, plan: WarmupPlan, samplers: Samplers):
        self.runner, self.programs, self.samplers_of = runner, runner.programs, samplers
        decode = plan.decode if "decode" in runner.phase_params else []  # a prefill worker: no decode program
        self.decode, self.prefill = decode, plan.prefill
        # Specs are made now, on the engine's thread, from the runner's current arrays.
        self.steps = runner.program_specs(decode, plan.prefill, plan.verify_tokens)
        # A step samples at most the rows of its bucket: fewer (a prefill step's rows that complete
        # a prompt, a decode row that failed its check) pad up to the built sampler for all of them
        # (``sample_sequences``), so one sampler per row count: a smaller one would save
        # microseconds per step and cost seconds of compile at start.
        pairs = {(r, r) for r in decode} | {(r, r) for r, _ in plan.prefill}
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
        samplers = [self.samplers_of.spec(sharding, r, n, g) for r, n, g in self.samplers]
        if on_serviceable is not None:
            self.programs.build([s for s, (r, _, _) in zip(samplers, self.samplers) if r in rows], report)
            on_serviceable()
        self.programs.build([s for s in self.steps if s.name not in names] if names else [], report)
        self.programs.build(samplers, report)


def warm(runner, plan: WarmupPlan, samplers: Samplers, progress: Callable[[int, int], None] | None = None,
         on_serviceable: Callable[[], None] | None = None) -> None:
    """Build every program of ``plan`` on ``runner``; see the module doc."""

    def handoff_then_serve():
        if plan.handoff_exports or plan.handoff_imports:
            runner.warmup_handoff(list(plan.handoff_exports), imports=plan.handoff_imports)
        if on_serviceable is not None:
            on_serviceable()

    if runner.programs is not None:
        if on_serviceable is not None:  # the guard is on from the start: steps pick built buckets
            runner.mark_warm()
        Warmup(runner, plan, samplers).run(progress, handoff_then_serve if on_serviceable is not None else None)
        if on_serviceable is None:
            handoff_then_serve()
    else:
        _warm_jit(runner, plan)
        for rows in sorted(set(plan.decode) | {b for b, _ in plan.prefill}):
            for n in pow2_buckets(1, rows):
                for greedy in (True, False):
                    samplers.run(rows, n, greedy)
        handoff_then_serve()
    runner.mark_warm()


def _warm_jit(runner, plan: WarmupPlan) -> None:
    """Every serving bucket compiled through the jit path (page tables of padding rows all
    null; a generation update of count 0 is a no-op), each call mirrored to the followers."""
    m = runner.max_pages_per_seq
    decode = plan.decode if "decode" in runner.phase_params else []
    verify = [(b, plan.verify_tokens) for b in decode if plan.verify_tokens]
    for phase, shapes in (("decode", [(b, 1) for b in decode]), ("prefill", plan.prefill), ("verify", verify)):
        for b, t in shapes:
            runner.step(StepBatch.zeros(phase, b, t, m))
    for size in runner.update_sizes():
        z = np.zeros((size,), np.int32)
        runner.apply_padded_updates(z, z)


def bucket_for(programs, phase: str, b: int, t: int, buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """The smallest built bucket (fewest rows x tokens) that holds b rows of t tokens; (b, t)
    itself when built, or when none is (the caller's program then compiles and is counted)."""
    if step_name(phase, b, t) in programs:
        return b, t
    ready = [(bb, tt) for bb, tt in buckets if bb >= b and tt >= t and step_name(phase, bb, tt) in programs]
    return min(ready, key=lambda s: (s[0] * s[1], s[0])) if ready else (b, t)
