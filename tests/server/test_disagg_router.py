"""`jaxserve route --prefill A --decode B --decode C` in front of real workers, all processes on
loopback: a prefill worker with a bf16 pool and two decode workers with fp8_e4m3 pools.

Through the router a client gets exactly the tokens of one fp8 engine in this process that
imports the same converted pages (pulled here from the prefill worker, in the same prefix-cache
state the router's request meets), streamed, with the prefill worker's cached tokens in the
usage; a session keeps its decode worker. Faults: a corrupted payload is retried with
recompute, a decode worker killed behind the router ends its stream with an explicit status and
the rest move, a prefill worker killed mid-pull leaves the decode worker to prefill; every
request ends with its tokens (those of a single fp8 engine when the decode worker prefilled) or
an explicit status, and no page or offer is left. The tests run in order: they kill workers.
"""
from __future__ import annotations

import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from jaxserve.client import Client, build_request, finish_reason
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.router.affinity import rendezvous_order

from .conftest import IDS_A, IDS_B, eventually, metric, scrape
from .disagg_setup import ENGINE_KW, import_reference, metrics_port, payload_of, prefill, pull_bytes, release, \
    served_address, worker_args
from .serve_process import ServeProcess, server_env

TTL_S = 4.0
FAULTS = "corrupt_payload:rt-corrupt,die_mid_pull:rt-die"
PROMPTS = {  # name -> (ids, Client.generate keywords); IDS_A spans 3 pages of 8
    "greedy": (IDS_A, dict(max_tokens=10, ignore_eos=True)),
    "sampled": (IDS_B + IDS_A, dict(max_tokens=10, ignore_eos=True, temperature=0.9, top_k=40, seed=5)),
}


def fresh_prompt(k: int) -> list[int]:
    """A prompt no worker has seen (so a local prefill starts from an empty prefix cache)."""
    return [(97 * k + 13 * i) % 40000 + 200 for i in range(19)]


@pytest.fixture(scope="module")
def cluster(tiny_text_model):
    env = server_env()
    procs = {"prefill": ServeProcess(worker_args(tiny_text_model, "--role", "prefill", "--kv-format", "bf16",
                                                 "--handoff-ttl", str(TTL_S)), server_env(JAXSERVE_HANDOFF_FAULT=FAULTS))}
    for name in ("decode_b", "decode_c"):  # the decode default: an fp8_e4m3 pool
        procs[name] = ServeProcess(worker_args(tiny_text_model, "--role", "decode", "--pull-timeout", "3"), env)
    router = client = None
    try:
        addrs = {name: served_address(p.wait_for("SERVING on", 240)) for name, p in procs.items()}
        router = ServeProcess([sys.executable, "-m", "jaxserve.router.cli", "route", "--port", "0", "--metrics-port",
                               "0", "--health-interval", "0.2", "--unhealthy-after", "1", "--prefill",
                               addrs["prefill"], "--decode", addrs["decode_b"], "--decode", addrs["decode_c"]], env)
        line = router.wait_for("routing on", timeout=60)
        assert "3 up" in line, router.output
        client = Client(re.search(r"routing on (127\.0\.0\.1:\d+)", line).group(1), timeout=60)
        yield dict(procs=procs, addrs=addrs, router=router, client=client,
                   router_metrics=lambda: scrape(metrics_port(router.output)))
    finally:
        if client is not None:
            client.close()
        for p in [router, *procs.values()]:
            if p is not None:
                p.close()


@pytest.fixture(scope="module")
def fp8(tiny_text_model):
    """One fp8_e4m3 engine in this process, the decode workers' twin."""
    from jaxserve import LLM

    return LLM(tiny_text_model, kv_format="fp8_e4m3", **ENGINE_KW)


def info(addr: str):
    with Client(addr, timeout=30) as c:
        return c.model_info()


def deltas(events) -> list[int]:
    return [t for e in events if e.WhichOneof("event") == "delta" for t in e.delta.token_ids]


