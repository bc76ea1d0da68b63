"""Compiled programs by name, built ahead of time: loaded from the program cache on disk, or
traced and lowered here and compiled, both in a thread pool (XLA links a loaded executable and
compiles a new one with the GIL released, so independent programs overlap where there are
cores).

A ``ProgramSpec`` names one program (``"decode/64x1"``) and gives the jitted function, example
arguments (arrays or ``jax.ShapeDtypeStruct``; their shapes, dtypes and shardings are what
it is compiled for) and its static keyword arguments. ``ProgramSet.build`` makes every spec
callable (``get(name)``: a ``jax.stages.Compiled``, which raises rather than recompiles on
arguments of another shape) and records, per program, where its time went (``timings``):
cache load, trace, lower, compile. ``compiled`` counts XLA compilations, ``loaded`` cache
hits; ``progress(done, total)`` is called as programs become ready. (``ProgramSpec.warm`` is
for the jit path, ``executor.sources.JitPath``, which builds a spec by calling it once.)
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import gc
import logging
import os
import pickle
import threading
import time
from typing import Callable

import jax
from jax import monitoring

from jaxserve.executor.program_cache import ProgramCache, program_key, runtime_parts

log = logging.getLogger("jaxserve.programs")

# Whether the compile running on this thread was served from jax's own persistent cache: on CPU
# such an executable serializes incomplete (it fails to load: "Function ... not found"), so it
# is used but never stored in the program cache.
_thread = threading.local()


def _on_jax_event(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _thread.jax_cache_hit = True


monitoring.register_event_listener(_on_jax_event)


def jax_cache_on() -> bool:
    """Whether jax's own persistent compilation cache is on in this process. On CPU an
    executable it serves (loaded from disk, or handed back from memory later) serializes
    incomplete: stored, it would fail at its first call ("Function ... not found")."""
    return bool(jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir)


def single_arena_malloc() -> bool:
    """Whether glibc's allocator runs one arena (``MALLOC_ARENA_MAX=1``, the setting that keeps
    XLA:CPU's large buffers from being page-faulted in on every call): every thread's malloc
    then takes one lock, and two executables loaded at once took longer than one after the
    other (25 step programs of the default model: 8.4 s in turn, 9.4-11.6 s two at a time;
    4.5-5.0 s two at a time with the default allocator)."""
    return os.environ.get("MALLOC_ARENA_MAX", "").strip() == "1"


@contextlib.contextmanager
def _gc_paused():
    """Python's cyclic garbage collector off while programs are built: tracing a large model
    makes objects by the million, and the collections they set off measured about a sixth of
    tracing time. Back on (if it was) afterwards; nothing is freed later than it would be."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@dataclasses.dataclass
class ProgramSpec:
    name: str
    fn: Callable  # a jax.jit-wrapped function
    args: tuple
    static: dict = dataclasses.field(default_factory=dict)
    warm: Callable[[], None] | None = None  # the jit path's build: one call on null inputs (through the runner)


@dataclasses.dataclass
class ProgramTiming:
    name: str
    source: str = ""  # "cache" | "compiled"
    load_s: float = 0.0  # reading and deserializing a cache entry (a rejected one included)
    trace_s: float = 0.0
    lower_s: float = 0.0
    compile_s: float = 0.0  # in a worker thread: overlaps other programs' compiles
    store_s: float = 0.0


def signature(args) -> list:
    """(shape, dtype, sharding) of every leaf: what a compiled program's inputs must match."""
    def one(x):
        sharding = getattr(x, "sharding", None)
        committed = getattr(x, "committed", True) if not isinstance(x, jax.ShapeDtypeStruct) else True
        return [list(x.shape), str(x.dtype), str(sharding) if sharding is not None and committed else None]
    return [one(x) for x in jax.tree.leaves(args)]


