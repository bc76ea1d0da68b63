"""The engine's process (``engine_process.EngineProcess`` starts it): builds the model, runs
an ``EngineThread`` over it and talks to the front end's process over one socket
(``engine_messages``).

Its main thread reads commands and hands them to the engine thread (grammar checks go to a
thread of their own, as they may compile). The engine thread queues each iteration's events,
with the state the front end shows (KV pages, the recent request duration, the metrics it
wrote), for a sender thread, which writes whatever has queued in one call: the engine never
waits on the front end, however busy that is.
It ignores SIGINT / SIGTERM (the front end decides when it stops: a ``Stop``, else the socket's end
when the front end is gone), so a terminal's Ctrl-C drains the server as one.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import logging
import os
import queue
import select
import signal
import socket
import threading
import time
from typing import Callable

from jaxserve.server import engine_messages as msg
from jaxserve.server.engine_thread import EngineThread

log = logging.getLogger("jaxserve.server")


class _Recorded:
    def __init__(self, name: str, records: list):
        self._name, self._records = name, records

    def observe(self, value: float) -> None:
        self._records.append((self._name, "observe", value))

    def inc(self, value: float = 1) -> None:
        self._records.append((self._name, "inc", value))


class MetricsRecorder:
    """What the engine thread writes to its metrics, kept to be replayed in the front end's
    process (``engine_messages.RELAYED_METRICS``; the last engine snapshot). Engine thread only."""

    def __init__(self):
        self._records: list = []
        self._snapshot = None
        for name in msg.RELAYED_METRICS:
            setattr(self, name, _Recorded(name, self._records))

    def sync_engine(self, snap) -> None:
        self._snapshot = snap

    def take(self) -> tuple[list, object]:
        records, snap = list(self._records), self._snapshot
        self._records.clear()
        self._snapshot = None
        return records, snap


class EngineWorker:
    def __init__(self, sock, engine, check_structured: Callable, startup_report: Callable[[float], str] | None = None):
        """startup_report(warm-up seconds): the start-up profile logged once warm (--profile-startup)."""
        self.sock, self.engine = sock, engine
        self._report, self._started = startup_report, time.perf_counter()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_queued, name="jaxserve-engine-send", daemon=True)
        self._check = check_structured
        self._checks = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-grammar")
        self.recorder = MetricsRecorder()
        self.thread: EngineThread | None = None  # built at Start

    def _start(self, start: msg.Start) -> None:
        programs = self.engine.programs
        self._started = time.perf_counter()
        self.thread = EngineThread(self.engine, self.recorder, self._events, self._ready,
                                   lambda e: self.send(msg.WarmupFailed(msg.portable(e))),
                                   on_progress=lambda done, total: self.send(msg.Progress(
                                       done, total, programs.compiled, programs.loaded)),
                                   serve_while_warming=start.serve_while_warming)
        self.thread.start()

    def send(self, message) -> None:
        """Queue ``message`` for the sender thread (any thread; never blocks)."""
        self._outbox.put(message)

    def _send_queued(self) -> None:
        while True:
            batch = [self._outbox.get()]
            while True:
                try:
                    batch.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            try:
                self.sock.sendall(b"".join(msg.frame(m) for m in batch if m is not None))
            except OSError:  # the front end is gone; the command loop sees the end
                return
            if batch[-1] is None:  # flush() asked for the end
                return

    def flush(self) -> None:
        """Send what is queued and end the sender thread."""
        self._outbox.put(None)
        self._sender.join(10)

    def _events(self, batch) -> None:  # engine thread
        batch = [(eid, _portable_event(ev)) for eid, ev in batch]
        records, snap = self.recorder.take()
        self.send(msg.Events(batch, self.thread.kv_pages, self.thread.recent_duration_s, records, snap))

    def _ready(self) -> None:  # engine thread: the state after warm-up first, then Ready
        # What lives now (the model, its programs, JAX's caches) lives as long as this process:
        # out of the cyclic collector's walk, as ``readiness.freeze_long_lived`` does for an
        # engine in the server's own process (a full collection's pause would stall the steps).
        gc.collect()
        gc.freeze()
        if self._report is not None:
            log.info("%s", self._report(time.perf_counter() - self._started))
        self._events([])
        self.send(msg.Ready())

    def _reply(self, token: int, fut: concurrent.futures.Future) -> None:
        error = fut.exception()
        self.send(msg.Result(token, None if error is not None else fut.result(),
                             msg.portable(error) if error is not None else None))

    def _checked(self, spec, token: int) -> None:
        try:
            self._check(spec)
        except Exception as e:
            self.send(msg.Result(token, error=msg.portable(e)))
        else:
            self.send(msg.Result(token))

    def _incoming(self):
        """The commands from the front end, in order, until the socket's end."""
        reader = msg.FrameReader()
        while True:
            try:
                got = msg.read_messages(self.sock, reader)
            except OSError:
                return
            if got is None:
                return
            yield from got

    def run(self) -> None:
        """Wait for Start, then serve commands until Stop or the socket's end; then wait for
        the engine thread and send what it left."""
        self._sender.start()
        for command in self._incoming():
            if self.thread is None:
                if not isinstance(command, msg.Start):
                    break
                self._start(command)
            elif isinstance(command, msg.Add):
                self.thread.add(command.engine_id, command.prompt_ids, command.params, command.arrival,
                                command.client, **command.handoff)
            elif isinstance(command, msg.Abort):
                self.thread.abort(command.engine_id).add_done_callback(lambda f, t=command.token: self._reply(t, f))
            elif isinstance(command, msg.Call):
                self.thread.call(command.fn).add_done_callback(lambda f, t=command.token: self._reply(t, f))
            elif isinstance(command, msg.CheckStructured):
                self._checks.submit(self._checked, command.spec, command.token)
            elif isinstance(command, msg.Stop):
                self.thread.stop()
                break
        else:
            if self.thread is not None:
                log.warning("the front end's process is gone; the engine stops")
                self.thread.stop()
        if self.thread is not None:
            self.thread.join()
        self._checks.shutdown(wait=False)
        self.flush()


