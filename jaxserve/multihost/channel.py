"""The step channel: process 0 -> every other process of a replica, over TCP.

Each device call process 0 makes (a program step, a generation update) is first sent here as
a message: a kind, a small JSON ``meta`` and numpy arrays (dtype, shape, raw bytes; no
pickle), so the other processes make the same call with the same inputs and the collectives
inside the programs line up. ``stop`` ends the followers' loop.

A step crosses whole: ``pack`` turns a dataclass pytree (``jaxserve.step_batch.StepBatch``) into
its data fields' arrays (in field order) and its static fields (``metadata["static"]``) as
``meta``; ``unpack`` rebuilds it on the other side.

Frame: ``!II`` (header bytes, body bytes), a JSON header ``{"kind", "meta", "arrays":
[[dtype, shape], ...]}``, then the arrays' bytes back to back.

Liveness: each follower sends a heartbeat frame every ``peer_timeout_s / 5``. Process 0
declares the replica lost when a follower closes its connection (it died: noticed at once)
or sends nothing for ``peer_timeout_s`` (it stopped answering); its ``on_lost`` callbacks run
once, and every later ``send`` raises ``ReplicaLost``. A follower whose heartbeat cannot be
sent (process 0 died) exits at once with ``EXIT_PEER_LOST``: it may be blocked inside a
collective that will never complete.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import struct
import threading
import time
from typing import Callable

import numpy as np

from jaxserve.multihost.launch import EXIT_PEER_LOST, GroupConfig

log = logging.getLogger("jaxserve.multihost")
_FRAME = struct.Struct("!II")
HEARTBEAT = "heartbeat"


class ReplicaLost(RuntimeError):
    """A process of this replica died or stopped answering; the replica cannot serve."""


def encode(kind: str, arrays=(), meta: dict | None = None) -> bytes:
    arrays = [np.ascontiguousarray(a) for a in arrays]
    if any(a.dtype.kind not in "biuf" for a in arrays):  # dtype.str must name the type exactly
        raise TypeError("the step channel carries bool, integer and float arrays only")
    header = json.dumps({"kind": kind, "meta": meta or {},
                         "arrays": [[a.dtype.str, list(a.shape)] for a in arrays]}).encode()
    body = b"".join(a.tobytes() for a in arrays)
    return _FRAME.pack(len(header), len(body)) + header + body


def pack(obj) -> tuple[list[np.ndarray], dict]:
    """A dataclass as a message's arrays (its data fields, in order) and meta (its static fields)."""
    arrays, meta = [], {}
    for f in dataclasses.fields(obj):
        if f.metadata.get("static"):
            meta[f.name] = getattr(obj, f.name)
        else:
            arrays.append(np.asarray(getattr(obj, f.name)))
    return arrays, meta


def unpack(cls, arrays, meta: dict):
    """``pack``'s inverse: an instance of the dataclass ``cls``."""
    data = iter(arrays)
    return cls(**{f.name: meta[f.name] if f.metadata.get("static") else next(data) for f in dataclasses.fields(cls)})


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed")
        got += k
    return bytes(buf)


def recv(sock: socket.socket) -> tuple[str, list[np.ndarray], dict]:
    """One message -> (kind, arrays, meta); ConnectionError when the peer closed."""
    hlen, blen = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
    header = json.loads(_recv_exact(sock, hlen))
    body, arrays, at = _recv_exact(sock, blen), [], 0
    for dtype, shape in header["arrays"]:
        dt = np.dtype(dtype)
        n = dt.itemsize * int(np.prod(shape, dtype=np.int64))
        arrays.append(np.frombuffer(body[at : at + n], dt).reshape(shape))
        at += n
    return header["kind"], arrays, header["meta"]


