"""Temporary directories that outlive a killed writer only until the next start.

A writer (``owned_tmpdir``) holds an exclusive ``flock`` on a lock file beside its directory
(``<dir>.lock``) for as long as it works; the kernel drops that lock when the process dies,
however it dies (``kill -9`` included). ``remove_stale`` deletes every directory whose lock
nobody holds, so leftovers of a killed conversion disappear at the next start, while a
conversion running in another process is left alone.

A directory with no lock file beside it (written by an older jaxserve, or a writer caught
between ``mkdtemp`` and taking its lock) only counts as stale once it is
``UNLOCKED_STALE_S`` old. Linux / macOS (``fcntl``); the lock is advisory and per host.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator

LOCK_SUFFIX = ".lock"
UNLOCKED_STALE_S = 600.0


def _lock_path(directory: Path) -> Path:
    return directory.with_name(directory.name + LOCK_SUFFIX)


@contextlib.contextmanager
def owned_tmpdir(root: Path, prefix: str) -> Iterator[Path]:
    """A fresh directory ``root/<prefix><random>``, locked as ours while the block runs;
    removed at the end unless the block renamed it away (e.g. into its final place)."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
    lock = _lock_path(tmp)
    # Locked under a staging name, then renamed: a sweeper never sees the lock file unlocked.
    staging = lock.with_name(lock.name + ".new")
    fd = os.open(staging, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(staging, lock)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        for path in (lock, staging):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        os.close(fd)


def _take_lock(lock: Path) -> int | None:
    """An fd holding the lock, or None if a live process holds it (or it vanished)."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def remove_stale(root: Path, prefix: str, unlocked_stale_s: float = UNLOCKED_STALE_S) -> list[Path]:
    """Delete ``root/<prefix>*`` directories whose writer is gone; returns what was removed."""
    try:
        entries = sorted(Path(root).glob(prefix + "*"))
    except OSError:
        return []
    removed = []
    now = time.time()
    for entry in entries:
        if entry.name.endswith(LOCK_SUFFIX):
            directory = entry.with_name(entry.name[: -len(LOCK_SUFFIX)])
            fd = _take_lock(entry)
            if fd is None:
                continue
            try:  # its writer is dead: the directory (if any) and the lock file go
                if directory.is_dir():
                    shutil.rmtree(directory, ignore_errors=True)
                    removed.append(directory)
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()
            finally:
                os.close(fd)
        elif entry.name.endswith(LOCK_SUFFIX + ".new"):  # a writer killed while taking its lock
            with contextlib.suppress(FileNotFoundError):
                if now - entry.stat().st_mtime > 60.0:
                    entry.unlink()
        elif entry.is_dir() and not _lock_path(entry).exists():
            try:
                age = now - entry.stat().st_mtime
            except FileNotFoundError:
                continue
            if age > unlocked_stale_s:
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed
