"""Where the runner's serving programs come from: one interface, two implementations.

``AheadOfTime``: a ``ProgramSet`` (maybe with the program cache on disk); a program is built
from its spec (loaded or compiled) and called as a ``jax.stages.Compiled``, which raises rather
than recompiles on other shapes; before the runner is warm a missing one is built on first use.
A call may pad into a larger built bucket, so a server can answer while the rest builds.

``JitPath``: a mesh over several processes, where every device call must be mirrored to the
other processes in order: nothing is prebuilt (``lookup`` gives None and the runner calls its
jitted function, whose compilation the guard counts), and building a spec means calling it once
on null inputs through the runner (``ProgramSpec.warm``), so every process compiles the same
programs. It never serves while warming (calls from two threads would interleave the mirror).
"""
from __future__ import annotations

from typing import Callable

from jaxserve.executor.programs import ProgramSet, ProgramSpec


class AheadOfTime:
    pads = True  # steps and samplers may pad into a larger built bucket

    def __init__(self, programs: ProgramSet, guard):
        self.programs, self.guard = programs, guard

    def lookup(self, name: str, spec: Callable[[], ProgramSpec]):
        """The built program ``name``; before warm-up a missing one is built now, after it None
        (the jit path, whose compilation the guard counts)."""
        if name not in self.programs and not self.guard.warm:
            self.programs.build([spec()])
        return self.programs.get(name)

    def build(self, specs: list[ProgramSpec], progress=None) -> None:
        self.programs.build(specs, progress)

    def built(self) -> int:
        return len(self.programs.names())

    def output_sharding(self, name: str):
        """Where the built program ``name`` leaves its first output (None if not built)."""
        built = self.programs.get(name)
        return built.output_shardings[0] if built is not None else None


class JitPath:
    pads = False
    programs = None  # no ProgramSet

    def __init__(self):
        self.warmed = 0

    def lookup(self, name: str, spec) -> None:
        return None

    def build(self, specs: list[ProgramSpec], progress=None) -> None:
        for spec in specs:
            spec.warm()
            self.warmed += 1
            if progress:
                progress()

    def built(self) -> int:
        return self.warmed

    def output_sharding(self, name: str):
        return None
