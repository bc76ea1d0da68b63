"""The engine in a process of its own as the event loop sees it (``engine_loop``'s interface over
an ``engine_process.EngineProcess``): commands down the socket, and a reader thread that takes
whatever the socket holds in one read and hands the messages to the loop in one call (a thread
that read message by message would wait for the interpreter lock once per read while the loop is
busy, fall behind, and the engine's events would back up). If the engine's process dies, every
request in flight fails with UNAVAILABLE and the server is told (``on_lost``)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Callable

from jaxserve.server import engine_messages as msg
from jaxserve.server import errors
from jaxserve.server.engine_loop import StreamTable
from jaxserve.server.events import Failed


class ProcessEngineLoop:
    """``engine_loop``'s interface over ``process``, an ``engine_process.EngineProcess`` (its
    socket, frame reader and pending results)."""

    def __init__(self, process, metrics, loop: asyncio.AbstractEventLoop, on_ready, on_failed, on_lost,
                 on_progress=None, serve_while_warming: bool = False):
        self.process, self.metrics, self.loop = process, metrics, loop
        self.serve_while_warming = serve_while_warming
        self.streams = StreamTable(metrics)
        self._on_ready, self._on_failed, self._on_lost, self._on_progress = on_ready, on_failed, on_lost, on_progress
        self.kv_pages = (0, 0, 0)
        self.recent_duration_s = 1.0
        self._ready = self._stopping = False
        self._reader = threading.Thread(target=self._read, name="jaxserve-engine-socket", daemon=True)

    def start(self) -> None:
        self._reader.start()
        self._send(msg.Start(self.serve_while_warming))

    def _send(self, message) -> bool:
        try:
            self.process.send(message)
            return True
        except OSError:
            return False

    def submit(self, stream, prompt_ids: list[int], params, **handoff) -> None:
        self.streams.add(stream)
        if not self._send(msg.Add(stream.engine_id, list(prompt_ids), params, stream.arrival, stream.client, handoff)):
            self.loop.call_soon(self.streams.deliver,
                                [(stream.engine_id, Failed(errors.unavailable("the engine's process is gone")))])

    def abort(self, engine_id: str) -> concurrent.futures.Future:
        return self.process.request(lambda token: msg.Abort(engine_id, token))

    def call(self, fn: Callable) -> concurrent.futures.Future:
        """fn(engine) in the engine's process: fn must be importable by name (not a lambda)."""
        return self.process.request(lambda token: msg.Call(fn, token))

    def stop(self) -> None:
        self._stopping = True
        self._send(msg.Stop())

    def join(self, timeout: float | None = None) -> None:
        """Wait for the engine's process to end; after ``timeout`` it is killed (nothing of a
        stopped server is left to save)."""
        self.process.close(timeout if timeout is not None else 30.0)

    @property
    def alive(self) -> bool:
        return self.process.process.is_alive()

    @property
    def waiting(self) -> int:
        return self.streams.waiting

    # ------------------------------------------------------------------ reader thread -> loop
    def _read(self) -> None:
        while True:
            try:
                got = msg.read_messages(self.process.sock, self.process.frames)
            except OSError:
                break
            if got is None:
                break
            for message in got:
                if isinstance(message, msg.Result):
                    self.process.resolve(message)
            got = [m for m in got if not isinstance(m, msg.Result)]
            if got:
                self._post(self._dispatch_all, got)
        self.process.process.join(5)
        reason = f"the engine's process ended (exit code {self.process.process.exitcode})"
        self.process.fail_pending(reason)
        self._post(self._ended, reason)

    def _post(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _dispatch_all(self, messages: list) -> None:
        for message in messages:
            self._dispatch(message)

    def _dispatch(self, message) -> None:
        if isinstance(message, msg.Events):
            self.kv_pages, self.recent_duration_s = message.kv_pages, message.recent_duration_s
            for name, op, value in message.metrics:
                if name in msg.RELAYED_METRICS and op in ("observe", "inc"):
                    getattr(getattr(self.metrics, name), op)(value)
            if message.snapshot is not None:
                self.metrics.sync_engine(message.snapshot)
            self.streams.deliver(message.batch)
        elif isinstance(message, msg.Progress):
            self.process.programs.compiled, self.process.programs.loaded = (message.programs_compiled,
                                                                            message.programs_loaded)
            if self._on_progress is not None:
                self._on_progress(message.done, message.total)
        elif isinstance(message, msg.Ready):
            self._ready = True
            self._on_ready()
        elif isinstance(message, msg.WarmupFailed):
            self._on_failed(message.error)

    def _ended(self, reason: str) -> None:
        if self._stopping:
            self.streams.fail_all(errors.unavailable("shutting down"))
            return
        self.streams.fail_all(errors.unavailable(reason))
        if self._ready:
            self._on_lost(reason)
        else:
            self._on_failed(RuntimeError(reason))