def _portable_event(ev):
    error = getattr(ev, "error", None)
    return ev if error is None else dataclasses.replace(ev, error=msg.portable(error))


def _end_with_the_front_end(sock, loading: threading.Event) -> None:
    """While the model loads (nothing reads the socket yet): end this process at once if the
    front end's goes away (the socket's end), rather than load a model for nobody."""
    while loading.is_set():
        if select.select([sock], [], [], 0.5)[0]:
            if not sock.recv(1, socket.MSG_PEEK):
                os._exit(0)
            return  # a command waits: the command loop reads it


def main(sock, build: Callable, log_level: str = "WARNING", cpus: set[int] | None = None,
         profile_startup: bool = False) -> None:
    """The process's entry: on ``cpus`` (None: as started), ``build()`` -> the LLM (or
    MockLLM); ``Loaded`` (or ``LoadFailed``), then ``EngineWorker.run``. profile_startup: log
    where the start's time went here (the load and the warm-up), once warm."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    loading = threading.Event()
    loading.set()
    threading.Thread(target=_end_with_the_front_end, args=(sock, loading), name="jaxserve-load-watch",
                     daemon=True).start()
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    try:
        llm = build()
        from jaxserve.server.served_model import LocalModel

        model = LocalModel(llm)
        info = model.model_info(1, "").SerializeToString()  # max_waiting and replica_id: the front end's
        loaded = msg.Loaded(info, llm.tokenizer, llm.cfg, model.weight_path_rows(), os.getpid())
        loading.clear()
    except BaseException as e:
        log.exception("the engine's process could not load the model")
        sock.sendall(msg.frame(msg.LoadFailed(msg.portable(e))))
        return
    sock.sendall(msg.frame(loaded))
    report = None
    if profile_startup and getattr(llm, "profile", None) is not None:
        def report(warmup_s: float) -> str:
            llm.profile.add("warm-up: build the serving programs", warmup_s)
            return llm.profile.report(llm.engine.programs)
    EngineWorker(sock, llm.engine, model.check_structured, report).run()
    sock.close()
