"""Bounded work: per-request limits (INVALID_ARGUMENT naming the flag), tokenization that
does not stall other clients, caps on open streams, and the timeout of unread streams."""
import random
import threading
import time

import grpc
import pytest

from jaxserve.server.limits import PROMPT_BYTES_PER_TOKEN, ServeLimits

from jaxserve.v1 import jaxserve_pb2 as pb

from .conftest import IDS_A, LIMITS, MODEL_NAME, eventually, http_call, metric

INVALID = grpc.StatusCode.INVALID_ARGUMENT
DEFAULTS = ServeLimits()
BIG_TEXT_BYTES = LIMITS["max_prompt_bytes"] - 4096  # just under the served fixture's limit

# name -> (prompt, build_request keyword arguments, the flag the message must name)
OVER = {
    "stop strings": ([5], dict(stop=[f"s{i}" for i in range(DEFAULTS.max_stop_strings + 1)]), "--max-stop-strings"),
    "stop bytes": ([5], dict(stop=["é" * (DEFAULTS.max_stop_bytes // 2 - 1), "abc"]), "--max-stop-bytes"),
    "stop token ids": ([5], dict(stop_token_ids=list(range(DEFAULTS.max_stop_token_ids + 1))),
                       "--max-stop-token-ids"),
    "prompt bytes": ("€" * (LIMITS["max_prompt_bytes"] // 3 + 1), {}, "--max-prompt-bytes"),
}
AT_LIMIT = {  # the same limits exactly reached: accepted
    "stop strings": dict(stop=[f"s{i}" for i in range(DEFAULTS.max_stop_strings)]),
    "stop bytes": dict(stop=["é" * (DEFAULTS.max_stop_bytes // 2 - 2), "abcd"]),
    "stop token ids": dict(stop_token_ids=list(range(DEFAULTS.max_stop_token_ids))),
}


@pytest.mark.parametrize("name", list(OVER))
def test_each_limit_is_invalid_argument_naming_its_flag(mock_served, name):
    prompt, kw, flag = OVER[name]
    for call in (mock_served.client.generate, lambda p, **k: list(mock_served.client.generate_stream(p, **k))):
        with pytest.raises(grpc.RpcError) as e:
            call(prompt, max_tokens=2, **kw)
        assert e.value.code() == INVALID and flag in e.value.details(), e.value.details()
    if name in AT_LIMIT:
        assert mock_served.client.generate([5, 6], max_tokens=2, ignore_eos=True, **AT_LIMIT[name]).token_ids
    assert mock_served.kv().used == 0


def test_tool_definitions_count_toward_the_prompt_limit_on_both_fronts(mock_served):
    """Messages and tools each under --max-prompt-bytes, together over it: refused before the
    template writes the tools into the prompt (gRPC INVALID_ARGUMENT, HTTP 400), nothing run."""
    half = "d" * (LIMITS["max_prompt_bytes"] // 2 + 16)
    tool = pb.Tool(name="lookup", description=half, parameters='{"type": "object"}')
    req = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=half)], tools=[tool],
                             stop=pb.StopCriteria(max_tokens=2))
    for call in (mock_served.client.stub.Generate, lambda r: list(mock_served.client.stub.GenerateStream(r))):
        with pytest.raises(grpc.RpcError) as e:
            call(req)
        assert e.value.code() == INVALID and "--max-prompt-bytes" in e.value.details(), e.value.details()
        assert "tools" in e.value.details()
    fn = {"name": "lookup", "description": half, "parameters": {"type": "object"}}
    status, body, _ = http_call(mock_served.http_target + "/chat/completions", {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": half}], "max_tokens": 2,
        "tools": [{"type": "function", "function": fn}]})
    assert status == 400 and "--max-prompt-bytes" in body["error"]["message"], body
    assert mock_served.kv().used == 0


def test_tokenize_is_bounded_by_the_prompt_limit(mock_served):
    with pytest.raises(grpc.RpcError) as e:
        mock_served.client.tokenize("a" * (LIMITS["max_prompt_bytes"] + 1))
    assert e.value.code() == INVALID and "--max-prompt-bytes" in e.value.details()


def test_prompt_limit_defaults_from_the_context_length(mock_served):
    assert ServeLimits().resolved(256).max_prompt_bytes == PROMPT_BYTES_PER_TOKEN * 256
    assert ServeLimits(max_prompt_bytes=10).resolved(256).max_prompt_bytes == 10
    with pytest.raises(ValueError, match="max_streams"):
        ServeLimits(max_streams=0)


def _big_text(n_bytes: int) -> str:
    rng = random.Random(0)
    words = ["hello", "world", "the", "of", "quantum", "tokenizer", "éclair", "数据", "42", "\n"]
    parts, size = [], 0
    while size < n_bytes:
        w = rng.choice(words)
        parts.append(w)
        size += len(w.encode()) + 1
    return " ".join(parts)[: n_bytes // 4 * 3]


def test_a_huge_prompt_being_tokenized_does_not_stall_other_clients(served):
    """Small requests keep being answered while a ~2 MB text is tokenized. Tokenizing it
    holding the GIL (tokenizers' plain encode) stalls every thread of the server process,
    so a small request in flight then waits for the whole tokenization: the bound is half
    of the big call's own duration, whatever the machine's load."""
    text = _big_text(BIG_TEXT_BYTES)
    assert len(text.encode()) <= LIMITS["max_prompt_bytes"]
    big_done, latencies, result = threading.Event(), [], {}

    def big():
        t = time.perf_counter()
        try:
            served.client.generate(text, max_tokens=1)
        except grpc.RpcError as e:
            result["code"], result["details"] = e.code(), e.details()
        result["seconds"] = time.perf_counter() - t
        big_done.set()

    served.client.generate(IDS_A[:4], max_tokens=2, ignore_eos=True)  # warm path
    thread = threading.Thread(target=big)
    thread.start()
    while not big_done.is_set():
        t = time.perf_counter()
        served.client.generate(IDS_A[:4], max_tokens=2, ignore_eos=True)
        latencies.append(time.perf_counter() - t)
    thread.join(60)
    # Its tokens cannot fit the context: rejected, but only after being tokenized.
    assert result["code"] == INVALID and "maximum context" in result["details"], result
    assert max(latencies) < 0.5 * result["seconds"], (max(latencies), result["seconds"])
    assert len(latencies) >= 3, (latencies, result)  # the small requests did overlap the big one


def _connect(target, options=()):
    """A client on its own connection (grpc shares one between channels otherwise)."""
    from jaxserve.client import Client

    channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1), *options])
    return channel, Client(target, timeout=60, channel=channel)


def _open_streams(target, n):
    channel, client = _connect(target)
    calls = [client.generate_stream(IDS_A[:6], max_tokens=200, ignore_eos=True) for _ in range(n)]
    for c in calls:
        c.initial_metadata()  # sent once the handler holds its slot and accepted the request
    return channel, client, calls


def test_open_streams_are_capped_per_connection_and_in_total(mock_served):
    """The engine is held between steps meanwhile, so no stream can finish and free its slot."""
    per_peer, total = LIMITS["max_streams_per_peer"], LIMITS["max_streams"]
    release = threading.Event()
    held = mock_served.server.engine_loop.call(lambda engine: release.wait(30))
    channels = []
    try:
        a, client_a, calls_a = _open_streams(mock_served.target, per_peer)
        channels.append(a)
        with pytest.raises(grpc.RpcError) as e:
            next(client_a.generate_stream(IDS_A[:6], max_tokens=2))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-streams-per-connection" in e.value.details()
        b, _, calls_b = _open_streams(mock_served.target, total - per_peer)  # another connection: fine
        c, client_c = _connect(mock_served.target)
        channels += [b, c]
        with pytest.raises(grpc.RpcError) as e:
            next(client_c.generate_stream(IDS_A[:6], max_tokens=2))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-streams)" in e.value.details()
        for call in calls_a + calls_b:
            call.cancel()
        release.set()
        held.result(10)
        # Slots come back when the handlers end.
        assert eventually(lambda: _try_stream(client_c), timeout=10)
    finally:
        release.set()
        for ch in channels:
            ch.close()
    assert eventually(lambda: mock_served.kv().used == 0, timeout=10)


def _try_stream(client) -> bool:
    try:
        return any(ev.WhichOneof("event") == "end" for ev in client.generate_stream([5, 6], max_tokens=2))
    except grpc.RpcError:
        return False


def test_an_unread_stream_is_cancelled_after_its_timeout_and_its_pages_freed(mock_served):
    """The client asks for a stream and reads nothing: with a 64-byte flow-control window
    the server's writes block after a message or two. The engine is held between steps
    (ServerThread.call) until the stream's timeout has cancelled it, so the request cannot
    simply finish first; once released, the abort frees its pages well before its 240 tokens."""
    key = dict(rpc="GenerateStream", outcome="unread_timeout")
    before = mock_served.metrics()
    max_tokens = 240
    opts = [("grpc.http2.lookahead_bytes", 64), ("grpc.http2.bdp_probe", 0)]
    channel, client = _connect(mock_served.target, opts)
    release = threading.Event()
    try:
        call = client.generate_stream(IDS_A[:8], max_tokens=max_tokens, ignore_eos=True)
        # A few tokens out: their messages (with the start event) are more than the window holds.
        assert eventually(lambda: metric(mock_served.metrics(), "jaxserve_completion_tokens_total")
                          - metric(before, "jaxserve_completion_tokens_total") >= 6, timeout=10)
        held = mock_served.server.engine_loop.call(lambda engine: release.wait(20))
        timed_out = eventually(lambda: metric(mock_served.metrics(), "jaxserve_requests_total", **key)
                               > metric(before, "jaxserve_requests_total", **key), timeout=10)
        release.set()
        held.result(10)
        assert timed_out
        assert eventually(lambda: mock_served.kv().used == 0, timeout=10)
        generated = (metric(mock_served.metrics(), "jaxserve_completion_tokens_total")
                     - metric(before, "jaxserve_completion_tokens_total"))
        assert 0 < generated < max_tokens  # aborted, not finished
        with pytest.raises(grpc.RpcError) as e:
            list(call)  # what the server had sent, then the status
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "--stream-idle-timeout" in e.value.details()
    finally:
        release.set()
        channel.close()


def test_every_limit_is_a_serve_flag_with_the_documented_default():
    import argparse

    from jaxserve.server.cli import limits_from, register_serve

    parser = argparse.ArgumentParser()
    register_serve(parser.add_subparsers())
    assert limits_from(parser.parse_args(["serve"])) == ServeLimits()
    flags = ["--max-prompt-bytes", "100", "--max-stop-strings", "3", "--max-stop-bytes", "50",
             "--max-stop-token-ids", "4", "--max-streams-per-connection", "5", "--max-streams", "6",
             "--stream-idle-timeout", "2.5", "--max-queued-per-client", "7", "--client-refusal-rate", "3.5"]
    assert limits_from(parser.parse_args(["serve", *flags])) == ServeLimits(
        max_prompt_bytes=100, max_stop_strings=3, max_stop_bytes=50, max_stop_token_ids=4, max_streams_per_peer=5,
        max_streams=6, stream_idle_timeout_s=2.5, max_queued_per_client=7, client_refusal_rate=3.5)
    with pytest.raises(ValueError, match="max_queued_per_client"):
        limits_from(parser.parse_args(["serve", "--max-queued-per-client", "-1"]))
    with pytest.raises(ValueError, match="max_streams_per_peer"):
        limits_from(parser.parse_args(["serve", "--max-streams-per-connection", "0"]))
