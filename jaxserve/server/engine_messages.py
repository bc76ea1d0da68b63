"""What crosses the socket between the front end's process and the engine's (``engine_process``,
``engine_worker``): one dataclass per message, each pickled whole in a length-prefixed frame
(``frame`` / ``FrameReader``).

Front end -> engine: ``Start`` (once: warm-up begins), ``Add``, ``Abort``, ``Call``,
``CheckStructured``, ``Stop``.
Engine -> front end: ``Loaded`` (once, or ``LoadFailed``), then ``Progress`` (warm-up),
``Ready`` or ``WarmupFailed``, ``Events`` (an iteration's events, with the engine's state and
the metrics it wrote) and ``Result`` (of an Abort, Call or CheckStructured, by token).

Errors cross as themselves where their type pickles whole (the server's own error types
do); any other is carried as the nearest builtin of its kind with its type's name in the text
(``portable``), so an unpicklable exception can never break the connection.
"""
from __future__ import annotations

import dataclasses
import pickle
import struct
from typing import Any, Callable

# The metrics the engine thread writes (``engine_thread.EngineThread``), replayed by name in
# the front end's process; each is a prometheus Histogram (observe) or Counter (inc).
RELAYED_METRICS = ("ttft", "itl", "e2e", "prompt_tokens", "cached_tokens", "completion_tokens", "engine_errors")


# ---------------------------------------------------------------------- front end -> engine
@dataclasses.dataclass(frozen=True)
class Start:
    serve_while_warming: bool = False  # the server's setting (``EngineThread``)


@dataclasses.dataclass(frozen=True)
class Add:
    engine_id: str
    prompt_ids: list
    params: Any  # SamplingParams
    arrival: float  # time.perf_counter() (CLOCK_MONOTONIC: the same clock in both processes)
    client: str
    handoff: dict


@dataclasses.dataclass(frozen=True)
class Abort:
    engine_id: str
    token: int


@dataclasses.dataclass(frozen=True)
class Call:
    fn: Callable  # fn(engine), a function importable by name (pickled by reference)
    token: int


@dataclasses.dataclass(frozen=True)
class CheckStructured:
    spec: Any  # StructuredOutput
    token: int


@dataclasses.dataclass(frozen=True)
class Stop:
    pass


# ---------------------------------------------------------------------- engine -> front end
@dataclasses.dataclass(frozen=True)
class Loaded:
    info: bytes  # ModelInfo, serialized (max_waiting and replica_id are the front end's to fill)
    tokenizer: Any  # jaxserve.tokenizer.Tokenizer | None
    cfg: Any  # the model's config
    weight_path_rows: dict
    pid: int


@dataclasses.dataclass(frozen=True)
class LoadFailed:
    error: BaseException


@dataclasses.dataclass(frozen=True)
class Progress:
    done: int
    total: int
    programs_compiled: int
    programs_loaded: int


@dataclasses.dataclass(frozen=True)
class Ready:
    pass


@dataclasses.dataclass(frozen=True)
class WarmupFailed:
    error: BaseException


@dataclasses.dataclass(frozen=True)
class Events:
    batch: list  # [(engine id, jaxserve.server.events event)]
    kv_pages: tuple  # (total, used, free)
    recent_duration_s: float
    metrics: list  # [(name in RELAYED_METRICS, "observe" | "inc", value)]
    snapshot: Any  # the engine's last EngineSnapshot (ServerMetrics.sync_engine), or None


@dataclasses.dataclass(frozen=True)
class Result:
    token: int
    value: Any = None
    error: BaseException | None = None


def portable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling as the same type with the same text, else a builtin of
    its kind (ValueError stays bad input, anything else RuntimeError) naming its type."""
    try:
        back = pickle.loads(pickle.dumps(error))
        if type(back) is type(error) and str(back) == str(error):
            return error
    except Exception:
        pass
    kind = ValueError if isinstance(error, ValueError) else RuntimeError
    return kind(f"{type(error).__name__}: {error}")


# ---------------------------------------------------------------------- framing
_HEADER = struct.Struct("!Q")  # the pickled message's length


def frame(message) -> bytes:
    """One message as bytes on the socket: its pickle's length, then the pickle."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


class FrameReader:
    """Messages out of a byte stream of ``frame``s, however the reads cut it. A reader takes
    whatever the socket holds in one read, so a burst of messages costs one system call (and,
    on the front end's side, one wait for the interpreter lock) rather than one each."""

    def __init__(self):
        self._buf = bytearray()

    def feed(self, data: bytes) -> list:
        self._buf += data
        out, at, buf = [], 0, self._buf
        while len(buf) - at >= _HEADER.size:
            (n,) = _HEADER.unpack_from(buf, at)
            if len(buf) - at - _HEADER.size < n:
                break
            start = at + _HEADER.size
            out.append(pickle.loads(memoryview(buf)[start:start + n]))
            at = start + n
        del buf[:at]
        return out


def read_messages(sock, reader: FrameReader, size: int = 1 << 20) -> list | None:
    """Block until the socket has bytes; the whole messages among them (maybe none yet), or
    None at the end of the stream."""
    data = sock.recv(size)
    return reader.feed(data) if data else None
