"""How the router pairs prefill and decode workers (fakes that advertise what real workers do in
ModelInfo: role, KV layout, handoff fingerprint): the decode worker is chosen first and the
prefill worker converts to its layout; a prefill worker of another handoff fingerprint is
skipped; an offer never goes to a decode worker of another layout; what an offer cannot carry
(log-probs, n > 1) goes to the decode worker alone; a worker started with another role is kept
out; the router answers GetModelInfo as one colocated endpoint."""
import grpc
import pytest

from jaxserve.client import finish_reason

from .conftest import eventually, health, metric, routed, session_for
from .fakes import expected_tokens

POOLS = {"p1": "prefill", "p2": "prefill", "d1": "decode", "d2": "decode"}
PROMPT = list(range(40, 61))
LAYOUTS = {"p1": "L-bf16", "p2": "L-bf16", "d1": "L-fp8", "d2": "L-fp8"}


def advertise(rt, fakes, layouts=LAYOUTS) -> None:
    for name, f in fakes.items():
        f.sw.advertise, f.sw.role, f.sw.kv_layout = True, POOLS[name], layouts[name]
    rt.run(rt.router.pool.check_all())


def test_the_prefill_worker_converts_to_the_chosen_decode_workers_layout(fake_loop):
    with routed(fake_loop, POOLS) as (rt, client, fakes):
        advertise(rt, fakes, {**LAYOUTS, "d2": "L-bf16"})
        addresses = [fakes["d1"].address, fakes["d2"].address]
        for name, layout in (("d1", "L-fp8"), ("d2", "L-bf16")):
            r = client.generate(PROMPT, max_tokens=4, session_id=session_for(fakes[name].address, addresses))
            assert list(r.token_ids) == expected_tokens(PROMPT, 4)
            dreq = fakes[name].decode_requests[-1]
            assert dreq.HasField("offer") and dreq.offer.kv_layout == layout and not dreq.recompute_on_failure
            assert [p.target_kv_layout for f in ("p1", "p2") for p in fakes[f].prefill_requests][-1] == layout
        assert metric(rt, "jaxserve_router_handoffs_total", outcome="ok") == 2
        info = client.model_info()  # one endpoint: a colocated worker's role, no handoff layout
        assert (info.role, info.kv_layout, info.handoff_fingerprint) == ("both", "", "fp-A")
        assert info.prefill.weights.endswith("-prefill") and info.decode.weights.endswith("-decode")


def test_a_retry_on_a_decode_worker_of_another_layout_goes_without_the_offer(fake_loop):
    with routed(fake_loop, POOLS) as (rt, client, fakes):
        advertise(rt, fakes, {**LAYOUTS, "d2": "L-bf16"})
        d1, d2 = fakes["d1"], fakes["d2"]
        d1.sw.fail_before_start = grpc.StatusCode.UNAVAILABLE
        r = client.generate(PROMPT, max_tokens=4, session_id=session_for(d1.address, [d1.address, d2.address]))
        assert list(r.token_ids) == expected_tokens(PROMPT, 4) and finish_reason(r) == "length"
        assert d1.decode_requests[0].HasField("offer")
        assert [(d.HasField("offer"), d.recompute_on_failure) for d in d2.decode_requests] == [(False, True)]
        assert metric(rt, "jaxserve_router_handoff_failures_total", cause="offer_mismatch") == 1
        released = [r for name in ("p1", "p2") for r in fakes[name].released]
        assert eventually(lambda: all(not fakes[n].offers for n in ("p1", "p2")))
        assert [pulled for _, pulled in released] == [False]  # given back by the router, unpulled


def test_prefill_workers_of_another_handoff_fingerprint_are_skipped(fake_loop):
    with routed(fake_loop, POOLS) as (rt, client, fakes):
        advertise(rt, fakes)
        fakes["p1"].sw.fingerprint = "fp-B"  # other weights: its offers would be refused
        rt.run(rt.router.pool.check_all())
        for i in range(4):
            r = client.generate(PROMPT + [i], max_tokens=3)
            assert list(r.token_ids) == expected_tokens(PROMPT + [i], 3)
        assert not fakes["p1"].calls and len(fakes["p2"].calls) == 4
        fakes["p2"].sw.fingerprint = "fp-B"  # none fits: the decode worker prefills itself
        rt.run(rt.router.pool.check_all())
        r = client.generate(PROMPT, max_tokens=3)
        assert list(r.token_ids) == expected_tokens(PROMPT, 3) and len(fakes["p2"].calls) == 4
        assert [d.HasField("offer") for n in ("d1", "d2") for d in fakes[n].decode_requests].count(False) == 1
        assert metric(rt, "jaxserve_router_handoff_failures_total", cause="fingerprint_mismatch") == 5
        assert metric(rt, "jaxserve_router_handoffs_total", outcome="no_offer") == 1


@pytest.mark.parametrize("kw", [dict(logprobs=1), dict(n=2, temperature=0.7, seed=1)])
def test_what_an_offer_cannot_carry_goes_to_the_decode_worker_alone(fake_loop, kw):
    with routed(fake_loop, POOLS) as (rt, client, fakes):
        advertise(rt, fakes)
        r = client.generate(PROMPT, max_tokens=3, **kw)
        assert list(r.token_ids) == expected_tokens(PROMPT, 3)
        assert not fakes["p1"].calls and not fakes["p2"].calls
        decoded = [d for n in ("d1", "d2") for d in fakes[n].decode_requests]
        assert len(decoded) == 1 and not decoded[0].HasField("offer")
        assert metric(rt, "jaxserve_router_handoffs_total", outcome="no_offer") == 1


def test_a_worker_started_with_another_role_is_kept_out(fake_loop):
    with routed(fake_loop, POOLS) as (rt, client, fakes):
        advertise(rt, fakes)
        fakes["p1"].sw.role = "decode"  # `--prefill` given a decode worker
        fakes["d2"].sw.role = "both"  # `--decode` given a colocated worker (it serves no KvHandoff)
        rt.run(rt.router.pool.check_all())
        for name in ("p1", "d2"):
            assert health(rt.target, f"worker/{fakes[name].address}") == "NOT_SERVING", name
        for i in range(3):
            assert list(client.generate(PROMPT + [i], max_tokens=2).token_ids) == expected_tokens(PROMPT + [i], 2)
        assert not fakes["p1"].calls and not fakes["d2"].decode_requests
        fakes["p1"].sw.role = "prefill"  # restarted with the right role: back in
        rt.run(rt.router.pool.check_all())
        assert health(rt.target, f"worker/{fakes['p1'].address}") == "SERVING"
