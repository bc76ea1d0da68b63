"""Disaggregated serving as real processes on loopback: one prefill worker (bf16 pool) and
three decode workers (bf16 pool; fp8_e4m3 pool; bf16 pool over *other* weights), driven by
``generate_disaggregated`` (the router's flow).

References are computed in this process: the same-format handoff must give exactly the
tokens of a single bf16 engine; the bf16 -> fp8 handoff exactly the tokens of a single fp8
engine that reads the same converted pages (pulled here from the prefill worker), and those
converted pages are checked against a numpy conversion of the prefill worker's bf16 pages.
Faults (corrupted payload, expired offer, hung transfer pull, foreign weights, prefill worker
killed mid-pull) end every request with its tokens or an explicit status, and no worker keeps
a page. The kill comes last: it ends the prefill worker.
"""
from __future__ import annotations

import time

import grpc
import ml_dtypes
import numpy as np
import pytest

from jaxserve.client import Client
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.disagg.client import generate_disaggregated, worker_info
from jaxserve.disagg.handoff_request import KvImport
from jaxserve.router.app import RouterThread
from jaxserve.v1 import handoff_pb2 as hpb
from jaxserve.v1 import handoff_pb2_grpc as hpb_grpc
from jaxserve.v1 import jaxserve_pb2 as pb

from .conftest import IDS_A, IDS_B, metric, scrape
from .constrained import assemble, check_schema_answer, check_tool_answer, schema_request, tool_request, whole
from .disagg_setup import ENGINE_KW, import_reference, metrics_port, prefill, pull_bytes, release, \
    served_address, worker_args
from .serve_process import ServeProcess, server_env
from .tiny_model import build_tiny_text_model

TTL_S = 4.0
FAULTS = "corrupt_payload:req-corrupt,die_mid_pull:req-die"
PROMPTS = {  # name -> (ids, sampling keywords); IDS_A spans 3 pages of 8, IDS_B 2
    "greedy": (IDS_A, dict(max_tokens=10, ignore_eos=True)),
    "sampled": (IDS_B + IDS_A, dict(max_tokens=10, ignore_eos=True, temperature=0.9, top_k=40, seed=5)),
}


def request(name: str, rid: str = "") -> pb.GenerateRequest:
    ids, kw = PROMPTS[name]
    s = pb.SamplingParams(temperature=kw.get("temperature", 0.0))
    if "top_k" in kw:
        s.top_k = kw["top_k"]
    if "seed" in kw:
        s.seed = kw["seed"]
    return pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=ids), sampling=s,
                              stop=pb.StopCriteria(max_tokens=kw["max_tokens"], ignore_eos=True))


@pytest.fixture(scope="module")
def workers(tiny_text_model, tmp_path_factory):
    other = build_tiny_text_model(tmp_path_factory.mktemp("other_weights"), seed=4)
    env = server_env()
    specs = {
        "prefill": (tiny_text_model, ["--role", "prefill", "--kv-format", "bf16", "--handoff-ttl", str(TTL_S)],
                    server_env(JAXSERVE_HANDOFF_FAULT=FAULTS)),
        "decode_bf16": (tiny_text_model, ["--role", "decode", "--kv-format", "bf16", "--pull-timeout", "3"], env),
        "decode_fp8": (tiny_text_model, ["--role", "decode"], env),  # the decode default: fp8_e4m3
        # Other weights, the same programs: started once decode_bf16 has compiled them (cache hits).
        "decode_other": (other, ["--role", "decode", "--kv-format", "bf16"], env),
    }
    procs, addrs = {}, {}
    try:
        for name, (model, extra, e) in specs.items():
            if name == "decode_other":
                for n, p in procs.items():
                    addrs[n] = served_address(p.wait_for("SERVING on", 240))
            procs[name] = ServeProcess(worker_args(model, *extra), env=e)
        addrs["decode_other"] = served_address(procs["decode_other"].wait_for("SERVING on", 240))
        yield procs, addrs
    finally:
        for p in procs.values():
            p.close()


@pytest.fixture(scope="module")
def references(tiny_text_model):
    """Single-process engines: bf16 (the same-format reference) and fp8 (reads given pages)."""
    from jaxserve import LLM

    bf16 = LLM(tiny_text_model, kv_format="bf16", **ENGINE_KW)
    fp8 = LLM(tiny_text_model, kv_format="fp8_e4m3", **ENGINE_KW)
    want = {name: list(bf16.generate([ids], SamplingParams(**kw))[0]) for name, (ids, kw) in PROMPTS.items()}
    return bf16, fp8, want


