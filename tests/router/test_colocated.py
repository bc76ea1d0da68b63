"""The router over colocated fake workers: relaying, affinity, retries, failure statuses,
Abort and cancellation. Tokens are the fake model's, computed by hand (``expected_tokens``)."""
import logging
import time

import grpc
import pytest

from jaxserve.client import build_request, finish_reason, retry_after_s
from jaxserve.v1 import jaxserve_pb2 as pb

from .conftest import eventually, health, metric, routed, session_for
from .fakes import expected_tokens, text_ids

BOTH = {"a": "both", "b": "both"}
PROMPT = list(range(300, 321))  # 21 tokens: 5 full pages of 4


def test_tokens_events_and_usage_are_the_workers(fake_loop):
    with routed(fake_loop, BOTH) as (rt, client, fakes):
        r = client.generate(PROMPT, max_tokens=6)
        assert list(r.token_ids) == expected_tokens(PROMPT, 6) and finish_reason(r) == "length"
        assert r.request_id.startswith("req-") and r.usage.prompt_tokens == 21 and r.usage.completion_tokens == 6
        ran = [f for f in fakes.values() if f.calls]
        assert len(ran) == 1 and ran[0].calls[0][1] == r.request_id  # the id the router made is the worker's
        events = list(client.generate_stream(PROMPT, max_tokens=4, request_id="mine"))
        kinds = [e.WhichOneof("event") for e in events]
        assert kinds == ["start"] + ["delta"] * 4 + ["end"]
        assert events[0].start.request_id == "mine" and events[0].start.cached_tokens == 20  # same worker: cached
        assert [e.delta.token_ids[0] for e in events[1:5]] == expected_tokens(PROMPT, 4)
        assert client.tokenize("hi") == text_ids("hi") and client.detokenize([5, 6]) == "<5><6>"
        assert client.model_info().replica_id in ("a", "b")
        assert metric(rt, "jaxserve_requests_total", rpc="GenerateStream", outcome="length") == 1


def test_same_session_same_worker_and_sessions_spread(fake_loop):
    with routed(fake_loop, {"a": "both", "b": "both", "c": "both"}) as (rt, client, fakes):
        for i in range(6):  # the field and the header are the same key
            kw = dict(session_id="conv-1") if i % 2 else dict(session_header="conv-1")
            client.generate([i + 1, 2, 3], max_tokens=1, **kw)
        assert sorted(len(f.calls) for f in fakes.values()) == [0, 0, 6]
        for i in range(24):
            client.generate([9, 9, i], max_tokens=1, session_id=f"user-{i}")
        assert all(len(f.calls) > 0 for f in fakes.values())


def test_shared_prefix_lands_where_it_is_cached(fake_loop):
    with routed(fake_loop, BOTH) as (rt, client, fakes):
        first = client.generate(PROMPT, max_tokens=2)
        holder = next(f for f in fakes.values() if f.calls)
        for k in range(6):
            r = client.generate(PROMPT + [k, k], max_tokens=2)
            assert r.usage.cached_tokens == 20, (k, r.usage)
        assert len(holder.calls) == 7 and first.usage.cached_tokens == 0
        # While a request is still generating, its prompt's pages already attract the next one.
        for f in fakes.values():
            f.sw.token_delay_s = 0.05
        other = [500 + i for i in range(21)]
        running = client.generate_stream(other, max_tokens=40)
        assert [next(running).WhichOneof("event") for _ in range(2)] == ["start", "delta"]
        for k in range(4):
            assert client.generate(other + [k], max_tokens=1).usage.cached_tokens == 20
        running.cancel()
        for f in fakes.values():
            f.sw.token_delay_s = 0.0
        text = "a prompt shared by many requests, long enough for pages"
        before = {n: len(f.calls) for n, f in fakes.items()}
        client.generate(text, max_tokens=1)
        (text_holder,) = [n for n, f in fakes.items() if len(f.calls) > before[n]]
        for k in range(4):  # text prompts too: the router tokenizes them on a worker to hash them
            assert client.generate(text + f" {k}", max_tokens=1).usage.cached_tokens > 0
        assert len(fakes[text_holder].calls) == before[text_holder] + 5
        assert metric(rt, "jaxserve_router_routed_total", role="both", reason="prefix") >= 10


