"""The recompilation guard: once the executor is warm, any compilation of a serving program is
counted, and raises ``RecompilationError`` when ``strict`` (tests), else is logged."""
from __future__ import annotations

import logging

log = logging.getLogger("jaxserve.runner")


class RecompilationError(RuntimeError):
    """A serving program compiled after warm-up (a shape escaped the padding buckets)."""


class CompileGuard:
    def __init__(self, strict: bool = False):
        self.strict = strict  # a compilation after warm-up raises (else it is logged and counted)
        self.warm = False
        self.compiles_after_warmup = 0

    def mark_warm(self) -> None:
        """From now on every compilation of a serving program is one too many."""
        self.warm = True

    def recompiled(self, msg: str) -> None:
        """A serving program compiled after warm-up: counted; raises when strict."""
        self.compiles_after_warmup += 1
        if self.strict:
            raise RecompilationError(msg)
        log.warning("%s (a shape escaped the warm-up buckets: counted in compiles_after_warmup)", msg)

    def counted(self, fn, compiled, what: str):
        """fn() -> its result; ``compiled()`` (programs compiled so far) grew while warm: a recompilation."""
        before = compiled()
        out = fn()
        if self.warm and compiled() != before:
            self.recompiled(f"{what} program compiled after warm-up")
        return out
