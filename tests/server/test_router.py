"""sglang-router (the public HTTP router of SGLang workers) in front of two jaxserve HTTP
workers: requests through it are spread over both and answered as the workers answer.

The router is not a dependency of jaxserve: this test runs where it is installed, in this
interpreter or in the one $JAXSERVE_ROUTER_PYTHON names (e.g. a separate virtual
environment: ``python -m venv /tmp/r && /tmp/r/bin/pip install sglang-router``), and is
skipped elsewhere.
"""
import importlib.util
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from .conftest import CONVERSATION, MODEL_NAME, eventually, scrape
from .serve_process import ServeProcess, serve_args, server_env


def router_python() -> str | None:
    python = os.environ.get("JAXSERVE_ROUTER_PYTHON")
    if python:
        return python
    return sys.executable if importlib.util.find_spec("sglang_router") else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answered(rpc_counts: dict) -> float:
    return sum(v for (name, labels), v in rpc_counts.items()
               if name == "jaxserve_requests_total" and ("rpc", "http.chat") in labels)


@pytest.mark.slow
@pytest.mark.skipif(router_python() is None, reason="sglang-router is not installed (see the module doc)")
def test_sglang_router_spreads_requests_over_two_jaxserve_workers(served, tiny_text_model):
    openai = pytest.importorskip("openai")
    args = serve_args(tiny_text_model, "--http-port", "0", "--served-model-name", MODEL_NAME,
                      "--metrics-port", "0")
    port = free_port()
    with ServeProcess(args, server_env()) as worker:
        listening = worker.wait_for("listening on", timeout=120)
        metrics_port = int(listening.split("metrics port ")[1].split(")")[0])
        second = worker.wait_for("OpenAI-compatible HTTP API on", timeout=30).split(" on ")[1].split()[0]
        worker.wait_for("SERVING on", timeout=300)
        first = served.http_target
        router = subprocess.Popen(
            [router_python(), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
             "--worker-urls", first.removesuffix("/v1"), second.removesuffix("/v1"), "--policy", "round_robin",
             "--log-level", "warn"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
            after = (answered(served.metrics()), answered(scrape(metrics_port)))
            assert texts == [want] * 6  # both workers compute the same function
            per_worker = [a - b for a, b in zip(after, before)]
            assert sum(per_worker) == 6 and min(per_worker) >= 1, per_worker
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