def test_error_before_the_first_token_moves_the_request(fake_loop):
    with routed(fake_loop, BOTH) as (rt, client, fakes):
        a, b = fakes["a"], fakes["b"]
        a.sw.fail_before_start = grpc.StatusCode.UNAVAILABLE
        session = session_for(a.address, [a.address, b.address])
        events = list(client.generate_stream(PROMPT, max_tokens=3, session_id=session))
        assert [e.WhichOneof("event") for e in events] == ["start", "delta", "delta", "delta", "end"]
        assert [e.delta.token_ids[0] for e in events[1:4]] == expected_tokens(PROMPT, 3)
        assert len(a.calls) == 1 and len(b.calls) == 1
        assert metric(rt, "jaxserve_router_retries_total", cause="unavailable") == 1
        b.sw.fail_before_start = grpc.StatusCode.UNAVAILABLE  # nowhere left: the worker's status
        with pytest.raises(grpc.RpcError) as e:
            client.generate(PROMPT, max_tokens=3)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "fake failure" in e.value.details()


def test_death_mid_stream_ends_with_an_explicit_unavailable(fake_loop):
    with routed(fake_loop, BOTH) as (rt, client, fakes):
        for f in fakes.values():
            f.sw.die_after_tokens = 2
        it = client.generate_stream(PROMPT, max_tokens=8)
        got = []
        with pytest.raises(grpc.RpcError) as e:
            for ev in it:
                got.append(ev.WhichOneof("event"))
        assert got == ["start", "delta", "delta"]
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "after 2 streamed token(s)" in e.value.details()
        assert sum(len(f.calls) for f in fakes.values()) == 1  # not retried: the client has tokens


def test_hung_worker_taken_out_request_moved_and_re_added(fake_loop):
    with routed(fake_loop, BOTH) as (rt, client, fakes):
        a, b = fakes["a"], fakes["b"]
        a.sw.hang_after_tokens = 0  # admits (Start) and never produces a token
        session = session_for(a.address, [a.address, b.address])
        t0 = time.monotonic()
        it = client.generate_stream(PROMPT, max_tokens=3, session_id=session)
        time.sleep(0.3)
        fake_loop.run(a.set_serving(False))
        events = list(it)
        assert [e.WhichOneof("event") for e in events] == ["start", "delta", "delta", "delta", "end"]
        assert time.monotonic() - t0 < 5 and len(b.calls) == 1
        assert health(rt.target, f"worker/{a.address}") == "NOT_SERVING" and health(rt.target) == "SERVING"
        assert metric(rt, "jaxserve_router_worker_up", worker=a.address, role="both") == 0
        assert metric(rt, "jaxserve_router_health_check_failures_total", worker=a.address) >= 1
        a.sw.hang_after_tokens = None
        fake_loop.run(a.set_serving(True))
        assert eventually(lambda: health(rt.target, f"worker/{a.address}") == "SERVING")
        back = session_for(a.address, [a.address, b.address], "back")
        client.generate(PROMPT, max_tokens=1, session_id=back)
        assert fakes["a"].calls[-1][2] == back
        assert metric(rt, "jaxserve_router_worker_up", worker=a.address, role="both") == 1
        # Mid-stream, a worker that goes down ends the stream with UNAVAILABLE, never a hang.
        a.sw.hang_after_tokens = 2
        it = client.generate_stream(PROMPT, max_tokens=6, session_id=back)
        kinds = [next(it).WhichOneof("event") for _ in range(3)]
        fake_loop.run(a.set_serving(False))
        with pytest.raises(grpc.RpcError) as e:
            list(it)
        assert kinds == ["start", "delta", "delta"] and e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "worker_lost" in e.value.details()
        for f in fakes.values():
            fake_loop.run(f.set_serving(False))
        assert eventually(lambda: health(rt.target) == "NOT_SERVING")
        with pytest.raises(grpc.RpcError) as e:
            client.generate(PROMPT, max_tokens=1)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and retry_after_s(e.value) == 1.0


