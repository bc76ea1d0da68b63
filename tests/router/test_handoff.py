"""The router's disaggregated flow against fake KvHandoff workers: Prefill on a prefill worker,
Decode with its offer on a decode worker; retries (another prefill worker, recompute after a
failed pull, another decode worker), statuses (FAILED_PRECONDITION), no offer left behind."""
import time

import grpc
import pytest

from jaxserve.client import finish_reason

from .conftest import eventually, metric, routed, session_for
from .fakes import expected_tokens

POOLS = {"p1": "prefill", "p2": "prefill", "d1": "decode", "d2": "decode"}
PROMPT = list(range(40, 61))


def _no_offer_left(fakes) -> bool:
    return all(not f.offers for f in fakes.values())


def test_prefill_then_decode_with_the_offer(fake_loop):
    with routed(fake_loop, POOLS) as (rt, client, fakes):
        r = client.generate(PROMPT, max_tokens=5, session_id="chat")
        assert list(r.token_ids) == expected_tokens(PROMPT, 5) and finish_reason(r) == "length"
        assert r.session_id == "chat" and r.usage.prompt_tokens == 21
        prefill = [f for n, f in fakes.items() if n.startswith("p") and f.calls]
        decode = [f for n, f in fakes.items() if n.startswith("d") and f.decode_requests]
        assert len(prefill) == 1 and len(decode) == 1
        dreq = decode[0].decode_requests[0]
        assert dreq.HasField("offer") and not dreq.recompute_on_failure
        assert dreq.offer.address == prefill[0].address and list(dreq.offer.prompt_token_ids) == PROMPT
        assert prefill[0].released == [(dreq.offer.transfer_id, True)]  # pulled by the decode worker
        for _ in range(5):  # the session keeps its decode worker; the prefix its prefill worker
            events = list(client.generate_stream(PROMPT + [1], max_tokens=3, session_id="chat"))
            assert [e.delta.token_ids[0] for e in events if e.WhichOneof("event") == "delta"] == \
                expected_tokens(PROMPT + [1], 3)
            assert events[0].start.cached_tokens == 20  # the prefill worker's prefix cache, via the offer
        assert len(decode[0].decode_requests) == 6 and len(prefill[0].calls) == 6
        assert metric(rt, "jaxserve_router_handoffs_total", outcome="ok") == 6
        assert metric(rt, "jaxserve_router_handoff_bytes_total") == 64 * (21 + 5 * 22)
        assert metric(rt, "jaxserve_router_handoff_seconds_count", stage="prefill") == 6
        assert client.model_info().prefill.weights.endswith("-prefill")
        assert _no_offer_left(fakes)


def test_failed_prefill_is_retried_on_another_prefill_worker(fake_loop):
    with routed(fake_loop, POOLS) as (rt, client, fakes):
        fakes["p1"].sw.fail_prefill = grpc.StatusCode.UNAVAILABLE
        fakes["p2"].sw.kv_free = 8  # busier: two choices tries p1 first
        rt.run(rt.router.pool.check_all())
        r = client.generate(PROMPT, max_tokens=4)
        assert list(r.token_ids) == expected_tokens(PROMPT, 4)
        assert [c[0] for c in fakes["p1"].calls] == ["Prefill"] and [c[0] for c in fakes["p2"].calls] == ["Prefill"]
        assert metric(rt, "jaxserve_router_handoff_failures_total", cause="prefill_unavailable") == 1
        fakes["p2"].sw.fail_prefill = grpc.StatusCode.ABORTED  # none left: the decode worker prefills
        r = client.generate(PROMPT, max_tokens=4)
        assert list(r.token_ids) == expected_tokens(PROMPT, 4)
        decoded = [d for f in fakes.values() for d in f.decode_requests]
        assert sorted(d.HasField("offer") for d in decoded) == [False, True]
        assert metric(rt, "jaxserve_router_handoff_failures_total", cause="prefill_aborted") == 1
        assert metric(rt, "jaxserve_router_handoff_failures_total", cause="no_prefill_worker") == 1
        assert metric(rt, "jaxserve_router_handoffs_total", outcome="no_offer") == 1


