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

Every hop is secured with real certificates (tests/server/certs.py): each worker serves mTLS
(client certificates required) with the API key ``worker-key``; the router serves TLS with its
own key ``router-key`` and calls the workers with a client certificate and ``worker-key``;
decode worker B pulls from the prefill worker with its own ``--worker-api-key``, C with the key
its Decode call came with. The prefill worker advertises ``localhost`` (in its certificate), so
every pull also goes to the advertised address, not the bound one.
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
from jaxserve.server.auth import PeerCredentials

from .certs import make_certs
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


WORKER_KEY, ROUTER_KEY = "worker-key", "router-key"
PEER: PeerCredentials | None = None  # the workers' client credentials (set by the cluster fixture)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


def worker_tls(certs) -> list[str]:
    return ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key), "--tls-client-ca",
            str(certs.ca), "--api-key", WORKER_KEY]


def client_tls(certs) -> list[str]:
    return ["--worker-ca", str(certs.ca), "--worker-cert", str(certs.client_cert), "--worker-key",
            str(certs.client_key)]


@pytest.fixture(scope="module")
def cluster(tiny_text_model, certs):
    global PEER
    PEER = PeerCredentials(certs.ca.read_bytes(), certs.client_cert.read_bytes(), certs.client_key.read_bytes(),
                           WORKER_KEY)
    env = server_env()
    procs = {"prefill": ServeProcess(worker_args(tiny_text_model, "--role", "prefill", "--kv-format", "bf16",
                                                 "--handoff-ttl", str(TTL_S), "--advertise-host", "localhost",
                                                 *worker_tls(certs)), server_env(JAXSERVE_HANDOFF_FAULT=FAULTS))}
    for name, key in (("decode_b", ["--worker-api-key", WORKER_KEY]), ("decode_c", [])):  # pool: fp8_e4m3
        procs[name] = ServeProcess(worker_args(tiny_text_model, "--role", "decode", "--pull-timeout", "3",
                                               *worker_tls(certs), *client_tls(certs), *key), env)
    router = client = None
    try:
        addrs = {name: served_address(p.wait_for("SERVING on", 240)) for name, p in procs.items()}
        router = ServeProcess([sys.executable, "-m", "jaxserve.router.cli", "route", "--port", "0", "--metrics-port",
                               "0", "--health-interval", "0.2", "--unhealthy-after", "1", "--prefill",
                               addrs["prefill"], "--decode", addrs["decode_b"], "--decode", addrs["decode_c"],
                               "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
                               "--api-key", ROUTER_KEY, *client_tls(certs), "--worker-api-key", WORKER_KEY], env)
        line = router.wait_for("routing on", timeout=60)
        assert "3 up" in line, router.output
        target = re.search(r"routing on (127\.0\.0\.1:\d+)", line).group(1)
        client = Client(target, timeout=60, api_key=ROUTER_KEY, root_certificates=certs.ca.read_bytes())
        yield dict(procs=procs, addrs=addrs, router=router, client=client, target=target,
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
    with Client(addr, timeout=30, api_key=WORKER_KEY, root_certificates=PEER.ca, private_key=PEER.key,
                certificate_chain=PEER.cert) as c:
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
        # cold: its full pages enter the cache
        assert release(addr, prefill(addr, req, layout, creds=PEER), pulled=False, creds=PEER)
        offer = prefill(addr, req, layout, creds=PEER)
        assert offer.kv_layout == layout and offer.cached_tokens > 0
        params = SamplingParams(**{**kw, "seed": offer.sampling_seed})
        data = pull_bytes(addr, offer, creds=PEER)
        assert release(addr, offer, creds=PEER)  # before the reference runs: the offer lives TTL_S only
        want = import_reference(fp8, offer, payload_of(fp8, offer, data), params, f"ref-{name}")
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


def _code(fn) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_every_service_needs_the_key_but_health_and_reflection(cluster, certs):
    """KvHandoff (Prefill, PullPages, Release, Decode) and JaxServe on every worker, and the
    router's endpoint: UNAUTHENTICATED without the key or with another one, even over mTLS
    with a good client certificate; health and reflection answer without one."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from jaxserve.v1 import handoff_pb2 as hpb
    from jaxserve.v1 import handoff_pb2_grpc as hpb_grpc
    from jaxserve.v1 import jaxserve_pb2 as pb
    from jaxserve.v1 import jaxserve_pb2_grpc as pb_grpc

    addrs, unauth = cluster["addrs"], grpc.StatusCode.UNAUTHENTICATED
    paddr = addrs["prefill"]
    ids, kw = PROMPTS["greedy"]
    req = build_request(ids, **kw)
    layout = info(addrs["decode_b"]).kv_layout
    offer = prefill(paddr, req, layout, creds=PEER)  # a live offer: another tenant's KV
    assert offer.address == f"localhost:{paddr.rsplit(':', 1)[1]}"  # the advertised host, not the bound one
    nokey = PeerCredentials(PEER.ca, PEER.cert, PEER.key)
    mds = (None, (("authorization", f"Bearer {ROUTER_KEY}"),), (("x-api-key", "nope"),))
    with nokey.channel(paddr) as ch:  # quickly: the offer lives TTL_S
        h = hpb_grpc.KvHandoffStub(ch)
        for md in mds:
            assert _code(lambda: h.Prefill(hpb.PrefillRequest(request=req, target_kv_layout=layout), timeout=30,
                                           metadata=md)) == unauth
            assert _code(lambda: list(h.PullPages(hpb.PullPagesRequest(transfer_id=offer.transfer_id), timeout=30,
                                                  metadata=md))) == unauth
            assert _code(lambda: h.Release(hpb.ReleaseRequest(transfer_id=offer.transfer_id), timeout=30,
                                           metadata=md)) == unauth
    assert release(paddr, offer, pulled=False, creds=PEER)  # still there: nothing above touched it
    for md in mds:
        for name in ("decode_b", "decode_c"):
            with nokey.channel(addrs[name]) as ch:
                h = hpb_grpc.KvHandoffStub(ch)
                for dreq in (hpb.DecodeRequest(request=req), hpb.DecodeRequest(request=req, offer=offer)):
                    assert _code(lambda: list(h.Decode(dreq, timeout=30, metadata=md))) == unauth, name
                assert _code(lambda: pb_grpc.JaxServeStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=30,
                                                                            metadata=md)) == unauth
    for addr in (paddr, addrs["decode_b"]):
        with nokey.channel(addr) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            answers = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
            names = {s.name for a in answers for s in a.list_services_response.service}
            assert "jaxserve.v1.KvHandoff" in names, names
    # The router's endpoint: its own key (not the workers'), over TLS only.
    ca = certs.ca.read_bytes()
    for key in (None, WORKER_KEY):
        with Client(cluster["target"], timeout=30, api_key=key, root_certificates=ca) as c:
            assert c.health() == "SERVING"
            assert _code(lambda: c.generate(ids, **kw)) == unauth
            assert _code(c.model_info) == unauth
    with Client(cluster["target"], timeout=5, api_key=ROUTER_KEY) as plain:
        assert _code(plain.health) == grpc.StatusCode.UNAVAILABLE


def test_decode_workers_pull_over_mtls_with_their_key_or_the_callers(cluster, handed_off):
    """Prefill worker -> decode worker over mTLS with the key, both transports: B sends its
    --worker-api-key, C the key its Decode call came with; no recompute allowed, so a pull that
    failed would be an error, and the tokens are those of the pages handed off."""
    from jaxserve.disagg.client import generate_disaggregated

    addrs = cluster["addrs"]
    ids, kw = PROMPTS["greedy"]
    want, _ = handed_off["greedy"]
    pulls = {}
    for name, transport in (("decode_b", "grpc"), ("decode_c", "grpc"), ("decode_b", "transfer")):
        r = generate_disaggregated(addrs["prefill"], addrs[name], build_request(ids, **kw), recompute_on_failure=False,
                                   transport=transport, credentials=PEER)
        assert r.offer is not None and r.offer.transport == transport, (name, transport)
        assert r.token_ids == want, (name, transport)
        pulls[name, transport] = metric(scrape(metrics_port(cluster["procs"][name].output)),
                                        "jaxserve_kv_handoff_pulls_total", transport=transport)
    assert all(n >= 1 for n in pulls.values()), pulls
    assert eventually(lambda: _open_offers(cluster) == 0, timeout=10)  # every offer released over mTLS


def test_a_wrong_ca_or_plaintext_fails_closed_with_the_reason(cluster, tmp_path, caplog):
    """Credentials from another CA (or none) reach nothing: the worker-to-worker pull fails
    with grpc's TLS reason (the offer stays), generate_disaggregated gets UNAVAILABLE, and a
    router never takes the workers up and says why."""
    import asyncio
    import logging

    from jaxserve.router.app import RouterThread
    from jaxserve.disagg.client import generate_disaggregated
    from jaxserve.disagg.transport import GrpcTransport, PullError

    addrs, paddr = cluster["addrs"], cluster["addrs"]["prefill"]
    other = make_certs(tmp_path)
    wrong = PeerCredentials(other.ca.read_bytes(), other.client_cert.read_bytes(), other.client_key.read_bytes(),
                            WORKER_KEY)
    ids, kw = PROMPTS["greedy"]
    offer = prefill(paddr, build_request(ids, **kw), info(addrs["decode_b"]).kv_layout, creds=PEER)

    async def pull(creds):
        ch = creds.aio_channel(offer.address)
        try:
            await GrpcTransport(lambda a: ch).pull(offer, [], [], 0, "", 10.0, creds.metadata)
        finally:
            await ch.close()

    bad = (wrong, PeerCredentials(api_key=WORKER_KEY))  # another CA; plaintext
    for creds in bad:
        with pytest.raises(PullError) as e:
            asyncio.run(pull(creds))
        assert e.value.cause == "peer_unavailable" and "UNAVAILABLE" in str(e.value), e.value
    assert release(paddr, offer, pulled=False, creds=PEER)  # the failed pulls left it in place
    for creds in bad:
        with pytest.raises(grpc.RpcError) as e:
            generate_disaggregated(paddr, addrs["decode_b"], build_request(ids, **kw), credentials=creds, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    workers = [(paddr, "prefill"), (addrs["decode_b"], "decode")]
    with caplog.at_level(logging.WARNING, logger="jaxserve.router"):
        with RouterThread(workers, peer=wrong, metrics_port=None, health_interval_s=0.2) as rt:
            with Client(rt.target, timeout=10) as c:
                assert c.health() == "NOT_SERVING"
                assert _code(lambda: c.generate(ids, **kw)) == grpc.StatusCode.UNAVAILABLE
    failed = [r.getMessage() for r in caplog.records if "health check of worker" in r.getMessage()]
    for addr, _ in workers:  # each worker's check failed, and the log says it was the TLS handshake
        mine = [m for m in failed if addr in m]
        assert mine and any(w in m.lower() for m in mine for w in ("ssl", "handshake", "certificate")), failed


def _replica(client: Client, prompt, **kw) -> str:
    _, call = client.stub.Generate.with_call(build_request(prompt, **kw), timeout=60, metadata=client.call_metadata())
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
