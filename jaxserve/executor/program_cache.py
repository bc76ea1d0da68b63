"""A cache on disk of compiled serving programs, so a warm restart compiles nothing.

Each entry is one serialized XLA executable (``jax.experimental.serialize_executable``),
named by the SHA-256 of everything that shapes it (``program_key``): the model config and
dtype, the weight and KV formats, the backends, the mesh, the bucket, the abstract inputs
(shapes, dtypes, shardings), the jax / jaxlib versions, the backend platform and its
version, XLA_FLAGS, and a hash of jaxserve's own source (``source_hash``). A change of any
of them names another file: a stale program is never found, it is simply missed.

File layout: a magic line, one JSON header line (``key``, ``sha256`` and ``size`` of the
payload, and the key's inputs for a reader), then the payload. An entry whose magic, key,
size or checksum does not match (truncated, tampered with, or written for another key) is
rejected with a warning naming the file and the reason, deleted, and rebuilt by the caller;
it is never handed to XLA. Writes go to a temporary file renamed into place, so a killed
writer never leaves a half entry under a real name.

The directory must be trusted like jax's own compilation cache: an executable runs native
code, and the checksum detects damage, not a deliberate forgery by someone who can write there.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from pathlib import Path

log = logging.getLogger("jaxserve.program_cache")

MAGIC = b"JAXSERVE-PROGRAM 1\n"
_SOURCE_DIRS = ("jaxserve", "pallas_kernels")


def source_hash() -> str:
    """SHA-256 over jaxserve's and pallas_kernels' Python sources (paths and contents), so an
    edited model, kernel or runner misses the cache. Computed once per process."""
    global _SOURCE_HASH
    if _SOURCE_HASH is None:
        root = Path(__file__).resolve().parent.parent.parent  # the repository (this file is jaxserve/executor/)
        h = hashlib.sha256()
        for d in _SOURCE_DIRS:
            for path in sorted((root / d).rglob("*.py")):
                h.update(str(path.relative_to(root)).encode() + b"\0")
                h.update(path.read_bytes() + b"\0")
        _SOURCE_HASH = h.hexdigest()
    return _SOURCE_HASH


_SOURCE_HASH: str | None = None


def runtime_parts() -> dict:
    """The key inputs that come from the installation rather than the configuration."""
    import jax
    import jaxlib

    backend = jax.devices()[0].client
    return {
        "jax": jax.__version__, "jaxlib": jaxlib.__version__, "platform": backend.platform,
        "platform_version": backend.platform_version, "device_kind": jax.devices()[0].device_kind,
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "source": source_hash(),
    }


def program_key(parts: dict) -> str:
    """The entry name for a program: SHA-256 of its key inputs (JSON, sorted keys)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


class ProgramCache:
    """Entries under ``root`` (one file per key). ``load`` returns the payload or None (a miss
    or a rejected entry); ``store`` writes one atomically. Counters: hits, misses, rejected."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.hits = self.misses = self.rejected = 0
        self._lock = threading.Lock()  # loads run in a thread pool

    def path(self, key: str) -> Path:
        return self.root / f"{key}.program"

    def load(self, key: str) -> bytes | None:
        path = self.path(key)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            with self._lock:
                self.misses += 1
            return None
        reason = _problem(raw, key)
        if reason is None:
            header_end = raw.index(b"\n", len(MAGIC)) + 1
            with self._lock:
                self.hits += 1
            return raw[header_end:]
        with self._lock:
            self.rejected += 1
        log.warning("program cache: rejected %s (%s); removing it and compiling the program again", path, reason)
        try:
            path.unlink()
        except OSError:
            pass
        return None

    def store(self, key: str, payload: bytes, parts: dict | None = None) -> Path:
        header = {"key": key, "sha256": hashlib.sha256(payload).hexdigest(), "size": len(payload),
                  "parts": parts or {}}
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-", suffix=".program")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + json.dumps(header, sort_keys=True, default=str).encode() + b"\n" + payload)
            os.replace(tmp, self.path(key))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return self.path(key)


def _problem(raw: bytes, key: str) -> str | None:
    """Why the bytes of an entry cannot be trusted as the program ``key``; None if they can."""
    if not raw.startswith(MAGIC):
        return "not a jaxserve program entry (bad magic line)"
    end = raw.find(b"\n", len(MAGIC))
    if end < 0:
        return "truncated header"
    try:
        header = json.loads(raw[len(MAGIC):end])
    except ValueError:
        return "unreadable header"
    if not isinstance(header, dict) or header.get("key") != key:
        return f"written for another key ({str(header.get('key') if isinstance(header, dict) else None)[:16]}...)"
    payload = raw[end + 1:]
    if len(payload) != header.get("size"):
        return f"truncated or extended: {len(payload)} payload bytes, header says {header.get('size')}"
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        return "checksum mismatch (the payload was altered)"
    return None
