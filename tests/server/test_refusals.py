"""Refusal back-off (``jaxserve.server.refusals``): a client whose requests keep being refused is
refused at the door, before its HTTP body is read; other clients are not touched, and the
client is served again once its bucket refills.

The bucket on a fake clock, then a real server on the mock engine (no model) with two API keys:
a real HTTP client over a real socket and a gRPC client.
"""
import socket
import time
import urllib.parse

import grpc
import pytest

from jaxserve.server import errors
from jaxserve.server.refusals import RefusalBudget

from .conftest import LIMITS, MAX_WAITING, MOCK_ENGINE, MODEL_NAME, http_call, on_the_mock_server

BAD, GOOD, DROPPER, HEAVY = "bad-client-key", "good-client-key", "dropping-client-key", "heavy-client-key"
RATE = 2.0  # refusals a second; burst 4

served, cases = on_the_mock_server()


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_bucket_closes_after_its_burst_and_reopens_at_its_rate():
    clock = Clock()
    b = RefusalBudget(2.0, clock=clock)
    assert b.burst == 4
    for _ in range(4):
        assert b.closed_for("a") is None
        b.refused("a")
    assert b.closed_for("a") == pytest.approx(0.5)  # one token back after 1 / rate
    assert b.closed_for("b") is None  # another client is not touched
    clock.t += 0.5
    assert b.closed_for("a") is None
    b.refused("a")
    assert b.closed_for("a") == pytest.approx(0.5)
    clock.t += 10
    assert b.closed_for("a") is None
    for _ in range(4):  # refilled to the burst, no further
        b.refused("a")
    assert b.closed_for("a") is not None


def test_a_refusal_weighs_one_token_and_one_more_per_refusal_bytes_of_request():
    from jaxserve.server.refusals import REFUSAL_BYTES

    clock = Clock()
    b = RefusalBudget(2.0, clock=clock)  # burst 4
    b.refused("a", REFUSAL_BYTES - 1)
    assert b.closed_for("a") is None  # one token: three left
    b.refused("a", 2 * REFUSAL_BYTES)
    assert b.closed_for("a") == pytest.approx(0.5)  # three more: none left


def test_rate_zero_is_off_and_bad_values_are_refused():
    b = RefusalBudget(0)
    for _ in range(100):
        b.refused("a")
    assert b.closed_for("a") is None
    with pytest.raises(ValueError, match="refusal rate"):
        RefusalBudget(-1)


def test_only_the_clients_own_faults_count():
    assert errors.invalid_argument("x").client_fault and errors.too_large("x").client_fault
    assert errors.client_queue_full(1, 1, 0.1).client_fault
    assert not errors.queue_full(1, 1, 0.1).client_fault  # the server's queue: nobody's fault
    assert not errors.unavailable("warming").client_fault
    assert not errors.refused_at_door(1.0).client_fault


@pytest.fixture(scope="module")
def keyed():
    from jaxserve.client import Client
    from jaxserve.server.app import ServerThread
    from jaxserve.server.auth import ApiKeys
    from jaxserve.server.limits import ServeLimits
    from jaxserve.testing import MockLLM

    # no hold: the door's own answers, each at once (the hold: test_a_refusal_at_the_door_is_held)
    limits = ServeLimits(**{**LIMITS, "client_refusal_rate": RATE, "door_hold_s": 0.0})
    st = ServerThread(MockLLM(**MOCK_ENGINE), max_waiting=MAX_WAITING, limits=limits, http_port=0,
                      served_model_name=MODEL_NAME, keys=ApiKeys([BAD, GOOD, DROPPER, HEAVY])).start()
    st.wait_ready()
    yield st
    st.stop()


def _post(st, key, body):
    return http_call(st.http_target + "/completions", body, {"authorization": f"Bearer {key}"})


