"""`jaxserve client ...` against the test server, and `jaxserve serve` end to end in a
subprocess: warm-up before SERVING, then a graceful drain on SIGTERM."""
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from jaxserve.server.cli import main

from .conftest import http_call
from .serve_process import serve_args, server_env


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_client_cli(served, cases, capsys):
    t = served.target
    code, out, err = run_cli(capsys, "client", "--target", t, "health")
    assert code == 0 and out.strip() == "SERVING"
    code, out, _ = run_cli(capsys, "client", "--target", t, "info")
    assert code == 0 and json.loads(out)["architecture"] == "LlamaForCausalLM"
    prompt, kw, want = cases["text_greedy"]
    for extra in ([], ["--stream"]):
        code, out, err = run_cli(capsys, "client", "--target", t, "generate", prompt, "--max-tokens",
                                 str(kw["max_tokens"]), "--no-chat-template", *extra)
        assert code == 0 and out.rstrip("\n") == want.text and want.finish_reason in err
    code, out, _ = run_cli(capsys, "client", "--target", t, "tokenize", "Hello world")
    assert code == 0 and [int(x) for x in out.split()] == served.client.tokenize("Hello world")
    code, _, err = run_cli(capsys, "client", "--target", t, "generate", "--prompt-ids", "5,49152")
    assert code == 1 and "INVALID_ARGUMENT" in err and "vocabulary" in err


def test_streamed_deltas_print_text_and_ids_only_without_text():
    from jaxserve.server.client_cli import delta_output
    from jaxserve.v1 import jaxserve_pb2 as pb

    assert delta_output(pb.TokenDelta(token_ids=[2], text=""), text_prompt=True) == ""  # EOS after a text
    assert delta_output(pb.TokenDelta(token_ids=[9], text=" Paris"), text_prompt=True) == " Paris"
    assert delta_output(pb.TokenDelta(token_ids=[5, 6], text=""), text_prompt=False) == "5 6 "  # no tokenizer


@pytest.mark.slow
def test_serve_subprocess_warms_up_then_drains_on_sigterm(tiny_text_model):
    from jaxserve.client import Client

    proc = subprocess.Popen(serve_args(tiny_text_model, "--http-port", "0"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=server_env())
    lines = []
    try:
        target = http = None
        for line in proc.stdout:  # "listening on H:P ..." comes first, then "SERVING on H:P ..."
            lines.append(line)
            if "HTTP API on" in line:
                http = line.split(" on ")[1].split()[0]
            if "SERVING on" in line:
                target = line.split("SERVING on ")[1].split()[0]
                break
        assert target, "".join(lines)
        with Client(target, timeout=60) as client:
            assert client.health() == "SERVING"
            # Three 240-token streams keep the server busy for hundreds of steps after SIGTERM.
            streams = [client.generate_stream([5, 6, 7 + i], max_tokens=240, ignore_eos=True) for i in range(3)]
            for it in streams:
                assert next(it).WhichOneof("event") == "start"
            proc.send_signal(signal.SIGTERM)  # drain: health NOT_SERVING, new work refused...
            end = time.monotonic() + 10
            while client.health() != "NOT_SERVING" and time.monotonic() < end:
                time.sleep(0.01)
            assert client.health() == "NOT_SERVING"
            with pytest.raises(grpc.RpcError) as e:
                client.generate([5, 6], max_tokens=2)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
            status, body, headers = http_call(http + "/completions", {"model": Path(tiny_text_model).name,
                                                                      "prompt": [5, 6], "max_tokens": 2})
            assert status == 503 and "draining" in body["error"]["message"] and "retry-after" in headers
            for it in streams:  # ...and the running streams still finish
                events = list(it)
                assert events[-1].WhichOneof("event") == "end" and events[-1].end.usage.completion_tokens == 240
        rest = threading.Thread(target=lambda: lines.extend(proc.stdout))
        rest.start()
        assert proc.wait(60) == 0, "".join(lines)
        rest.join(5)
        assert any("draining" in x for x in lines) and any("stopped" in x for x in lines), "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_client_module_does_not_import_jax():
    # Clients (and `jaxserve client`) must start instantly and install nothing heavy.
    code = "import sys, jaxserve.client, jaxserve.server.cli; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
