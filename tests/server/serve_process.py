"""`jaxserve serve` in a subprocess on the tiny model, with bounded waits on its output."""
from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time

from .conftest import ENGINE


def server_env(**extra: str) -> dict:
    """This environment plus the tests' compile cache (so warm-up reads it) and `extra`."""
    import jax

    return dict(os.environ, JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir or "", **extra)


def serve_args(model: str, *extra: str) -> list[str]:
    args = [sys.executable, "-m", "jaxserve.server.cli", "serve", "--model", model, "--port", "0",
            "--metrics-port", "-1", "--log-level", "warning", "--drain-timeout", "20"]
    for key, value in ENGINE.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args + list(extra)


class ServeProcess:
    """Popen + a reader thread, so every wait on the output has a deadline."""

    def __init__(self, args: list[str], env: dict | None = None):
        """env: the whole environment (None: this process's)."""
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    @property
    def output(self) -> str:
        while not self._queue.empty():
            line = self._queue.get_nowait()
            if line is not None:
                self.lines.append(line)
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float) -> str:
        """The first output line containing `text`; AssertionError (with the output) if none in time."""
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            self.lines.append(line)
            if text in line:
                return line
        raise AssertionError(f"no {text!r} within {timeout}s:\n{self.output}")

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
