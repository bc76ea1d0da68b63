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


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy so far (every core; /proc/stat)."""
    vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


class CpuShare:
    """Cores used while a phase measures: by the server, by this bench (its good client and its
    abusers, which on this machine share the server's cores), and by everything else."""

    def __init__(self, server_pid: int):
        self.pid = server_pid
        self.start = self.sample()

    def sample(self):
        return time.monotonic(), cpu_seconds(self.pid), cpu_seconds(os.getpid()), machine_busy_seconds()

    def cores(self) -> dict:
        (t0, s0, b0, m0), (t1, s1, b1, m1) = self.start, self.sample()
        dt = t1 - t0
        server, bench, machine = (s1 - s0) / dt, (b1 - b0) / dt, (m1 - m0) / dt
        return {"server": round(server, 2), "bench_clients": round(bench, 2),
                "other": round(max(0.0, machine - server - bench), 2)}
