"""The public HTTP routers (sglang-router, and vllm-router, its fork for vLLM workers) in
front of two jaxserve HTTP workers: requests through them are spread over both and answered
as the workers answer.

The routers are not dependencies of jaxserve: each case runs where its router is installed
and is skipped elsewhere. sglang-router: in this interpreter or in the one
$JAXSERVE_ROUTER_PYTHON names (e.g. ``python -m venv /tmp/r && /tmp/r/bin/pip install
sglang-router``); vllm-router: the ``vllm-router`` command on PATH or at $JAXSERVE_VLLM_ROUTER.
"""
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from .conftest import CONVERSATION, MODEL_NAME, eventually, scrape
from .serve_process import ServeProcess, serve_args, server_env


def router_command(kind: str) -> list[str] | None:
    """The command that starts router `kind` ("sglang" | "vllm"), or None if not installed."""
    if kind == "sglang":
        python = os.environ.get("JAXSERVE_ROUTER_PYTHON") or (
            sys.executable if importlib.util.find_spec("sglang_router") else None)
        return [python, "-m", "sglang_router.launch_router"] if python else None
    exe = os.environ.get("JAXSERVE_VLLM_ROUTER") or shutil.which("vllm-router")
    return [exe] if exe else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answered(rpc_counts: dict) -> float:
    return sum(v for (name, labels), v in rpc_counts.items()
               if name == "jaxserve_requests_total" and ("rpc", "http.chat") in labels)


@pytest.fixture(scope="module")
def second_worker(tiny_text_model):
    """A `jaxserve serve --http-port` subprocess: (its HTTP base URL, its metrics port)."""
    args = serve_args(tiny_text_model, "--http-port", "0", "--served-model-name", MODEL_NAME, "--metrics-port", "0")
    with ServeProcess(args, server_env()) as worker:
        listening = worker.wait_for("listening on", timeout=120)
        metrics_port = int(listening.split("metrics port ")[1].split(")")[0])
        base = worker.wait_for("OpenAI-compatible HTTP API on", timeout=30).split(" on ")[1].split()[0]
        worker.wait_for("SERVING on", timeout=300)
        yield base, metrics_port


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_a_public_router_spreads_requests_over_two_jaxserve_workers(served, kind, request):
    command = router_command(kind)
    if command is None:
        pytest.skip(f"{kind}-router is not installed (see the module doc)")
    openai = pytest.importorskip("openai")
    second, metrics_port = request.getfixturevalue("second_worker")
    first, port = served.http_target, free_port()
    router = subprocess.Popen(
        [*command, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", first.removesuffix("/v1"),
         second.removesuffix("/v1"), "--policy", "round_robin", "--log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        assert eventually(lambda: _up(base + "/health"), 60), "the router did not start"
        with openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60) as routed, \
                openai.OpenAI(base_url=first, api_key="unused", max_retries=0, timeout=60) as direct:
            want = direct.chat.completions.create(model=MODEL_NAME, messages=CONVERSATION, max_tokens=6,
                                                  temperature=0).choices[0].message.content
            before = (answered(served.metrics()), answered(scrape(metrics_port)))
            texts = [routed.chat.completions.create(model=MODEL_NAME, messages=CONVERSATION, max_tokens=6,
                                                    temperature=0).choices[0].message.content for _ in range(6)]
            streamed = "".join(c.choices[0].delta.content or "" for c in routed.chat.completions.create(
                model=MODEL_NAME, messages=CONVERSATION, max_tokens=6, temperature=0, stream=True) if c.choices)
        after = (answered(served.metrics()), answered(scrape(metrics_port)))
        assert texts == [want] * 6 and streamed == want  # both workers compute the same function
        per_worker = [a - b for a, b in zip(after, before)]
        assert sum(per_worker) == 7 and min(per_worker) >= 1, per_worker
    finally:
        router.terminate()
        router.wait(10)


def _up(url: str) -> bool:
    try:
        return urllib.request.urlopen(url, timeout=2).status == 200
    except OSError:
        return False
    finally:
        time.sleep(0.1)
