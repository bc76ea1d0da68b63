"""Where a start's time goes (``jaxserve serve --profile-startup``, ``bench/startup.py``).

``StartupProfile`` collects wall-clock stages (imports, default-model conversion, config and
weights, engine set-up, warm-up) as they happen, and ``report`` renders them with the
warm-up's per-program split from a ``ProgramSet``: cache load, trace, lower, compile (in a
worker thread, so compiles of different programs overlap and their sum can exceed the
warm-up's wall time) and cache store, per program and bucket, with totals per kind.
"""
from __future__ import annotations

import contextlib
import time


class StartupProfile:
    def __init__(self, start: float | None = None):
        self.start = time.perf_counter() if start is None else start
        self.stages: list[tuple[str, float]] = []

    def add(self, name: str, seconds: float) -> None:
        self.stages.append((name, seconds))

    @contextlib.contextmanager
    def stage(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def report(self, programs=None, per_program: bool = True) -> str:
        """A plain-text table: the stages, then the warm-up by program kind (and per program)."""
        lines = ["start-up profile (wall seconds)"]
        lines += [f"  {name:<44s} {s:8.2f}" for name, s in self.stages]
        lines.append(f"  {'total so far':<44s} {self.elapsed():8.2f}")
        if programs is None:
            return "\n".join(lines)
        rows = list(programs.timings.values())
        lines.append(f"warm-up programs: {len(rows)} ({programs.loaded} from the program cache, "
                     f"{programs.compiled} compiled, {getattr(programs.cache, 'rejected', 0)} cache entries rejected; "
                     f"loaded {programs.load_workers} and compiled {programs.workers} at a time)")
        head = f"  {'program':<28s} {'source':<9s} {'load':>7s} {'trace':>7s} {'lower':>7s} {'compile':>8s} {'store':>7s}"
        kinds: dict[str, list] = {}
        for t in rows:
            kinds.setdefault(t.name.split("/")[0], []).append(t)
        lines.append(head)
        for kind, ts in kinds.items():
            sums = [sum(getattr(t, f) for t in ts) for f in ("load_s", "trace_s", "lower_s", "compile_s", "store_s")]
            lines.append(f"  {kind + f' ({len(ts)} buckets)':<28s} {'all':<9s} " + _cells(sums))
        if per_program:
            for t in rows:
                lines.append(f"  {t.name:<28s} {t.source:<9s} "
                             + _cells([t.load_s, t.trace_s, t.lower_s, t.compile_s, t.store_s]))
        return "\n".join(lines)


def _cells(values) -> str:
    widths = (7, 7, 7, 8, 7)
    return " ".join(f"{v:{w}.2f}" for v, w in zip(values, widths))
