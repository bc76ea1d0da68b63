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
"""
from __future__ import annotations

from typing import Callable

from jaxserve.engine.sampler import sampler_spec
from jaxserve.buckets import pow2_buckets, step_name


def serving_buckets(config, token_buckets: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """-> (decode rows, [(prefill rows, tokens)]) the configuration can use."""
    usable = config.num_pages - 1
    decode = pow2_buckets(1, max(1, min(config.max_num_seqs, usable)))
    rows = pow2_buckets(1, max(1, min(config.max_prefill_seqs, config.max_num_seqs, usable)))
    return decode, [(b, t) for b in rows for t in token_buckets]


class Warmup:
    def __init__(self, runner, programs, decode: list[int], prefill: list[tuple[int, int]], vocab_size: int):
        self.runner, self.programs, self.vocab_size = runner, programs, vocab_size
        self.decode, self.prefill = decode, prefill
        # Specs are made now, on the engine's thread, from the runner's current arrays.
        self.steps = runner.program_specs(decode, prefill)
        # A decode step samples every row of its bucket (n = rows; fewer only when a row failed
        # its check, and those pad up); a prefill step samples the rows that complete a prompt.
        pairs = {(r, r) for r in decode} | {(r, n) for r in {b for b, _ in prefill} for n in pow2_buckets(1, r)}
        self.samplers = [(r, n, greedy) for r, n in sorted(pairs) for greedy in (True, False)]
        self.total = len(self.steps) + len(self.samplers)

    def core(self) -> tuple[set[str], set[int]]:
        """The step names and logits row counts that let any batch run (padded)."""
        largest = max(self.prefill, key=lambda s: s[0] * s[1])
        names = {step_name("decode", self.decode[-1], 1), step_name("prefill", *largest)}
        names |= {s.name for s in self.steps if s.name.startswith("updates/")}
        return names, {self.decode[-1], largest[0]}

    def run(self, progress: Callable[[int, int], None] | None = None,
            on_serviceable: Callable[[], None] | None = None) -> None:
        report = (lambda *_: progress(len(self.programs.names()), self.total)) if progress else None
        names, rows = self.core() if on_serviceable else (None, None)
        first = [s for s in self.steps if names is None or s.name in names]
        self.programs.build(first, report)
        # The sampler reads the logits where the step programs leave them (their sharding).
        sharding = self.programs.get(first[0].name).output_shardings[0]
        samplers = [sampler_spec(sharding, r, n, self.vocab_size, g) for r, n, g in self.samplers]
        if on_serviceable is not None:
            self.programs.build([s for s, (r, _, _) in zip(samplers, self.samplers) if r in rows], report)
            on_serviceable()
        self.programs.build([s for s in self.steps if s.name not in names] if names else [], report)
        self.programs.build(samplers, report)


def bucket_for(programs, phase: str, b: int, t: int, buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """The smallest built bucket (fewest rows x tokens) that holds b rows of t tokens; (b, t)
    itself when built, or when none is (the caller's program then compiles and is counted)."""
    if step_name(phase, b, t) in programs:
        return b, t
    ready = [(bb, tt) for bb, tt in buckets if bb >= b and tt >= t and step_name(phase, bb, tt) in programs]
    return min(ready, key=lambda s: (s[0] * s[1], s[0])) if ready else (b, t)
