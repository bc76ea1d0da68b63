"""Request values outside the engine's types are a 400 at the edge (never a 500, never a step
failure for others), and a request's work is bounded before it is admitted: an HTTP body
counted while it arrives (chunked or not), a chat's message count before templating; clients
that leave early are logged once at INFO as cancelled. Over real sockets against the mock engine's
server (httpx, the official openai client's own transport; raw sockets for the bodies)."""
import json
import logging
import select
import socket
import threading
import time
import urllib.parse

import grpc
import pytest

try:  # the openai client's HTTP transport: httpx, named httpx2 by newer openai releases
    import httpx
except ImportError:
    import httpx2 as httpx

from jaxserve.client import build_request
from jaxserve.v1 import jaxserve_pb2 as pb

from .conftest import CONVERSATION, LIMITS, MODEL_NAME, eventually, on_the_mock_server


served, cases = on_the_mock_server()

HUGE = 10**400  # a 401-digit integer
CHAT = {"model": MODEL_NAME, "messages": CONVERSATION, "max_tokens": 2}
COMPLETION = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 2}
# (endpoint body, the param the 400 names (None: no single field))
BAD_VALUES = {
    "top_k_int32": (dict(COMPLETION, top_k=2**31), "top_k"),
    "max_tokens_int32": (dict(COMPLETION, max_tokens=2**31), "max_tokens"),
    "n_int32": (dict(COMPLETION, n=2**31), "n"),
    "logprobs_int32": (dict(COMPLETION, logprobs=2**31), "logprobs"),
    "seed_huge": (dict(COMPLETION, seed=HUGE), "seed"),
    "stop_token_id_int32": (dict(COMPLETION, stop_token_ids=[2**31]), "stop_token_ids"),
    "prompt_id_int32": (dict(COMPLETION, prompt=[5, 2**31]), "prompt"),
    "top_logprobs_int32": (dict(CHAT, logprobs=True, top_logprobs=2**31), "top_logprobs"),
    **{f"{name}_401_digits": (dict(COMPLETION, **{name: HUGE}), name) for name in (
        "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")},
    "temperature_float32_inf": (dict(COMPLETION, temperature=1e300), "temperature"),
    "surrogate_prompt": (dict(COMPLETION, prompt="a\ud800b"), "prompt"),
    "surrogate_content": (dict(CHAT, messages=[{"role": "user", "content": "\ud800"}]), "messages"),
    "surrogate_content_part": (dict(CHAT, messages=[{"role": "user", "content": [
        {"type": "text", "text": "\udfff"}]}]), "messages"),
    "surrogate_role": (dict(CHAT, messages=[{"role": "\ud800", "content": "hi"}]), "messages"),
    "surrogate_stop": (dict(COMPLETION, stop=["\ud800"]), "stop"),
    "surrogate_session": (dict(COMPLETION, session_id="\ud800"), "session_id"),
    "stream_options_string": (dict(COMPLETION, stream=True, stream_options="x"), "stream_options"),
    "include_usage_string": (dict(COMPLETION, stream=True, stream_options={"include_usage": "x"}), "include_usage"),
    "model_number": (dict(COMPLETION, model=5), "model"),
}


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served.http_target.removesuffix("/v1"), timeout=60) as client:
        yield client