class ProgramSet:
    def __init__(self, cache: ProgramCache | None, key_parts: dict, workers: int = 2, runtime: dict | None = None):
        self.cache = cache
        self.key_parts = dict(key_parts)
        self.runtime = runtime  # the installation's key inputs (default: program_cache.runtime_parts())
        self.workers = max(1, workers)
        self.load_workers = 1 if single_arena_malloc() else self.workers
        self._told_jax_cache = False
        self._ready: dict[str, jax.stages.Compiled] = {}
        self.timings: dict[str, ProgramTiming] = {}
        self.compiled = 0
        self.loaded = 0
        self._lock = threading.Lock()

    def get(self, name: str):
        """The compiled program `name`, or None if it is not (yet) built."""
        return self._ready.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._ready

    def names(self) -> list[str]:
        return list(self._ready)

    def key(self, spec: ProgramSpec) -> tuple[str, dict]:
        parts = {**self.key_parts, **(self.runtime or runtime_parts()), "program": spec.name,
                 "static": sorted((k, repr(v)) for k, v in spec.static.items()), "args": signature(spec.args)}
        return program_key(parts), parts

    def build(self, specs: list[ProgramSpec], progress: Callable[[int, int], None] | None = None) -> None:
        """Make every spec ready: cache hits first, then trace and lower each miss here (Python,
        one at a time) while a pool compiles the ones already lowered, storing each as it lands."""
        total, done = len(specs), sum(spec.name in self._ready for spec in specs)
        if progress and done:
            progress(done, total)
        todo = [(spec, *self.key(spec)) for spec in specs if spec.name not in self._ready]
        missed = [] if self.cache is not None else todo
        with concurrent.futures.ThreadPoolExecutor(self.load_workers, thread_name_prefix="jaxserve-load") as pool:
            # Cache hits first, in a pool: XLA links a loaded executable with the GIL released.
            loads = [pool.submit(self._load, spec, key) for spec, key, _ in todo] if self.cache is not None else []
            for (spec, key, parts), fut in zip(todo, loads):
                if fut.result():
                    done += 1
                    if progress:
                        progress(done, total)
                else:
                    missed.append((spec, key, parts))
        if not missed:
            return
        compiles = concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix="jaxserve-compile")
        with _gc_paused(), compiles as pool:
            futures = []
            for spec, key, parts in missed:  # in spec order (the caller's: largest first)
                t = self.timings.setdefault(spec.name, ProgramTiming(spec.name))
                t0 = time.perf_counter()
                traced = spec.fn.trace(*spec.args, **spec.static)
                t1 = time.perf_counter()
                lowered = traced.lower()
                t.trace_s, t.lower_s = t1 - t0, time.perf_counter() - t1
                futures.append(pool.submit(self._compile, spec, key, parts, lowered))
            for fut in concurrent.futures.as_completed(futures):
                fut.result()  # a failed compile fails the build
                done += 1
                if progress:
                    progress(done, total)

    def _load(self, spec: ProgramSpec, key: str) -> bool:  # on a pool thread
        t0 = time.perf_counter()
        payload = self.cache.load(key)
        t = self.timings.setdefault(spec.name, ProgramTiming(spec.name))
        if payload is None:
            t.load_s = time.perf_counter() - t0
            return False
        from jax.experimental.serialize_executable import deserialize_and_load

        serialized, in_tree, out_tree, device_ids = pickle.loads(payload)
        by_id = {d.id: d for d in jax.devices()}
        devices = [by_id[i] for i in device_ids]  # the key names the devices: they exist
        loaded = deserialize_and_load(serialized, in_tree, out_tree, execution_devices=devices)
        t.load_s, t.source = time.perf_counter() - t0, "cache"
        with self._lock:
            self._ready[spec.name] = loaded
            self.loaded += 1
        return True

    def _compile(self, spec: ProgramSpec, key: str, parts: dict, lowered) -> None:
        t = self.timings[spec.name]
        t0 = time.perf_counter()
        _thread.jax_cache_hit = False
        compiled = lowered.compile()
        from_jax_cache = _thread.jax_cache_hit
        t.compile_s, t.source = time.perf_counter() - t0, "jax-cache" if from_jax_cache else "compiled"
        with self._lock:
            self.compiled += 1
            self._ready[spec.name] = compiled
        if from_jax_cache:
            log.info("program cache: %s came from jax's compilation cache, whose executables do not serialize "
                     "whole; not stored (turn jax's cache off to let the program cache keep it)", spec.name)
        elif self.cache is not None and jax_cache_on():
            # jax may also hand back from memory an executable it loaded from that cache earlier
            # in the process, with no event to tell: nothing compiled here can be trusted whole.
            if not self._told_jax_cache:
                self._told_jax_cache = True
                log.warning("program cache: jax's persistent compilation cache is on in this process; the "
                            "executables it serves do not serialize whole, so no program is stored (turn it off "
                            "to let the program cache keep them: jax_enable_compilation_cache=False)")
        elif self.cache is not None:
            t0 = time.perf_counter()
            try:
                from jax.experimental.serialize_executable import serialize

                devices = [d.id for d in compiled.runtime_executable().local_devices()]
                payload = pickle.dumps((*serialize(compiled), devices))
                self.cache.store(key, payload, parts)
            except (ValueError, NotImplementedError, OSError) as e:  # still served, just not cached
                log.warning("program cache: could not store %s: %s", spec.name, e)
            t.store_s = time.perf_counter() - t0
