"""Temporary conversion directories: a killed writer's leftovers go at the next start, a live
writer's directory stays (checked with a real ``kill -9``)."""
import os
import signal
import subprocess
import sys
import time

from jaxserve.checkpoint import gguf
from jaxserve.checkpoint.tmpdirs import LOCK_SUFFIX, UNLOCKED_STALE_S, owned_tmpdir, remove_stale

PREFIX = gguf.CONVERSION_TMP_PREFIX

_WRITER = """
import sys, time
from pathlib import Path
from jaxserve.checkpoint.tmpdirs import owned_tmpdir
with owned_tmpdir(Path(sys.argv[1]), sys.argv[2]) as d:
    (d / "model.safetensors").write_bytes(b"x" * 4096)
    print(d, flush=True)
    time.sleep(120)
"""


def _writer(root):
    """A process holding a temporary directory -> (process, its directory)."""
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(root), PREFIX], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    assert line, "writer did not start"
    return proc, line


def test_a_killed_writers_directory_is_removed_and_a_live_ones_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path))
    live, live_dir = _writer(tmp_path)
    dead, dead_dir = _writer(tmp_path)
    try:
        dead.send_signal(signal.SIGKILL)  # no chance to clean up after itself
        dead.wait(10)
        assert os.path.isdir(dead_dir) and os.path.exists(dead_dir + LOCK_SUFFIX)
        removed = gguf.remove_stale_conversions()  # what a start does
        assert [str(p) for p in removed] == [dead_dir]
        assert not os.path.exists(dead_dir) and not os.path.exists(dead_dir + LOCK_SUFFIX)
        assert os.path.isdir(live_dir)  # its writer is still converting
        assert gguf.remove_stale_conversions() == []
    finally:
        live.kill()
        live.wait(10)
    assert [str(p) for p in remove_stale(tmp_path, PREFIX)] == [live_dir]
    assert os.listdir(tmp_path) == []


def test_the_writer_cleans_up_on_an_exception_and_leaves_a_renamed_directory_alone(tmp_path):
    try:
        with owned_tmpdir(tmp_path, PREFIX) as d:
            (d / "half").write_text("x")
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert os.listdir(tmp_path) == []
    with owned_tmpdir(tmp_path, PREFIX) as d:
        os.rename(d, tmp_path / "final")
    assert os.listdir(tmp_path) == ["final"]


def test_unlocked_directories_of_older_versions_go_only_once_old(tmp_path):
    old, fresh = tmp_path / (PREFIX + "abcd1234"), tmp_path / (PREFIX + "efgh5678")
    for d in (old, fresh):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x")
    then = time.time() - UNLOCKED_STALE_S - 5
    os.utime(old, (then, then))
    other = tmp_path / "smollm2-135m-instruct-q4_1"  # the finished conversion is never touched
    other.mkdir()
    assert remove_stale(tmp_path, PREFIX) == [old]
    assert sorted(os.listdir(tmp_path)) == sorted([fresh.name, other.name])