def post(http, path: str, body) -> httpx.Response:
    """POST `body` as JSON with Python's escapes (so a lone surrogate travels as ``\\ud800``)."""
    return http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def no_errors_logged(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_values_outside_the_engine_types_are_400(served, http, case, caplog):
    body, param = BAD_VALUES[case]
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    with caplog.at_level(logging.INFO):
        r = post(http, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert len(err["message"]) < 300  # a 401-digit integer is not echoed whole
    assert not no_errors_logged(caplog)


def test_json_nested_100k_levels_is_400(served, http, caplog):
    with caplog.at_level(logging.INFO):
        r = http.post("/v1/completions", content=b"[" * 100_000 + b"]" * 100_000,
                      headers={"content-type": "application/json"})
        deep_string = post(http, "/v1/completions", dict(COMPLETION, prompt="[" * 100))  # 100 brackets, in a string
    assert r.status_code == 400 and "--max-json-depth" in r.json()["error"]["message"]
    assert deep_string.status_code == 200
    assert not no_errors_logged(caplog)


def test_top_k_past_int32_leaves_four_grpc_streams_and_an_http_client_untouched(served, cases, http):
    """The probe that aborted every request in flight: it is a 400 and the others finish."""
    p, kw, want = cases["ids_greedy"]
    calls = [served.client.stub.GenerateStream(build_request(p, **dict(kw, max_tokens=12)), timeout=60)
             for _ in range(4)]
    good = {}
    thread = threading.Thread(target=lambda: good.update(r=post(http, "/v1/completions", {
        "model": MODEL_NAME, "prompt": list(p), "max_tokens": 12, "ignore_eos": True, "temperature": 0})))
    thread.start()
    assert eventually(lambda: served.kv().used > 0, 10)  # they run
    bad = post(http, "/v1/completions", dict(COMPLETION, top_k=2147483648))
    streamed = [[t for m in call if m.HasField("delta") for t in m.delta.token_ids] for call in calls]
    thread.join(60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_k"
    assert streamed == [list(want)] * 4
    assert good["r"].status_code == 200 and good["r"].json()["choices"][0]["text"] == want.text
    assert served.eventually_idle()


def _raw(served) -> socket.socket:
    url = urllib.parse.urlsplit(served.http_target)
    return socket.create_connection((url.hostname, url.port), timeout=30)


def _response(sock) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def test_a_chunked_body_over_the_limit_is_refused_while_it_arrives(served):
    """A chunked body (no Content-Length) of 64 MiB against a 13 MiB limit: the 413 comes
    back while the client is still sending, and far less than the whole body was sent."""
    limit = 6 * LIMITS["max_prompt_bytes"] + (1 << 20)  # the fixture's --max-body-bytes
    sock = _raw(served)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"transfer-encoding: chunked\r\n\r\n")
    piece = b"x" * (1 << 16)
    chunk = b"%x\r\n" % len(piece) + piece + b"\r\n"
    head = b'{"model": "%s", "prompt": "' % MODEL_NAME.encode()
    sock.sendall(b"%x\r\n" % len(head) + head + b"\r\n")
    sent, planned = len(head), 64 << 20
    sock.setblocking(False)
    while sent < planned:
        readable, writable, _ = select.select([sock], [sock], [], 10)
        if readable:
            break
        if writable:
            try:
                sock.send(chunk)  # a partial send only garbles the tail the server never reads
            except BlockingIOError:
                continue
            sent += len(piece)
    sock.setblocking(True)
    reply = _response(sock)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"--max-body-bytes" in reply or b"content-length" in reply.lower()
    assert limit < sent < planned // 2, (limit, sent)
    assert served.eventually_idle()


def test_a_declared_body_over_the_limit_is_refused_unread(served):
    sock = _raw(served)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n{" % (100 << 20))
    reply = _response(sock)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]


def test_a_chat_over_max_messages_is_refused_before_templating(served, http):
    """10,000 messages (the fixture's --max-messages is its context, 256): refused on the
    count, by HTTP and gRPC alike, not after templating and tokenizing ~60k tokens."""
    many = [{"role": "user", "content": "hi"}] * 10_000
    r = post(http, "/v1/chat/completions", {"model": MODEL_NAME, "messages": many, "max_tokens": 2})
    assert r.status_code == 400 and "--max-messages" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages"
    req = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="hi")] * 10_000)
    with pytest.raises(grpc.RpcError) as e:
        served.client.stub.Generate(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-messages" in e.value.details()


def test_a_client_that_leaves_while_sending_its_body_is_logged_once_as_cancelled(served, caplog):
    with caplog.at_level(logging.INFO, logger="jaxserve.server"):
        for _ in range(3):
            sock = _raw(served)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: 5000\r\n\r\n{\"model\": ")
            time.sleep(0.05)
            sock.close()
        assert eventually(lambda: sum("disconnected while sending its body" in r.getMessage()
                                      for r in caplog.records) == 3, 10)
    hits = [r for r in caplog.records if "disconnected while sending its body" in r.getMessage()]
    assert all(r.levelno == logging.INFO and "outcome=cancelled" in r.getMessage() for r in hits)
    assert not no_errors_logged(caplog)


def _blocked_writers(served) -> int:
    return sum(s.writing_since is not None for s in list(served.server.service.active.values()))


@pytest.fixture(scope="module")
def roomy():
    """A mock server whose pool holds six streams of 1,000 tokens at once and whose stream
    idle timeout (30 s) outlasts the test, so the six writers block together on their
    clients' windows and stay blocked until the clients close."""
    from jaxserve.client import Client
    from jaxserve.server.app import ServerThread
    from jaxserve.server.limits import ServeLimits
    from jaxserve.testing import MockLLM

    from .conftest import MOCK_ENGINE, Served

    llm = MockLLM(**(MOCK_ENGINE | dict(num_pages=1024, max_model_len=1024)))
    st = ServerThread(llm, limits=ServeLimits(**(LIMITS | dict(stream_idle_timeout_s=30.0))), http_port=0).start()
    st.wait_ready()
    client = Client(st.target, timeout=60)
    yield Served(st, client, {})
    client.close()
    st.stop()


def test_generate_streams_whose_clients_never_read_and_close_are_cancelled_not_internal(roomy, caplog):
    """Six clients that open a stream, read nothing and close: each stream's write waits for the
    client's flow-control window (1,000 tokens of 20 log-probs, ~245 kB, fill its 64 kB), then
    the channel goes away: cancelled, no traceback, even when grpc fails the write before it
    marks the call cancelled."""
    req = build_request([40000], max_tokens=1000, ignore_eos=True, logprobs=20)  # ids of three varint bytes
    with caplog.at_level(logging.INFO, logger="jaxserve.server"):
        channels = []
        for _ in range(6):
            channel = grpc.insecure_channel(roomy.target, options=[("grpc.http2.bdp_probe", 0)])
            channels.append((channel, channel.unary_stream("/jaxserve.v1.JaxServe/GenerateStream",
                                                           request_serializer=pb.GenerateRequest.SerializeToString)(
                req, timeout=30)))
        assert eventually(lambda: _blocked_writers(roomy) == 6, 20)
        for channel, _ in channels:
            channel.close()
        assert roomy.eventually_idle()
    outcomes = [r.getMessage() for r in caplog.records if "GenerateStream request=" in r.getMessage()]
    assert len(outcomes) == 6 and all("outcome=cancelled" in m for m in outcomes), outcomes
    assert not no_errors_logged(caplog)