class StepLeader:
    """Process 0's end: accepts every follower (each says hello with its process id and its
    weight-shard digest), then sends messages to all of them and watches their heartbeats."""

    def __init__(self, group: GroupConfig, bind_host: str = "0.0.0.0", accept_timeout_s: float = 300.0):
        self.group = group
        self.peers: dict[int, socket.socket] = {}
        self.digests: dict[int, str] = {}
        self._last_seen: dict[int, float] = {}
        self._lost: str | None = None
        self._lost_event = threading.Event()
        self._callbacks: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self._closing = False
        self.bytes_sent = 0
        srv = socket.create_server((bind_host, group.step_port), reuse_port=False)
        srv.settimeout(1.0)
        deadline = time.monotonic() + accept_timeout_s
        try:
            while len(self.peers) < group.num_processes - 1:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(1, group.num_processes)) - set(self.peers))
                    raise ReplicaLost(f"processes {missing} did not join the step channel within {accept_timeout_s:g}s")
                try:
                    conn, _ = srv.accept()
                except socket.timeout:
                    continue
                conn.settimeout(accept_timeout_s)
                kind, _, meta = recv(conn)
                pid = int(meta.get("process_id", -1))
                if kind != "hello" or not 0 < pid < group.num_processes or pid in self.peers:
                    conn.close()
                    log.warning("step channel: refused a connection (%s, process id %s)", kind, pid)
                    continue
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.peers[pid], self.digests[pid] = conn, str(meta.get("digest", ""))
                self._last_seen[pid] = time.monotonic()
        finally:
            srv.close()
        for pid in self.peers:
            threading.Thread(target=self._read, args=(pid,), name=f"jaxserve-peer-{pid}", daemon=True).start()
        threading.Thread(target=self._watch, name="jaxserve-peer-watch", daemon=True).start()

    def on_lost(self, fn: Callable[[str], None]) -> None:
        """Call fn(reason) once when a process is lost (at once if it already is)."""
        with self._lock:
            self._callbacks.append(fn)
            lost = self._lost
        if lost is not None:
            fn(lost)

    @property
    def lost(self) -> str | None:
        return self._lost

    def wait_lost(self, timeout: float) -> str | None:
        """The reason the replica is lost, waiting up to ``timeout`` s for the verdict (None:
        every process still answers); it returns once the ``on_lost`` callbacks have run. A
        collective that failed because a peer died usually fails a moment before the step
        channel notices the death."""
        self._lost_event.wait(timeout)
        return self._lost

    def _mark_lost(self, reason: str) -> None:
        with self._lock:
            if self._lost is not None or self._closing:
                return
            self._lost = reason
            callbacks = list(self._callbacks)
        log.error("replica lost: %s", reason)
        for fn in callbacks:
            try:
                fn(reason)
            except Exception:
                log.exception("replica-lost callback failed")
        self._lost_event.set()  # after the callbacks: whoever waits on the verdict finds them told

    def _read(self, pid: int) -> None:
        sock = self.peers[pid]
        try:
            while True:
                recv(sock)
                self._last_seen[pid] = time.monotonic()
        except (ConnectionError, OSError, ValueError) as e:
            self._mark_lost(f"process {pid} closed its step channel ({e or type(e).__name__})")

    def _watch(self) -> None:
        limit = self.group.peer_timeout_s
        while self._lost is None and not self._closing:
            now = time.monotonic()
            for pid, seen in list(self._last_seen.items()):
                if now - seen > limit:
                    self._mark_lost(f"process {pid} sent no heartbeat for {now - seen:.1f}s (limit {limit:g}s)")
            time.sleep(min(0.2, limit / 10))

    def send(self, kind: str, arrays=(), meta: dict | None = None) -> None:
        """Send one message to every follower; ReplicaLost if the replica is (or gets) lost."""
        if self._lost is not None:
            raise ReplicaLost(self._lost)
        frame = encode(kind, arrays, meta)
        for pid, sock in self.peers.items():
            try:
                sock.sendall(frame)
            except OSError as e:
                self._mark_lost(f"process {pid}: sending the step failed ({e})")
                raise ReplicaLost(self._lost or str(e)) from e
        self.bytes_sent += len(frame) * len(self.peers)

    def close(self) -> None:
        """Tell every follower to stop (best effort) and close the connections."""
        with self._lock:
            self._closing = True
        for sock in self.peers.values():
            try:
                sock.sendall(encode("stop"))
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass


class StepFollower:
    """A follower's end: connects to process 0 (retrying until ``connect_timeout_s``), says
    hello, and sends heartbeats from a thread for as long as the process runs."""

    def __init__(self, group: GroupConfig, digest: str = "", connect_timeout_s: float = 300.0):
        self.group = group
        deadline = time.monotonic() + connect_timeout_s
        while True:
            try:
                self.sock = socket.create_connection((group.host, group.step_port), timeout=5.0)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise ReplicaLost(f"cannot reach process 0's step channel {group.host}:{group.step_port}: {e}")
                time.sleep(0.2)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._send_lock = threading.Lock()
        self.stopped = False
        self._send(encode("hello", meta={"process_id": group.process_id, "digest": digest}))
        threading.Thread(target=self._beat, name="jaxserve-heartbeat", daemon=True).start()

    def _send(self, frame: bytes) -> None:
        with self._send_lock:
            self.sock.sendall(frame)

    def _beat(self) -> None:
        frame, period = encode(HEARTBEAT), self.group.peer_timeout_s / 5
        while not self.stopped:
            try:
                self._send(frame)
            except OSError as e:
                if self.stopped:
                    return
                # Process 0 is gone; this process may be blocked in a collective that never ends.
                os.write(2, f"jaxserve: process 0 lost ({e}); exiting\n".encode())
                os._exit(EXIT_PEER_LOST)
            time.sleep(period)

    def recv(self) -> tuple[str, list[np.ndarray], dict]:
        return recv(self.sock)

    def close(self) -> None:
        self.stopped = True
        try:
            self.sock.close()
        except OSError:
            pass
