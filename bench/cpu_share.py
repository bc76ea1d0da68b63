"""Where a bench's CPU went: the cores a server process, the bench's own process and the rest of
the machine used over a window (from /proc), for benches whose clients share the server's cores."""
from __future__ import annotations

import os
import time
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, all its threads (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (e.g. a server's engine process, ``--engine-process``)."""
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy so far (every core; /proc/stat)."""
    vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


class CpuShare:
    """Cores used while a phase measures: by the server (its child processes apart: an engine in
    a process of its own), by this bench (its good client and its abusers, which on this machine
    share the server's cores), and by everything else."""

    def __init__(self, server_pid: int):
        self.pid = server_pid
        self.kids = children(server_pid)
        self.start = self.sample()

    def sample(self):
        kids = sum(cpu_seconds(k) for k in self.kids if Path(f"/proc/{k}").exists())
        return time.monotonic(), cpu_seconds(self.pid), kids, cpu_seconds(os.getpid()), machine_busy_seconds()

    def cores(self) -> dict:
        (t0, s0, k0, b0, m0), (t1, s1, k1, b1, m1) = self.start, self.sample()
        dt = t1 - t0
        server, kids, bench, machine = (s1 - s0) / dt, (k1 - k0) / dt, (b1 - b0) / dt, (m1 - m0) / dt
        out = {"server": round(server, 2)}
        if self.kids:
            out["server_children"] = round(kids, 2)
        return out | {"bench_clients": round(bench, 2), "other": round(max(0.0, machine - server - kids - bench), 2)}