def _door_closed_before_the_body(st, key) -> bytes:
    """Send only the headers of a 1 MB request and read the answer: the door answers without the body."""
    url = urllib.parse.urlsplit(st.http_target)
    with socket.create_connection((url.hostname, url.port), timeout=10) as s:
        s.sendall((f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n"
                   f"content-type: application/json\r\ncontent-length: 1000000\r\n\r\n").encode())
        return s.recv(4096)


def test_a_client_refused_too_often_is_refused_at_the_door_alone(keyed):
    bad_body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "temperature": -1}
    good_body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
    codes = [_post(keyed, BAD, bad_body)[0] for _ in range(8)]
    assert codes[0] == 400 and 429 in codes, codes
    status, body, headers = _post(keyed, BAD, good_body)  # even a good request: the door is closed
    assert status == 429 and "--client-refusal-rate" in body["error"]["message"]
    headers = {k.lower(): v for k, v in headers.items()}
    assert float(headers["retry-after"]) > 0 and headers["connection"] == "close"
    assert _door_closed_before_the_body(keyed, BAD).startswith(b"HTTP/1.1 429")
    assert _post(keyed, GOOD, good_body)[0] == 200  # the other client is served meanwhile
    from jaxserve.client import Client

    with Client(keyed.target, timeout=30, api_key=BAD) as c, pytest.raises(grpc.RpcError) as e:
        c.generate([5, 6, 7], max_tokens=2)  # the same client over gRPC: the same bucket
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    time.sleep(1.5 / RATE)
    assert _post(keyed, BAD, good_body)[0] == 200  # served again once a token is back


def test_a_large_refused_body_closes_the_door_at_once(keyed):
    """Over HTTP a refusal weighs the body the server read: one invalid request of 300 KB takes
    the whole burst (4 tokens at 64 KiB a token more), where a small one takes one."""
    pad = "x" * (300 << 10)
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "temperature": -1, "user": pad}
    assert _post(keyed, HEAVY, body)[0] == 400
    status, answer, _ = _post(keyed, HEAVY, {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
    assert status == 429 and "--client-refusal-rate" in answer["error"]["message"]


def _streams(st, key, n: int, drop: bool) -> int:
    """Up to n GenerateStream calls of ``key``'s, each read to its end or dropped after its first
    event (then the server is waited for until it has ended it) -> how many ran before one was
    refused at the door."""
    from jaxserve.client import Client

    with Client(st.target, timeout=30, api_key=key) as c:
        for i in range(n):
            call = c.generate_stream([5, 6, 7], max_tokens=200 if drop else 3, ignore_eos=True)
            try:
                if drop:
                    next(call)
                    call.cancel()
                else:
                    assert list(call)[-1].WhichOneof("event") == "end"
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "dropped" in e.details()
                return i
            deadline = time.monotonic() + 10
            while st.server.core.active and time.monotonic() < deadline:
                time.sleep(0.01)
    return n


def test_a_client_that_keeps_dropping_its_streams_meets_the_door(keyed):
    """Starting streams and walking away is refused work too: each stream its client cancels
    before its end takes a token (burst 4 at 2 a second); streams read to their end take none,
    and the other clients are served meanwhile."""
    assert _streams(keyed, GOOD, 10, drop=False) == 10
    assert _streams(keyed, DROPPER, 10, drop=True) in (4, 5)
    assert _post(keyed, GOOD, {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})[0] == 200
    time.sleep(1.5 / RATE)
    assert _streams(keyed, DROPPER, 1, drop=False) == 1  # served again once a token is back


def test_without_keys_there_is_no_bound(served):
    """The mock server has no keys (and the default rate): one connection's 40 bad requests are
    each answered for what they are, never at the door."""
    from jaxserve.client import Client

    codes = set()
    with Client(served.target, timeout=30) as c:
        for _ in range(40):
            try:
                c.generate([5, 6, 7], max_tokens=2, temperature=-1.0)
            except grpc.RpcError as e:
                codes.add(e.code())
    assert codes == {grpc.StatusCode.INVALID_ARGUMENT}
