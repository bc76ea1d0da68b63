"""`jaxserve route` (a real process on loopback) over two workers: the router's answers are the
worker's (tokens, texts, errors), a session keeps its worker, a shared prefix goes where it is
cached, and a stopped worker is taken out while requests keep succeeding. The workers are servers
over the mock engine (``jaxserve.testing.MockLLM``, in this process: greedy tokens are the
previous + 1); two tests route to the real tiny model's server (``served``): its tokens, and
its constrained answers (a JSON schema, a required tool call).
The tests run in order: the cluster's last two stop a worker, then the router."""
import re
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from jaxserve.client import Client, build_request, finish_reason

from .conftest import IDS_A, IDS_B, MOCK_ENGINE, MOCK_TEXT, eventually, mock_text
from .constrained import assemble, check_schema_answer, check_tool_answer, schema_request, tool_request, whole
from .serve_process import ServeProcess, server_env

CASES = [
    (IDS_A, dict(max_tokens=12, ignore_eos=True)),
    (MOCK_TEXT, dict(max_tokens=10)),
    ("What is two plus two?", dict(max_tokens=10, chat_template=True)),
    (IDS_B, dict(max_tokens=12, temperature=0.8, top_k=50, top_p=0.9, seed=7, ignore_eos=True)),
    (MOCK_TEXT, dict(max_tokens=10, stop=["wx"])),
]
BAD = [
    ([], dict(max_tokens=2)),  # empty prompt
    ([49152], dict(max_tokens=2)),  # id >= vocab
    (IDS_A, dict(max_tokens=250)),  # prompt + max_tokens > context
    (IDS_A, dict(max_tokens=2, temperature=-1.0)),
    (IDS_A, dict(max_tokens=2, request_id="bad id")),
    ([1, 2], dict(max_tokens=0)),
]


@pytest.fixture(scope="module")
def cluster():
    from jaxserve.server.app import ServerThread
    from jaxserve.testing import MockLLM

    workers = [ServerThread(MockLLM(**MOCK_ENGINE), metrics_port=None).start() for _ in range(2)]
    router = None
    try:
        for w in workers:
            w.wait_ready(60)
        addresses = [w.target for w in workers]
        router = ServeProcess([sys.executable, "-m", "jaxserve.router.cli", "route", "--port", "0",
                               "--metrics-port", "-1", "--health-interval", "0.2", "--unhealthy-after", "1",
                               *[a for addr in addresses for a in ("--worker", addr)]], server_env())
        line = router.wait_for("routing on", timeout=60)
        assert "2 up" in line, router.output
        target = re.search(r"routing on (127\.0\.0\.1:\d+)", line).group(1)
        clients = [Client(a, timeout=60) for a in [target, *addresses]]
        yield dict(router=router, workers=workers, addresses=addresses, client=clients[0], direct=clients[1:])
        for c in clients:
            c.close()
    finally:
        if router is not None:
            router.close()
        for w in workers:
            w.stop(0.5)


def _replica(client: Client, prompt, **kw) -> tuple:
    """(response, the x-jaxserve-replica header)."""
    resp, call = client.stub.Generate.with_call(build_request(prompt, **kw), timeout=60)
    return resp, dict(call.initial_metadata())["x-jaxserve-replica"]


def test_choices_log_probs_and_conversations_are_a_workers(cluster):
    """n > 1, log-probs with alternatives and multi-turn messages pass through the router as the
    worker answers them, unary (assembled from the worker's stream) and streamed."""
    client, direct = cluster["client"], cluster["direct"][0]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a colour."}]
    for prompt, kw in [(IDS_A, dict(max_tokens=6, n=3, temperature=0.9, seed=11, logprobs=2, ignore_eos=True)),
                       (chat, dict(max_tokens=6, logprobs=1))]:
        want, got = direct.generate(prompt, **kw), client.generate(prompt, **kw)
        for field in ("token_ids", "text", "finish_reason", "logprobs", "choices"):
            assert getattr(got, field) == getattr(want, field), (field, kw)
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want.usage.prompt_tokens,
                                                                          want.usage.completion_tokens)
        streamed = list(client.generate_stream(prompt, **kw))
        starts = [e.start.index for e in streamed if e.WhichOneof("event") == "start"]
        assert sorted(starts) == list(range(kw.get("n", 1)))  # every choice's Start relayed
        ids = [t for e in streamed if e.WhichOneof("event") == "delta" and e.delta.index == 0 for t in e.delta.token_ids]
        assert ids == list(want.token_ids)


def test_tokens_and_texts_are_a_workers(cluster):
    client, direct = cluster["client"], cluster["direct"][0]
    r = client.generate(IDS_A, max_tokens=4, ignore_eos=True)  # the mock's arithmetic: the previous + 1
    assert list(r.token_ids) == [IDS_A[-1] + k for k in (1, 2, 3, 4)] and r.text == mock_text(r.token_ids)
    r = client.generate(MOCK_TEXT, max_tokens=10, stop=["wx"])
    assert (r.text, finish_reason(r)) == ("tuv", "stop")
    for prompt, kw in CASES:
        want, got = direct.generate(prompt, **kw), client.generate(prompt, **kw)
        assert (list(got.token_ids), got.text, got.finish_reason) == (list(want.token_ids), want.text,
                                                                       want.finish_reason), (prompt, kw)
        streamed = list(client.generate_stream(prompt, **kw))
        ids = [t for e in streamed if e.WhichOneof("event") == "delta" for t in e.delta.token_ids]
        assert ids == list(want.token_ids) and finish_reason(streamed[-1].end) == finish_reason(want)
    assert client.tokenize("Hello there") == direct.tokenize("Hello there")
    assert client.model_info().fingerprint == direct.model_info().fingerprint