def local_tokens(fp8, ids, **kw) -> list[int]:
    """What a decode worker that prefills `ids` itself generates: the fp8 engine's own run."""
    return list(fp8.generate([ids], SamplingParams(**kw))[0])


@pytest.fixture(scope="module")
def handed_off(cluster, fp8):
    """name -> (the fp8 engine's tokens from the pages a handoff of that prompt carries now,
    the prefill worker's cached tokens for it). The prompt is prefilled once cold and once
    warm by hand: the warm offer's pages are what the router's (also warm) prefill offers."""
    addr, layout = cluster["addrs"]["prefill"], info(cluster["addrs"]["decode_b"]).kv_layout
    out = {}
    for name, (ids, kw) in PROMPTS.items():
        req = build_request(ids, **kw)
        assert release(addr, prefill(addr, req, layout), pulled=False)  # cold: its full pages enter the cache
        offer = prefill(addr, req, layout)
        assert offer.kv_layout == layout and offer.cached_tokens > 0
        params = SamplingParams(**{**kw, "seed": offer.sampling_seed})
        want = import_reference(fp8, offer, payload_of(fp8, offer, pull_bytes(addr, offer)), params, f"ref-{name}")
        assert release(addr, offer)
        out[name] = (want, offer.cached_tokens)
    return out


def test_tokens_through_the_router_are_an_fp8_engine_reading_the_converted_pages(cluster, handed_off):
    client = cluster["client"]
    for name, (ids, kw) in PROMPTS.items():
        want, cached = handed_off[name]
        r = client.generate(ids, **kw)
        assert list(r.token_ids) == want, name
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.cached_tokens) == (len(ids), 10, cached)
        events = list(client.generate_stream(ids, **kw))
        kinds = [e.WhichOneof("event") for e in events]
        assert kinds[0] == "start" and kinds[-1] == "end" and kinds.count("delta") >= 2, kinds  # streamed
        assert deltas(events) == want and events[0].start.cached_tokens == cached
        assert events[-1].end.usage.cached_tokens == cached and finish_reason(events[-1].end) == "length"
    m = cluster["router_metrics"]()
    assert metric(m, "jaxserve_router_handoffs_total", outcome="ok") == 2 * len(PROMPTS)
    assert metric(m, "jaxserve_router_handoff_bytes_total") > 0


def _replica(client: Client, prompt, **kw) -> str:
    _, call = client.stub.Generate.with_call(build_request(prompt, **kw), timeout=60)
    return dict(call.initial_metadata())["x-jaxserve-replica"]


def session_on(addr: str, addrs: list[str], prefix: str) -> str:
    """A session id whose rendezvous choice among `addrs` (the router's rule) is `addr`."""
    return next(s for s in (f"{prefix}-{i}" for i in range(1000)) if rendezvous_order(s, addrs)[0] == addr)


def test_a_session_keeps_its_decode_worker_and_info_is_one_endpoint(cluster, fp8):
    client, addrs = cluster["client"], cluster["addrs"]
    decode = [addrs["decode_b"], addrs["decode_c"]]
    for addr in decode:
        session = session_on(addr, decode, "keep")
        seen = {_replica(client, IDS_B + [i], max_tokens=2, session_id=session) for i in range(3)}
        assert seen == {info(addr).replica_id}, (addr, seen)
    got, p, d = client.model_info(), info(addrs["prefill"]), info(addrs["decode_b"])
    assert (got.role, got.kv_layout, got.prefill.kv_cache, got.decode.kv_cache) == ("both", "", "bf16", "fp8_e4m3")
    assert got.handoff_fingerprint == p.handoff_fingerprint == d.handoff_fingerprint != ""
    # What an offer cannot carry (log-probs, n > 1) is prefilled on the decode worker, not refused.
    ids = fresh_prompt(1)
    r = client.generate(ids, max_tokens=4, ignore_eos=True, logprobs=2)
    assert list(r.token_ids) == local_tokens(fp8, ids, max_tokens=4, ignore_eos=True)
    assert [lp.token_id for lp in r.logprobs] == list(r.token_ids) and all(len(lp.top) == 2 for lp in r.logprobs)
    r = client.generate(ids, max_tokens=4, ignore_eos=True, n=2, temperature=0.8, seed=3)
    assert len(r.choices) == 2 and all(len(c.token_ids) == 4 for c in r.choices)
    assert list(r.token_ids) == local_tokens(fp8, ids, max_tokens=4, ignore_eos=True, temperature=0.8, seed=3)


