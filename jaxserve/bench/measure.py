"""Small measuring helpers shared by the benchmarks: percentiles, interleaved timing
summaries, a compilation counter, tables and JSON.

Host-side only; numpy and jax are imported lazily (by ``percentile`` and ``CompileWatch``) so the
CLI's ``--help`` stays instant.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Iterable, Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated q-th percentile (0..100) of values (numpy's default method); None when
    there are none."""
    if len(values) == 0:
        return None
    import numpy as np  # here, not at the top: the CLI's --help stays instant

    return float(np.percentile(values, q))


def summary(values: Sequence[float], scale: float = 1.0) -> dict:
    """{mean, p50, p95, max} of values times scale (None fields when empty)."""
    if not values:
        return dict(mean=None, p50=None, p95=None, max=None)
    return dict(
        mean=statistics.fmean(values) * scale,
        p50=percentile(values, 50) * scale,
        p95=percentile(values, 95) * scale,
        max=max(values) * scale,
    )


def median(values: Iterable[float]) -> float:
    return float(statistics.median(list(values)))


class CompileWatch:
    """Counts XLA compilations (new executables, persistent-cache loads included) while active.

    with CompileWatch() as cw: ...   then cw.count, cw.seconds, cw.names ({function name: count})
    A benchmark reports this for its timed region, so a figure that paid for compilation says so.
    """

    _EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0
        self.seconds = 0.0
        self.names: dict[str, int] = {}

    def _listener(self, event: str, duration: float, fun_name: str = "?", **_):
        if event == self._EVENT:
            self.count += 1
            self.seconds += duration
            self.names[fun_name] = self.names.get(fun_name, 0) + 1

    def __enter__(self):
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc):
        import jax.monitoring

        jax.monitoring.unregister_event_duration_listener(self._listener)
        return False


def machine_info() -> dict:
    """Where a figure was measured: host, CPUs, load, library versions, date."""
    from jaxserve.experiments.common import cpu_model

    info = dict(
        date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        host=platform.node(),
        platform=platform.platform(),
        python=platform.python_version(),
        cpu_count=os.cpu_count(),
        processor=cpu_model(),  # one implementation: jaxserve.experiments.common
    )
    try:
        info["loadavg_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    try:
        import jax

        info["jax"] = jax.__version__
        info["jax_backend"] = jax.default_backend()
    except ImportError:
        pass
    return info


def format_table(rows: list[tuple[str, str]], title: str | None = None) -> str:
    """Two-column text table (name, value)."""
    width = max((len(k) for k, _ in rows), default=0)
    lines = [title, "-" * max(len(title), width + 20)] if title else []
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


def fmt(x, unit: str = "", digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}{unit}"


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