def metrics(procs, name: str) -> dict:
    return scrape(metrics_port(procs[name].output))


def kv_used(addr: str) -> int:
    with grpc.insecure_channel(addr) as ch:
        return worker_info(ch).kv_pages.used


def test_roles_hold_one_phase_and_their_own_pool(workers):
    _, addrs = workers
    with grpc.insecure_channel(addrs["prefill"]) as ch:
        p = worker_info(ch)
    with grpc.insecure_channel(addrs["decode_fp8"]) as ch:
        d = worker_info(ch)
    assert (p.role, d.role) == ("prefill", "decode")
    assert p.memory.weight_bytes_decode == 0 and p.memory.weight_bytes_resident == p.memory.weight_bytes_prefill > 0
    # The decode worker's prefill (its fallback) reads the decode copy: one resident copy.
    assert d.memory.weight_bytes_resident == d.memory.weight_bytes_decode == d.memory.weight_bytes_prefill
    assert (p.decode.kv_cache, d.decode.kv_cache) == ("bf16", "fp8_e4m3")
    assert "format=bf16" in p.kv_layout and "format=fp8_e4m3" in d.kv_layout and "k_scale:float32" in d.kv_layout
    # fp8 pages hold twice the tokens of bf16 pages in about the same bytes per token x 0.5 (+ scales).
    assert d.memory.kv_bytes_per_token < p.memory.kv_bytes_per_token
    assert p.handoff_fingerprint == d.handoff_fingerprint != ""


@pytest.mark.parametrize("transport", ["grpc", "transfer"])
def test_same_format_handoff_gives_the_single_engine_tokens(workers, references, transport):
    _, addrs = workers
    _, _, want = references
    for name in PROMPTS:
        res = generate_disaggregated(addrs["prefill"], addrs["decode_bf16"], request(name), recompute_on_failure=False,
                                     transport=transport)
        assert res.offer is not None and res.offer.transport == transport
        assert res.token_ids == want[name], name
        assert res.usage.prompt_tokens == len(PROMPTS[name][0]) and res.usage.completion_tokens == 10
    m = metrics(workers[0], "decode_bf16")
    assert metric(m, "jaxserve_kv_handoff_pulls_total", transport=transport) >= 2
    assert metric(m, "jaxserve_kv_handoff_pull_bytes_total", transport=transport) > 0


def _decode(addr: str, req, offer, recompute: bool = False) -> list[int]:
    ids = []
    with grpc.insecure_channel(addr) as ch:
        dreq = hpb.DecodeRequest(request=req, offer=offer, recompute_on_failure=recompute)
        for ev in hpb_grpc.KvHandoffStub(ch).Decode(dreq, timeout=60):
            if ev.WhichOneof("event") == "delta":
                ids += ev.delta.token_ids
    return ids