def test_bad_input_gets_the_workers_status(fake_loop):
    with routed(fake_loop, BOTH) as (rt, client, fakes):
        with pytest.raises(grpc.RpcError) as e:
            client.generate([], max_tokens=2)
        assert (e.value.code(), e.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "empty prompt")
        with pytest.raises(grpc.RpcError) as e:
            client.generate([1, 2], request_id="has space")
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in e.value.details()
        for f in fakes.values():
            f.sw.fail_before_start = grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as e:
            client.generate([1, 2], max_tokens=2)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and retry_after_s(e.value) == 0.25
        for f in fakes.values():
            f.sw.fail_before_start = None
            f.sw.token_delay_s = 0.05
        it = client.generate_stream([1, 2], max_tokens=50, request_id="dup")
        next(it)
        with pytest.raises(grpc.RpcError) as e:
            client.generate([1, 2], max_tokens=2, request_id="dup")
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
        it.cancel()


def test_abort_goes_where_the_request_runs_and_cancel_propagates(fake_loop):
    with routed(fake_loop, BOTH) as (rt, client, fakes):
        for f in fakes.values():
            f.sw.token_delay_s = 0.05
        it = client.generate_stream(PROMPT, max_tokens=100, request_id="to-abort")
        assert [next(it).WhichOneof("event") for _ in range(2)] == ["start", "delta"]
        r = client.abort("to-abort", "unknown-id")
        assert list(r.aborted) == ["to-abort"] and list(r.not_found) == ["unknown-id"]
        last = list(it)[-1]
        assert last.WhichOneof("event") == "end" and finish_reason(last.end) == "abort"
        it = client.generate_stream(PROMPT, max_tokens=100, request_id="to-cancel")
        assert [next(it).WhichOneof("event") for _ in range(2)] == ["start", "delta"]
        it.cancel()
        assert eventually(lambda: any("to-cancel" in f.cancelled for f in fakes.values()))
        assert eventually(lambda: not rt.router.service.active)
        assert eventually(lambda: all(w.in_flight == 0 for w in rt.router.pool.workers))


def test_a_client_that_stops_reading_is_cut_off_and_its_worker_call_cancelled(fake_loop):
    from jaxserve.server.limits import ServeLimits

    with routed(fake_loop, BOTH, limits=ServeLimits(stream_idle_timeout_s=0.5)) as (rt, client, fakes):
        for f in fakes.values():
            f.sw.delta_text_bytes = 64 << 10
        it = client.generate_stream(PROMPT, max_tokens=2000, request_id="sleepy")
        assert next(it).WhichOneof("event") == "start"  # then reads nothing more
        assert eventually(lambda: any("sleepy" in f.cancelled for f in fakes.values()), timeout=10)
        assert eventually(lambda: not rt.router.service.active)
        assert metric(rt, "jaxserve_requests_total", rpc="GenerateStream", outcome="unread_timeout") == 1
        it.cancel()


def test_clients_that_never_read_and_close_are_cancelled_not_internal(fake_loop, caplog):
    """Six clients open a stream, read nothing and close while the router's writes wait on
    their windows (64 kB a delta): each call is counted cancelled, with no traceback (grpc can
    fail the write before it marks the call cancelled)."""
    import logging

    from jaxserve.client import build_request
    from jaxserve.v1 import jaxserve_pb2 as pb

    with routed(fake_loop, BOTH) as (rt, client, fakes), caplog.at_level(logging.INFO, logger="jaxserve.router"):
        for f in fakes.values():
            f.sw.delta_text_bytes = 64 << 10
        channels = []
        for k in range(6):
            channel = grpc.insecure_channel(rt.target, options=[("grpc.http2.bdp_probe", 0)])
            channels.append((channel, channel.unary_stream("/jaxserve.v1.JaxServe/GenerateStream",
                                                           request_serializer=pb.GenerateRequest.SerializeToString)(
                build_request(PROMPT, max_tokens=2000, request_id=f"closer-{k}"), timeout=30)))
        routes = rt.router.service.active
        assert eventually(lambda: sum(r.writing_since is not None for r in list(routes.values())) == 6, 20)
        for channel, _ in channels:
            channel.close()
        assert eventually(lambda: not routes, 10)
        assert eventually(lambda: all(w.in_flight == 0 for w in rt.router.pool.workers))
        assert metric(rt, "jaxserve_requests_total", rpc="GenerateStream", outcome="cancelled") == 6
    # (the fake workers are grpc's own async-generator handlers: grpc logs their cancelled writes)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("jaxserve")]