def test_bad_input_gets_the_same_status_as_a_worker(cluster):
    client, direct = cluster["client"], cluster["direct"][0]
    for prompt, kw in BAD:
        errs = []
        for c in (direct, client):
            with pytest.raises(grpc.RpcError) as e:
                c.generate(prompt, **kw)
            errs.append((e.value.code(), e.value.details()))
        assert errs[0] == errs[1], (prompt, kw)


def test_a_session_keeps_its_worker(cluster):
    client = cluster["client"]
    for session in ("alice", "bob", "carol"):
        seen = {_replica(client, IDS_B + [i], max_tokens=2, session_id=session)[1] for i in range(4)}
        assert len(seen) == 1, (session, seen)


def test_a_shared_prefix_lands_where_it_is_cached(cluster):
    client = cluster["client"]
    prefix = [(37 * i) % 40000 + 100 for i in range(41)]  # 5 full pages of 8 may hit
    first, where = _replica(client, prefix, max_tokens=2)
    assert first.usage.cached_tokens == 0
    for k in range(4):
        resp, replica = _replica(client, prefix + [k + 1], max_tokens=2)
        assert replica == where and resp.usage.cached_tokens == 40, (k, resp.usage)


def test_abort_and_cancel_reach_the_worker_and_free_its_pages(cluster):
    client, direct = cluster["client"], cluster["direct"]

    def pages_used():
        return sum(c.model_info().kv_pages.used for c in direct)

    it = client.generate_stream(IDS_A, max_tokens=200, ignore_eos=True, request_id="via-router")
    assert [next(it).WhichOneof("event") for _ in range(2)] == ["start", "delta"]
    assert pages_used() > 0
    r = client.abort("via-router", "never-ran")
    assert list(r.aborted) == ["via-router"] and list(r.not_found) == ["never-ran"]
    assert finish_reason(list(it)[-1].end) == "abort"
    it = client.generate_stream(IDS_A, max_tokens=200, ignore_eos=True)
    assert [next(it).WhichOneof("event") for _ in range(2)] == ["start", "delta"]
    it.cancel()
    assert eventually(lambda: pages_used() == 0)


def test_a_stopped_worker_is_taken_out_and_requests_keep_succeeding(cluster):
    client, (a, b) = cluster["client"], cluster["addresses"]
    victim = cluster["workers"][1]
    # A session on the victim, mid-stream when it stops: an explicit UNAVAILABLE, not a hang.
    session = next(s for s in (f"s{i}" for i in range(200)) if _replica(client, [5, 6], max_tokens=1,
                                                                        session_id=s)[1].endswith(f":{b.split(':')[1]}"))
    it = client.generate_stream(IDS_A, max_tokens=200, ignore_eos=True, session_id=session, timeout=30)
    assert [next(it).WhichOneof("event") for _ in range(2)] == ["start", "delta"]
    victim.stop(0)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(it)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t0 < 10
    with ThreadPoolExecutor(4) as pool:  # the victim's sessions and new ones: all served by the other
        results = list(pool.map(lambda i: client.generate(IDS_B, max_tokens=4, session_id=f"{session}-{i % 3}"
                                                          if i % 2 else session), range(8)))
    assert all(finish_reason(r) == "length" and len(r.token_ids) == 4 for r in results)
    assert eventually(lambda: client.health(f"worker/{b}") == "NOT_SERVING", timeout=10)
    assert client.health(f"worker/{a}") == "SERVING" and client.health() == "SERVING"
    assert "is down" in cluster["router"].wait_for("is down", timeout=10)


def test_the_router_drains_and_exits_0_on_sigterm(cluster):
    router = cluster["router"]
    router.proc.send_signal(signal.SIGTERM)
    assert router.wait(timeout=15) == 0
    assert "jaxserve: stopped" in router.output and "Traceback" not in router.output


def test_a_real_models_tokens_come_through_the_router(served, cases):
    """The router in front of the tiny model's server: the Python API's tokens, unary and streamed."""
    from jaxserve.router.app import RouterThread

    with RouterThread([(served.target, "both")], health_interval_s=0.1, health_timeout_s=2.0) as rt, \
            Client(rt.target, timeout=60) as client:
        for name in ("ids_greedy", "text_greedy", "sampled", "multi_turn"):
            prompt, kw, want = cases[name]
            r = client.generate(prompt, **kw)
            assert (list(r.token_ids), r.text, finish_reason(r)) == (list(want), want.text, want.finish_reason), name
            streamed = list(client.generate_stream(prompt, **kw))
            assert [t for e in streamed if e.WhichOneof("event") == "delta" for t in e.delta.token_ids] == list(want)


def test_constrained_requests_come_through_the_router_as_the_worker_answers(served):
    """A JSON-schema request and a required tool call through the router to the tiny model's
    server: unary (assembled by the router from the worker's stream: content and tool calls
    included) and streamed, they equal the worker's own answers, which validate."""
    from jaxserve.router.app import RouterThread

    with RouterThread([(served.target, "both")], health_interval_s=0.1, health_timeout_s=2.0) as rt, \
            Client(rt.target, timeout=60) as client:
        for build, check in ((schema_request, check_schema_answer), (tool_request, check_tool_answer)):
            for sampled in (False, True):
                req = build(f"routed-{build.__name__}-{sampled:d}", sampled)
                want = served.client.stub.Generate(req, timeout=60)
                check(want)
                assert whole(client.stub.Generate(req, timeout=60)) == whole(want), (build.__name__, sampled)
                assert assemble(client.stub.GenerateStream(req, timeout=60)) == whole(want), (build.__name__, sampled)
