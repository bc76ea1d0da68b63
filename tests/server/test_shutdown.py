"""`jaxserve serve` as a process: SIGTERM while loading or during warm-up exits at once with
code 0, and a start removes the temporary conversion directories of killed processes (not a
live one's)."""
import os
import signal
import time

from jaxserve.checkpoint.gguf import CONVERSION_TMP_PREFIX
from jaxserve.checkpoint.tmpdirs import LOCK_SUFFIX, UNLOCKED_STALE_S, owned_tmpdir

from .serve_process import ServeProcess, serve_args, server_env


def _plant_leftovers(cache):
    """-> (directories a start must remove, one it must keep: the caller holds it)."""
    cache.mkdir()
    dead = cache / (CONVERSION_TMP_PREFIX + "killed01")  # as a kill -9 leaves it: an unheld lock file
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"\0" * 65536)
    (cache / (dead.name + LOCK_SUFFIX)).write_bytes(b"")
    legacy = cache / (CONVERSION_TMP_PREFIX + "old_vers")  # an older jaxserve's, with no lock file
    legacy.mkdir()
    (legacy / "config.json").write_text("{}")
    then = time.time() - UNLOCKED_STALE_S - 60
    os.utime(legacy, (then, then))
    return [dead, legacy]


def test_sigterm_during_warmup_exits_promptly_with_code_0_and_stale_conversions_go(tiny_text_model, tmp_path):
    cache = tmp_path / "cache"
    stale = _plant_leftovers(cache)
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["JAXSERVE_CACHE_DIR"] = str(cache)  # an empty compile cache: warm-up really compiles (many seconds)
    with owned_tmpdir(cache, CONVERSION_TMP_PREFIX) as live, \
            ServeProcess(serve_args(tiny_text_model, "--log-level", "info"), env) as server:
        server.wait_for("warming up", timeout=120)
        assert not any(d.exists() for d in stale), server.output
        assert live.is_dir()  # another process's conversion in progress is left alone
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        rc = server.wait(timeout=20)
        took = time.monotonic() - t0
        out = server.output
    assert rc == 0, out
    assert "SERVING on" not in out, "the signal came after warm-up: this test checked nothing\n" + out
    assert "jaxserve: stopped" in out and "Traceback" not in out, out
    assert took < 10, f"{took:.1f}s from SIGTERM to exit\n{out}"
    assert sorted(p.name for p in cache.iterdir() if p.name.startswith(CONVERSION_TMP_PREFIX)) == []


def test_sigterm_while_loading_the_model_exits_at_once_with_code_0(tiny_text_model):
    with ServeProcess(serve_args(tiny_text_model, "--log-level", "info"), server_env()) as server:
        server.wait_for("loading", timeout=60)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        rc = server.wait(timeout=20)
        took = time.monotonic() - t0
        out = server.output
    assert rc == 0 and "SIGTERM before serving; stopped" in out and "listening on" not in out, out
    assert "Traceback" not in out and took < 5, (took, out)