def _numpy_fp8(bf16_bits: np.ndarray):
    """bf16 pages -> (fp8_e4m3 bits, f32 scales): per-vector absmax / 448, in numpy + ml_dtypes."""
    x = bf16_bits.view(ml_dtypes.bfloat16).astype(np.float32)
    scale = (np.abs(x).max(-1) / np.float32(448.0)).astype(np.float32)
    q = (x / np.where(scale > 0, scale, 1)[..., None]).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def test_bf16_to_fp8_handoff_reads_the_converted_pages(workers, references):
    from jaxserve.kv import handoff

    _, addrs = workers
    bf16, fp8, _ = references
    with grpc.insecure_channel(addrs["decode_fp8"]) as ch:
        fp8_layout = worker_info(ch).kv_layout
    h = fp8.engine.runner.handoff
    for name in PROMPTS:
        req = request(name)
        # The prefill worker's own bf16 pages (an unconverted export), the independent input.
        raw_offer = prefill(addrs["prefill"], req, bf16.engine.kv_layout())
        n = -(-raw_offer.num_tokens // ENGINE_KW["page_size"])
        raw = handoff.from_bytes(pull_bytes(addrs["prefill"], raw_offer), bf16.engine.runner.handoff.specs("bf16", n),
                                 bf16.engine.runner.handoff.leaf_axes(), n, "bf16")
        offer = prefill(addrs["prefill"], req, fp8_layout)
        assert offer.kv_layout == fp8_layout and offer.first_token_ids == raw_offer.first_token_ids
        data = pull_bytes(addrs["prefill"], offer)
        assert offer.payload_bytes == len(data) < raw_offer.payload_bytes  # fp8 + scales < bf16
        conv = handoff.from_bytes(data, h.specs("fp8_e4m3", n), h.leaf_axes(), n, "fp8_e4m3")
        for j in range(0, len(conv.leaves), 2):  # per layer: k, k_scale, v, v_scale
            q, scale = _numpy_fp8(raw.leaves[j // 2][:, :n])
            got_q = conv.leaves[j][:, :n].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
            np.testing.assert_allclose(conv.leaves[j + 1][:, :n], scale, rtol=2e-7)
            step = np.abs(q.astype(np.float32)) * 2.0**-3 + 2.0**-9  # one e4m3 step (3 mantissa bits)
            assert np.all(np.abs(got_q - q.astype(np.float32)) <= step), name
        # The single-process reference: an fp8 engine that imports exactly these bytes.
        params = SamplingParams(**{**PROMPTS[name][1], "seed": offer.sampling_seed})
        want = import_reference(fp8, offer, conv, params, f"ref-{name}")
        assert _decode(addrs["decode_fp8"], req, offer) == want, name
        # Pages that hold other ids than the receiver's own rendering of the prompt: refused.
        other = list(offer.prompt_token_ids[:-1]) + [offer.prompt_token_ids[-1] + 1]
        with pytest.raises(ValueError, match="another prompt"):
            fp8.engine.add_request(other, params, f"ref-other-{name}", kv_import=KvImport(
                conv, offer.digest, offer.first_token_ids[0], token_ids=list(offer.prompt_token_ids)))
        assert release(addrs["prefill"], raw_offer)  # the raw offer nobody decodes


def test_corrupted_payload_is_aborted_or_recomputed(workers, references):
    _, addrs = workers
    _, _, want = references
    req = request("greedy", "req-corrupt")
    with pytest.raises(grpc.RpcError) as e:
        generate_disaggregated(addrs["prefill"], addrs["decode_bf16"], req, recompute_on_failure=False)
    assert e.value.code() == grpc.StatusCode.ABORTED and "digest_mismatch" in e.value.details()
    res = generate_disaggregated(addrs["prefill"], addrs["decode_bf16"], req)  # recomputed on the decode worker
    assert res.offer is not None and res.token_ids == want["greedy"]


def test_foreign_weights_are_refused_before_any_pull(workers):
    _, addrs = workers
    with pytest.raises(grpc.RpcError) as e:
        generate_disaggregated(addrs["prefill"], addrs["decode_other"], request("greedy"))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "fingerprint" in e.value.details()


def test_expired_offer_is_aborted_or_recomputed_and_drained(workers, references):
    _, addrs = workers
    _, _, want = references
    offers = []

    def wait_out(offer):
        offers.append(offer)
        time.sleep(max(0.0, offer.expires_unix_s - time.time()) + 0.3)

    with pytest.raises(grpc.RpcError) as e:
        generate_disaggregated(addrs["prefill"], addrs["decode_bf16"], request("greedy"), recompute_on_failure=False,
                               before_decode=wait_out, transport="transfer")
    assert e.value.code() == grpc.StatusCode.ABORTED and "expired" in e.value.details()
    res = generate_disaggregated(addrs["prefill"], addrs["decode_bf16"], request("greedy"), before_decode=wait_out)
    assert res.token_ids == want["greedy"]
    time.sleep(0.6)  # the prefill worker's expiry sweep
    with grpc.insecure_channel(addrs["prefill"]) as ch:
        for offer in offers:  # both were drained by the prefill worker: nothing left to release
            assert not hpb_grpc.KvHandoffStub(ch).Release(hpb.ReleaseRequest(transfer_id=offer.transfer_id)).released
    procs = workers[0]
    assert metric(metrics(procs, "prefill"), "jaxserve_kv_handoff_expired_total") >= 2
    assert metric(metrics(procs, "decode_bf16"), "jaxserve_kv_handoff_failures_total", cause="expired") == 2


def test_hung_transfer_pull_is_abandoned_by_its_watchdog(workers):
    _, addrs = workers
    req = request("greedy")
    with grpc.insecure_channel(addrs["decode_bf16"]) as ch:
        layout = worker_info(ch).kv_layout
    with grpc.insecure_channel(addrs["prefill"]) as ch:
        offer = hpb_grpc.KvHandoffStub(ch).Prefill(hpb.PrefillRequest(request=req, target_kv_layout=layout,
                                                                      transport="transfer"), timeout=60)
    bogus = hpb.HandoffOffer()
    bogus.CopyFrom(offer)
    bogus.transfer_id = "00000000deadbeef"  # offered by nobody: the transfer library's pull would hang
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        _decode(addrs["decode_bf16"], req, bogus)
    assert e.value.code() == grpc.StatusCode.ABORTED and "timeout" in e.value.details()
    assert time.monotonic() - t0 < 10  # --pull-timeout 3
    assert metric(metrics(workers[0], "decode_bf16"), "jaxserve_kv_handoff_failures_total", cause="timeout") == 1
    with grpc.insecure_channel(addrs["prefill"]) as ch:  # the real offer, unpulled: released and drained
        assert hpb_grpc.KvHandoffStub(ch).Release(hpb.ReleaseRequest(transfer_id=offer.transfer_id, pulled=False),
                                                  timeout=30).released


def test_log_probs_are_refused_with_a_handoff(workers):
    """An offer carries the first token, not its log-prob: neither side takes log-probs with it."""
    _, addrs = workers
    with grpc.insecure_channel(addrs["decode_bf16"]) as ch:
        layout = worker_info(ch).kv_layout
    req = request("greedy")
    offer = prefill(addrs["prefill"], req, layout)
    req.sampling.logprobs = 2
    for call in (lambda: prefill(addrs["prefill"], req, layout), lambda: _decode(addrs["decode_bf16"], req, offer)):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "log-probs" in e.value.details()


@pytest.mark.parametrize("kind", ["schema", "tool"])
def test_constrained_requests_hand_off_as_they_run_colocated(workers, kind):
    """A JSON-schema request and a required tool call through the router over the prefill worker
    and the bf16 decode worker: the prefill worker's first token is sampled under the grammar,
    the decode worker starts its own grammar state with it. Greedy and sampled, unary and
    streamed, they equal the decode worker's own (colocated) answers, which validate."""
    procs, addrs = workers
    build, check = {"schema": (schema_request, check_schema_answer), "tool": (tool_request, check_tool_answer)}[kind]
    offers = lambda: metric(metrics(procs, "prefill"), "jaxserve_kv_handoff_offers_total")  # noqa: E731
    before = offers()
    with RouterThread([(addrs["prefill"], "prefill"), (addrs["decode_bf16"], "decode")], health_interval_s=0.1,
                      health_timeout_s=2.0) as rt, Client(rt.target, timeout=60) as via, \
            Client(addrs["decode_bf16"], timeout=60) as direct:
        for sampled in (False, True):
            req = build(f"rq-{kind}-{sampled:d}", sampled)
            want = direct.stub.Generate(req, timeout=60)
            check(want)
            assert whole(via.stub.Generate(req, timeout=60)) == whole(want), sampled
            assert assemble(via.stub.GenerateStream(req, timeout=60)) == whole(want), sampled
    assert offers() == before + 4  # every routed request was handed off


def test_no_pages_left_then_prefill_worker_killed_mid_pull(workers, references):
    procs, addrs = workers
    _, _, want = references
    for name in ("decode_bf16", "decode_fp8", "decode_other", "prefill"):
        assert kv_used(addrs[name]) == 0, name
    res = generate_disaggregated(addrs["prefill"], addrs["decode_bf16"], request("greedy", "req-die"))
    assert res.offer is not None and res.token_ids == want["greedy"]  # recomputed after the pull broke
    assert procs["prefill"].wait(30) == 17  # the fault hook's exit, halfway through PullPages
    # The prefill worker is gone: the next request is prefilled on the decode worker, nothing lost.
    res = generate_disaggregated(addrs["prefill"], addrs["decode_bf16"], request("sampled"), timeout=20)
    assert res.offer is None and res.prefill_error == grpc.StatusCode.UNAVAILABLE
    assert res.token_ids == want["sampled"]
    assert kv_used(addrs["decode_bf16"]) == 0