def test_aborted_pull_is_retried_with_recompute(fake_loop):
    with routed(fake_loop, POOLS) as (rt, client, fakes):
        session = session_for(fakes["d1"].address, [fakes["d1"].address, fakes["d2"].address])
        fakes["d1"].sw.fail_pulls = 1
        r = client.generate(PROMPT, max_tokens=4, session_id=session)
        assert list(r.token_ids) == expected_tokens(PROMPT, 4)
        reqs = fakes["d1"].decode_requests
        assert [d.recompute_on_failure for d in reqs] == [False, True]
        assert reqs[0].offer.transfer_id == reqs[1].offer.transfer_id
        assert metric(rt, "jaxserve_router_handoff_failures_total", cause="pull_aborted") == 1
        assert metric(rt, "jaxserve_router_handoffs_total", outcome="retried") == 1
        assert _no_offer_left(fakes)


def test_fingerprint_mismatch_is_failed_precondition_and_the_offer_is_released(fake_loop):
    with routed(fake_loop, POOLS) as (rt, client, fakes):
        for name in ("d1", "d2"):
            fakes[name].sw.fingerprint = "fp-other"
        with pytest.raises(grpc.RpcError) as e:
            client.generate(PROMPT, max_tokens=4)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "fingerprint" in e.value.details()
        assert eventually(lambda: _no_offer_left(fakes))
        released = [r for f in fakes.values() for r in f.released]
        assert len(released) == 1 and released[0][1] is False  # given up, not pulled
        assert metric(rt, "jaxserve_router_handoff_failures_total", cause="failed_precondition") == 1
        assert sum(len(f.decode_requests) for f in fakes.values()) == 1  # not retried: a config error


def test_dead_decode_worker_moves_the_request(fake_loop):
    with routed(fake_loop, POOLS) as (rt, client, fakes):
        d1, d2 = fakes["d1"], fakes["d2"]
        d1.sw.fail_before_start = grpc.StatusCode.UNAVAILABLE
        session = session_for(d1.address, [d1.address, d2.address])
        r = client.generate(PROMPT, max_tokens=4, session_id=session)
        assert list(r.token_ids) == expected_tokens(PROMPT, 4)
        assert len(d1.decode_requests) == 1 and [d.recompute_on_failure for d in d2.decode_requests] == [True]
        assert metric(rt, "jaxserve_router_handoff_failures_total", cause="decode_unavailable") == 1
        assert _no_offer_left(fakes)
        d2.sw.die_after_tokens = 1  # mid-stream: explicit UNAVAILABLE
        with pytest.raises(grpc.RpcError) as e:
            client.generate(PROMPT, max_tokens=4, session_id=session)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "after 1 streamed token" in e.value.details()


def test_abort_during_prefill_and_cancel_during_decode(fake_loop):
    with routed(fake_loop, POOLS) as (rt, client, fakes):
        for name in ("p1", "p2"):
            fakes[name].sw.prefill_delay_s = 5.0
        it = client.generate_stream(PROMPT, max_tokens=4, request_id="early")
        assert eventually(lambda: any(f.calls for f in fakes.values()))
        t0 = time.monotonic()
        assert list(client.abort("early").aborted) == ["early"]
        events = list(it)
        assert time.monotonic() - t0 < 2
        assert [e.WhichOneof("event") for e in events] == ["start", "end"] and finish_reason(events[1].end) == "abort"
        assert not any(f.decode_requests for f in fakes.values())
        for name in ("p1", "p2"):
            fakes[name].sw.prefill_delay_s = 0.0
        for name in ("d1", "d2"):
            fakes[name].sw.token_delay_s = 0.05
        it = client.generate_stream(PROMPT, max_tokens=100, request_id="late")
        assert [next(it).WhichOneof("event") for _ in range(2)] == ["start", "delta"]
        it.cancel()
        assert eventually(lambda: any("late" in f.cancelled for f in fakes.values()))
        assert eventually(lambda: not rt.router.service.active)
        assert _no_offer_left(fakes)


def test_timing_counts_from_the_clients_call_at_the_router(fake_loop):
    """The decode worker measures from its own call; the client's time to first token includes
    the prefill before it."""
    with routed(fake_loop, POOLS) as (rt, client, fakes):
        for name in ("p1", "p2"):
            fakes[name].sw.prefill_delay_s = 0.3
        r = client.generate(PROMPT, max_tokens=3)
        assert 0.3 <= r.timing.time_to_first_token_s <= r.timing.total_s < 5
        end = list(client.generate_stream(PROMPT + [1], max_tokens=3))[-1].end
        assert 0.3 <= end.timing.time_to_first_token_s <= end.timing.total_s < 5
