"""A replica over 2 processes x 4 virtual CPU devices (jax.distributed, gloo, loopback) against
the same model on 1 process x 8 devices: the tiny DeepSeek-V3 MoE (experts split over the 8
devices, 4 per process), bf16 and fp8 KV.

- Log-probs: through the Python API on the mirrored runner (``multihost_worker``), since the
  gRPC API does not carry log-probs; there each process also places a row-split tensor and
  reads only its own devices' rows.
- Tokens: through ``jaxserve serve --num-processes 2`` and the gRPC front.
- Failure: killing process 1 mid-generation fails the request in flight with UNAVAILABLE and
  turns health NOT_SERVING within a bound; process 0 exits with EXIT_PEER_LOST; the group
  started again serves again (with fp8 KV), and a process 1 that stops answering fails it too.
"""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

from jaxserve.multihost.launch import EXIT_PEER_LOST

from . import multihost_worker as worker
from .serve_process import ServeProcess, server_env

LONG = dict(max_tokens=40, ignore_eos=True)  # a generation still running when process 1 dies


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_env() -> dict:
    env = server_env()
    env.pop("XLA_FLAGS", None)  # each process asks for its own 4 devices
    return env


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from hf_models import build_deepseek_v3

    path = tmp_path_factory.mktemp("tiny_moe")
    build_deepseek_v3(path, num_hidden_layers=2, seed=5)
    return str(path)


@pytest.fixture(scope="module")
def single(moe):
    """The 1 process x 8 devices reference, per KV format."""
    from jaxserve import LLM

    out = {}
    for fmt in worker.FORMATS:
        llm = LLM(moe, kv_format=fmt, num_devices=8, **worker.ENGINE)
        out[fmt] = worker.reference(llm)
    return out


def test_two_processes_match_one_process_logprobs_and_tokens(moe, single, tmp_path):
    out = tmp_path / "two.npz"
    coord, step = f"127.0.0.1:{free_port()}", str(free_port())
    cmd = [sys.executable, "-m", "tests.server.multihost_worker", moe, coord, step]
    logs = [tmp_path / f"process{i}.log" for i in (1, 0)]  # files: a full pipe cannot block a process
    procs = [subprocess.Popen(cmd + [str(i), str(out)], env=group_env(), stdout=log.open("w"),
                              stderr=subprocess.STDOUT) for i, log in zip((1, 0), logs)]
    try:
        for p in procs:
            p.wait(timeout=150)
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log.read_text() for log in logs)
    for i in (0, 1):  # each process read only the rows its own devices hold, one row per device
        placed = np.load(f"{out}.process{i}.npz")
        assert bool(placed["ok"]) and sorted(map(tuple, placed["rows"])) == [(r, r + 1) for r in range(4 * i, 4 * i + 4)]
    got = np.load(out)
    for fmt in worker.FORMATS:
        ref = single[fmt]
        np.testing.assert_allclose(got[f"{fmt}/prompt_logprobs"], ref["prompt_logprobs"], rtol=0, atol=2e-5)
        np.testing.assert_array_equal(got[f"{fmt}/greedy"], ref["greedy"])
        np.testing.assert_allclose(got[f"{fmt}/greedy_logprobs"], ref["greedy_logprobs"], rtol=0, atol=2e-5)
        np.testing.assert_array_equal(got[f"{fmt}/sampled"], ref["sampled"])


def start_group(moe, kv_format: str, coord: str, step: int, port: int) -> list[ServeProcess]:
    args = [sys.executable, "-m", "jaxserve.server.cli", "serve", "--model", moe, "--metrics-port", "-1",
            "--log-level", "warning", "--kv-format", kv_format, "--num-devices", "8", "--coordinator", coord,
            "--num-processes", "2", "--step-port", str(step), "--peer-timeout", "3", "--port", str(port)]
    for key, value in worker.ENGINE.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    # process 1 first: it waits for the coordinator that process 0 starts
    return [ServeProcess(args + ["--process-id", str(i)], env=group_env()) for i in (1, 0)][::-1]


def check_tokens(client, ref: dict) -> None:
    greedy = client.generate(worker.PROMPT, max_tokens=6, ignore_eos=True)
    assert list(greedy.token_ids) == ref["greedy"].tolist()
    sampled = client.generate(worker.PROMPT[:9], **worker.SAMPLED)
    assert list(sampled.token_ids) == ref["sampled"].tolist()


def fail_in_flight(client, group, sig: int, bound_s: float) -> None:
    """A stream in flight when process 1 gets ``sig``: an explicit UNAVAILABLE within
    ``bound_s``, health NOT_SERVING, new requests UNAVAILABLE, process 0 exits 3."""
    stream = client.generate_stream(worker.PROMPT[:5], **LONG)
    next(iter(stream))
    group[1].proc.send_signal(sig)
    hit = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        for _ in stream:
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "lost one of its processes" in err.value.details() and "process 1" in err.value.details()
    assert time.monotonic() - hit < bound_s
    assert client.health(timeout=5) == "NOT_SERVING"
    with pytest.raises(grpc.RpcError) as err:
        client.generate([5, 6], max_tokens=2)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert group[0].wait(15) == EXIT_PEER_LOST


def test_grpc_tokens_peer_loss_and_restart(moe, single):
    """Killed (SIGKILL: its connections close at once), then, after a restart of the group on
    the same addresses, stopped (SIGSTOP: it just stops answering, and the collective in
    flight blocks for good: only the heartbeat timeout, 3 s here, can end the request)."""
    from jaxserve.client import Client

    coord, step, port = f"127.0.0.1:{free_port()}", free_port(), free_port()
    for kv_format, sig, bound in (("bf16", signal.SIGKILL, 5.0), ("fp8_e4m3", signal.SIGSTOP, 3.0 + 5.0)):
        group = start_group(moe, kv_format, coord, step, port)
        try:
            group[0].wait_for("SERVING on", 150)
            with Client(f"127.0.0.1:{port}", timeout=30) as client:
                check_tokens(client, single[kv_format])
                fail_in_flight(client, group, sig, bound)
        finally:
            for p in group:
                p.close()