def test_a_corrupted_payload_is_retried_with_recompute(cluster, fp8):
    ids = fresh_prompt(2)
    r = cluster["client"].generate(ids, max_tokens=8, ignore_eos=True, request_id="rt-corrupt")
    assert list(r.token_ids) == local_tokens(fp8, ids, max_tokens=8, ignore_eos=True)
    m = cluster["router_metrics"]()
    assert metric(m, "jaxserve_router_handoff_failures_total", cause="pull_aborted") == 1
    assert metric(m, "jaxserve_router_handoffs_total", outcome="retried") == 1


def _open_offers(cluster) -> float:
    return metric(scrape(metrics_port(cluster["procs"]["prefill"].output)), "jaxserve_kv_handoff_open_offers")


def test_a_decode_worker_killed_behind_the_router(cluster, handed_off):
    client, procs, addrs = cluster["client"], cluster["procs"], cluster["addrs"]
    b, c = addrs["decode_b"], addrs["decode_c"]
    session = session_on(c, [b, c], "doomed")
    it = client.generate_stream(IDS_A, max_tokens=100, ignore_eos=True, session_id=session, timeout=30)
    assert [next(it).WhichOneof("event") for _ in range(2)] == ["start", "delta"]
    procs["decode_c"].proc.kill()
    t0 = time.monotonic()
    try:  # the stream may have finished before the kill; else an explicit UNAVAILABLE
        assert finish_reason(list(it)[-1].end) == "length"
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.UNAVAILABLE and c in e.details(), e.details()
    assert time.monotonic() - t0 < 10
    want, cached = handed_off["greedy"]
    ids, kw = PROMPTS["greedy"]
    with ThreadPoolExecutor(4) as pool:  # the dead worker's session and others: moved to B, same tokens
        results = list(pool.map(lambda i: client.generate(ids, session_id=session if i % 2 else f"s{i}", **kw),
                                range(6)))
    assert all(list(r.token_ids) == want for r in results)
    assert eventually(lambda: client.health(f"worker/{c}") == "NOT_SERVING", timeout=10)
    assert "is down" in cluster["router"].wait_for("is down", timeout=10)
    # Nothing left behind on the live workers: offers released (or expired and drained), pages freed.
    assert eventually(lambda: _open_offers(cluster) == 0, timeout=TTL_S + 3)
    for name in ("prefill", "decode_b"):
        assert eventually(lambda: info(addrs[name]).kv_pages.used == 0), name


def test_a_prefill_worker_killed_mid_pull_loses_nothing(cluster, fp8):
    client, procs, addrs = cluster["client"], cluster["procs"], cluster["addrs"]
    ids = fresh_prompt(3)
    r = client.generate(ids, max_tokens=8, ignore_eos=True, request_id="rt-die")
    assert list(r.token_ids) == local_tokens(fp8, ids, max_tokens=8, ignore_eos=True)  # recomputed on B
    assert procs["prefill"].wait(30) == 17  # the fault hook's exit, halfway through PullPages
    ids, kw = fresh_prompt(4), dict(max_tokens=8, ignore_eos=True, temperature=0.9, top_k=40, seed=9)
    r = client.generate(ids, **kw)  # no prefill worker: the decode worker prefills
    assert list(r.token_ids) == local_tokens(fp8, ids, **kw)
    m = cluster["router_metrics"]()
    assert metric(m, "jaxserve_router_handoffs_total", outcome="no_offer") >= 1
    assert eventually(lambda: info(addrs["decode_b"]).kv_pages.used == 0)
    assert client.health() == "SERVING"
