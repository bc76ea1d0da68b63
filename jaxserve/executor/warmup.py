"""Building every serving program of a ``WarmupPlan`` on the executor (the runner) at warm-up.

A plan names the buckets a configuration can use (decode rows; prefill rows x tokens; the verify
tokens of speculative decoding) and a worker role's KV handoff programs. ``Warmup`` builds them
through the runner's program source (``jaxserve.executor.sources``: ahead of time into its
ProgramSet, or on the jit path one mirrored call each): every checked step (largest bucket
first), the generation updates, and the plain greedy and sampling variants of the sampler for
each (logits rows, sampled rows) pair a step can meet (ahead of time a call with fewer sampled
rows pads up to a built one; the jit path builds every smaller row count too). With
``on_serviceable`` (ahead of time only) it builds first the programs that let any batch run (the
largest decode and prefill buckets, the updates, the samplers of those row counts), calls it,
and then builds the rest; meanwhile ``bucket_for`` gives each step the smallest *built* bucket
that holds it (a batch padded further is slower, never compiled), so a server can answer
requests while it warms. The KV handoff programs run on the pools, so they warm up before
``on_serviceable``. The sampler programs are the engine's (``Samplers``); the runner is marked
warm at the end (serving while warming: from the start, so steps pick built buckets).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

from jaxserve.executor.buckets import pow2_buckets, step_name
from jaxserve.executor.programs import ProgramSpec


@dataclasses.dataclass(frozen=True)
class WarmupPlan:
    decode: list[int]  # decode rows buckets
    prefill: list[tuple[int, int]]  # (prefill rows, tokens) buckets
    verify_tokens: int = 0  # speculative decoding's k + 1 (0: no verify program)
    handoff_exports: tuple[str, ...] = ()  # KV formats a prefill worker exports to
    handoff_imports: bool = False  # a decode worker imports


class Samplers(Protocol):
    """The sampler programs warm-up builds after the steps (``engine.sampler.SamplerPrograms``):
    a spec whose ``warm`` is one call on zeros (the jit path's build)."""

    def spec(self, logits_sharding, rows: int, n: int, greedy: bool) -> ProgramSpec: ...


class Warmup:
    """The build of ``plan`` through ``runner.source``."""

    def __init__(self, runner, plan: WarmupPlan, samplers: Samplers):
        self.source, self.samplers_of = runner.source, samplers
        decode = plan.decode if "decode" in runner.phase_params else []  # a prefill worker: no decode program
        self.decode, self.prefill = decode, plan.prefill
        # Specs are made now, on the engine's thread, from the runner's current arrays.
        self.steps = runner.program_specs(decode, plan.prefill, plan.verify_tokens)
        # A step samples at most the rows of its bucket: ahead of time fewer (a prefill step's rows
        # that complete a prompt, a decode row that failed its check) pad up to the built sampler
        # for all of them (``sample_sequences``), so one sampler per row count: a smaller one would
        # save microseconds per step and cost seconds of compile at start.
        rows = sorted(set(decode) | {r for r, _ in plan.prefill})
        pairs = [(r, n) for r in rows for n in ([r] if self.source.pads else pow2_buckets(1, r))]
        self.samplers = [(r, n, greedy) for r, n in pairs for greedy in (True, False)]
        self.total = len(self.steps) + len(self.samplers)

    def core(self) -> tuple[set[str], set[int]]:
        """The step names and logits row counts that let any batch run (padded)."""
        largest = max(self.prefill, key=lambda s: s[0] * s[1])
        names = {step_name("prefill", *largest)} | {step_name("decode", d, 1) for d in self.decode[-1:]}
        names |= {s.name for s in self.steps if s.name.startswith("updates/")}
        return names, {largest[0], *self.decode[-1:]}

    def run(self, progress: Callable[[int, int], None] | None = None,
            on_serviceable: Callable[[], None] | None = None) -> None:
        source = self.source
        report = (lambda *_: progress(source.built(), self.total)) if progress else None
        names, rows = self.core() if on_serviceable else (None, None)
        first = [s for s in self.steps if names is None or s.name in names]
        source.build(first, report)
        # The sampler reads the logits where the step programs leave them (their sharding).
        sharding = source.output_sharding(first[0].name)
        samplers = [self.samplers_of.spec(sharding, r, n, g) for r, n, g in self.samplers]
        if on_serviceable is not None:
            source.build([s for s, (r, _, _) in zip(samplers, self.samplers) if r in rows], report)
            on_serviceable()
        source.build([s for s in self.steps if s.name not in names] if names else [], report)
        source.build(samplers, report)


def warm(runner, plan: WarmupPlan, samplers: Samplers, progress: Callable[[int, int], None] | None = None,
         on_serviceable: Callable[[], None] | None = None) -> None:
    """Build every program of ``plan`` on ``runner``; see the module doc."""
    early = on_serviceable is not None and runner.source.pads  # serve while the rest builds

    def handoff_then_serve():
        if plan.handoff_exports or plan.handoff_imports:
            runner.warmup_handoff(list(plan.handoff_exports), imports=plan.handoff_imports)
        if on_serviceable is not None:
            on_serviceable()

    if early:  # the guard is on from the start: steps pick built buckets
        runner.mark_warm()
    Warmup(runner, plan, samplers).run(progress, handoff_then_serve if early else None)
    if not early:
        handoff_then_serve()
    runner.mark_warm()


def bucket_for(programs, phase: str, b: int, t: int, buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """The smallest built bucket (fewest rows x tokens) that holds b rows of t tokens; (b, t)
    itself when built, or when none is (the caller's program then compiles and is counted)."""
    if step_name(phase, b, t) in programs:
        return b, t
    ready = [(bb, tt) for bb, tt in buckets if bb >= b and tt >= t and step_name(phase, bb, tt) in programs]
    return min(ready, key=lambda s: (s[0] * s[1], s[0])) if ready else (b, t)
