"""The engine in a process of its own (``jaxserve serve --engine-process``).

In one process the event loop (gRPC and HTTP stream set-ups, refusals, parsing) and the engine
thread share one interpreter lock, so a burst of stream starts stalls the engine's steps and every
request in flight with them, whatever cores are free. Here the front end's process keeps the
event loop and the engine's process (``engine_worker``) builds the model and runs the engine
thread; the two talk over one socket pair (``engine_messages``).

``EngineProcess`` is the ``ServedModel`` the server reads (tokenizer, config, model info, the
matmul paths, grammar checks), from what the engine's process reports once loaded;
``process_engine_loop.ProcessEngineLoop`` is the engine as the event loop sees it.

Not for a prefill / decode worker or a multi-process replica: KV handoff and the replica's step
mirror reach the engine itself (``jaxserve serve`` refuses the combination).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import multiprocessing
import os
import socket
import threading
import time
from typing import Callable

from jaxserve.server import engine_messages as msg
from jaxserve.server import engine_worker
from jaxserve.server.served_model import ServedModel
from jaxserve.v1 import jaxserve_pb2 as pb


@dataclasses.dataclass
class ProgramCounts:
    """The engine's serving programs, as its warm-up reports them."""

    compiled: int = 0
    loaded: int = 0


class EngineProcess(ServedModel):
    def __init__(self, build: Callable, log_level: str = "WARNING", load_timeout_s: float | None = None,
                 cpus: set[int] | None = None, profile_startup: bool = False):
        """Start the engine's process and wait until it has loaded the model. build(): the LLM
        (or MockLLM), called in that process: a function importable by name, with picklable
        arguments (``functools.partial``). cpus: the CPUs the engine's process runs on (set
        before it loads anything, so JAX and the native kernels size their threads to them),
        this process then on the others this process may use (``parse_cpus``); None: both on
        all. profile_startup: that process logs where its start's time went once warm. Raises
        what the load raised there."""
        front_cpus = None
        if cpus is not None:
            allowed = os.sched_getaffinity(0)
            if not cpus or not cpus <= allowed:
                raise ValueError(f"engine CPUs {sorted(cpus)} are not among this process's CPUs {sorted(allowed)}")
            front_cpus = (allowed - cpus) or None
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold JAX's threads
        self.sock, child = socket.socketpair()
        self.frames = msg.FrameReader()
        self.process = ctx.Process(target=engine_worker.main, name="jaxserve-engine", daemon=True,
                                   args=(child, build, log_level, cpus, profile_startup))
        self.process.start()
        child.close()
        if front_cpus is not None:
            _move_threads(front_cpus)
        self.programs = ProgramCounts()
        self._send_lock = threading.Lock()  # one frame at a time on the socket
        self._pending_lock = threading.Lock()  # _pending, _tokens, _ended
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._tokens = itertools.count()
        self._ended = False
        loaded = self._wait_loaded(load_timeout_s)
        self.pid = loaded.pid
        self.tokenizer, self.cfg = loaded.tokenizer, loaded.cfg
        self._info, self._paths = loaded.info, loaded.weight_path_rows

    def _wait_loaded(self, timeout: float | None) -> msg.Loaded:
        end = None if timeout is None else time.monotonic() + timeout
        self.sock.settimeout(0.2)
        try:
            while end is None or time.monotonic() < end:
                try:
                    got = msg.read_messages(self.sock, self.frames)
                except socket.timeout:
                    if not self.process.is_alive():
                        break
                    continue
                if got is None:
                    break
                if got:  # the engine's process sends nothing else before Start
                    if isinstance(got[0], msg.LoadFailed):
                        self.process.join(10)
                        raise got[0].error
                    return got[0]
        finally:
            self.sock.settimeout(None)
        self.close()
        raise RuntimeError(f"the engine's process ended before loading the model (exit code {self.process.exitcode})"
                           if end is None or time.monotonic() < end else
                           f"the engine's process did not load the model in {timeout:g}s")

    # ------------------------------------------------------------------ ServedModel
    def model_info(self, max_waiting: int, replica_id: str, peer_digests=()) -> pb.ModelInfo:
        if peer_digests:
            raise ValueError("an engine in a process of its own serves one process's devices (no replica group)")
        info = pb.ModelInfo.FromString(self._info)
        info.max_waiting, info.replica_id = max_waiting, replica_id
        return info

    def weight_path_rows(self) -> dict:
        return self._paths

    def check_structured(self, spec) -> None:
        self.request(lambda token: msg.CheckStructured(spec, token)).result()

    def engine_loop(self, metrics, loop, on_ready, on_failed, on_lost, explain_error=None, on_progress=None,
                    serve_while_warming: bool = False):
        from jaxserve.server.process_engine_loop import ProcessEngineLoop

        return ProcessEngineLoop(self, metrics, loop, on_ready, on_failed, on_lost, on_progress, serve_while_warming)

    # ------------------------------------------------------------------ the socket
    def send(self, message) -> None:
        """Raises OSError when the engine's process is gone."""
        data = msg.frame(message)
        with self._send_lock:
            self.sock.sendall(data)

    def request(self, make: Callable[[int], object]) -> concurrent.futures.Future:
        """Send make(token); the future gets the ``Result`` of that token (or an error when the
        engine's process is gone first)."""
        fut = concurrent.futures.Future()
        with self._pending_lock:
            token = next(self._tokens)
            if self._ended:
                fut.set_exception(RuntimeError("the engine's process has ended"))
                return fut
            self._pending[token] = fut
        try:
            self.send(make(token))
        except OSError as e:
            self.resolve(msg.Result(token, error=RuntimeError(f"the engine's process is gone: {e}")))
        return fut

    def resolve(self, result: msg.Result) -> None:
        with self._pending_lock:
            fut = self._pending.pop(result.token, None)
        if fut is None:
            return
        if result.error is not None:
            fut.set_exception(result.error)
        else:
            fut.set_result(result.value)

    def fail_pending(self, reason: str) -> None:
        with self._pending_lock:
            self._ended = True
            pending, self._pending = list(self._pending.values()), {}
        for fut in pending:
            fut.set_exception(RuntimeError(reason))

    def close(self, timeout: float = 5.0) -> None:
        """End the engine's process: it has had its Stop (or never started): wait up to
        ``timeout`` seconds, then kill it (a warm-up compile cannot be cut short otherwise)."""
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        self.sock.close()


def _move_threads(cpus: set[int]) -> None:
    """Every thread of this process (and those it starts later) onto ``cpus``."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # a thread that has just ended
            pass


def parse_cpus(text: str) -> set[int]:
    """"0-3,8" -> {0, 1, 2, 3, 8} (ValueError naming what it cannot read)."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            first, last = int(lo), int(hi or lo)
            if first < 0 or last < first:
                raise ValueError
            cpus.update(range(first, last + 1))
    except ValueError:
        raise ValueError(f"--engine-cpus: {text!r} is not a CPU list such as 0-3,8") from None
    return cpus
