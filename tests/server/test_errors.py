"""The error catalogue: every bad input or failure gets its status code and a reason, and
the server keeps answering (exactly) afterwards."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from jaxserve.server.errors import RETRY_AFTER_KEY, STATUS_DETAILS_KEY, RetryInfo, RpcStatus, retry_after_s

from .conftest import IDS_A, MAX_WAITING

INVALID = grpc.StatusCode.INVALID_ARGUMENT
# name -> (prompt, keyword arguments, expected code, words the message must contain)
CATALOGUE = {
    "no prompt": (None, {}, INVALID, "empty prompt"),
    "empty id list": ([], {}, INVALID, "empty prompt"),
    "empty text": ("", {}, INVALID, "empty prompt"),
    "token id = vocab": ([5, 49152], {}, INVALID, "outside the vocabulary"),
    "token id huge": ([4_000_000_000], {}, INVALID, "outside the vocabulary"),
    "prompt + max_tokens > context": ([5] * 200, dict(max_tokens=57), INVALID, "maximum context of 256"),
    "max_tokens 0 (explicit zero)": ([5], dict(max_tokens=0), INVALID, "max_tokens"),
    "temperature < 0": ([5], dict(temperature=-0.5), INVALID, "temperature"),
    "temperature nan": ([5], dict(temperature=float("nan")), INVALID, "temperature"),
    "temperature 1e300 (inf as float32)": ([5], dict(temperature=1e300), INVALID, "temperature"),
    "top_p 0 (explicit zero)": ([5], dict(top_p=0.0), INVALID, "top_p"),
    "top_p > 1": ([5], dict(top_p=1.5), INVALID, "top_p"),
    "top_k < 0": ([5], dict(top_k=-1), INVALID, "top_k"),
    "min_p > 1": ([5], dict(min_p=2.0), INVALID, "min_p"),
    "repetition_penalty 0": ([5], dict(repetition_penalty=0.0), INVALID, "repetition_penalty"),
    "repetition_penalty 1e-300 (0 as float32)": ([5], dict(repetition_penalty=1e-300), INVALID, "repetition_penalty"),
    "top_p 1e-50 (0 as float32)": ([5], dict(top_p=1e-50), INVALID, "top_p"),
    "presence_penalty > 2": ([5], dict(presence_penalty=3.0), INVALID, "presence_penalty"),
    "frequency_penalty < -2": ([5], dict(frequency_penalty=-2.5), INVALID, "frequency_penalty"),
    "seed < 0": ([5], dict(seed=-1), INVALID, "seed"),
    "seed > int32": ([5], dict(seed=2**40), INVALID, "seed"),
    "empty stop string": ([5], dict(stop=[""]), INVALID, "stop"),
    "chat template on ids": ([5], dict(chat_template=True), INVALID, "text prompt"),
}


def _request(prompt, kw):
    from jaxserve.client import build_request

    if prompt is None:
        req = build_request("x", **kw)
        req.ClearField("text")
        return req
    return build_request(prompt, **kw)


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_bad_input_gets_its_code_and_the_server_still_answers(served, cases, name):
    prompt, kw, code, words = CATALOGUE[name]
    req = _request(prompt, kw)
    for rpc in (served.client.stub.Generate, lambda r: list(served.client.stub.GenerateStream(r))):
        with pytest.raises(grpc.RpcError) as e:
            rpc(req)
        assert e.value.code() == code, (name, e.value.details())
        assert words in e.value.details(), e.value.details()
    p, kw, want = cases["ids_greedy"]
    assert list(served.client.generate(p, **kw).token_ids) == list(want)


def test_detokenize_out_of_vocab_is_invalid(served):
    with pytest.raises(grpc.RpcError) as e:
        served.client.detokenize([1, 49152])
    assert e.value.code() == INVALID


def test_duplicate_running_request_id_is_already_exists(served):
    it = served.client.generate_stream([5, 6, 7], max_tokens=200, ignore_eos=True, request_id="dup")
    next(it)
    with pytest.raises(grpc.RpcError) as e:
        served.client.generate([5], max_tokens=2, request_id="dup")
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    it.cancel()


def test_full_queue_is_resource_exhausted_with_retry_info(served, cases):
    loop = served.server.engine_loop
    hold = threading.Event()
    blocked = loop.call(lambda eng: hold.wait(30))  # the engine thread admits nothing meanwhile
    p, kw, want = cases["ids_greedy"]
    with ThreadPoolExecutor(MAX_WAITING) as pool:
        futs = [pool.submit(served.client.generate, p, **kw) for _ in range(MAX_WAITING)]
        deadline = time.monotonic() + 10
        while loop.waiting < MAX_WAITING and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loop.waiting == MAX_WAITING
        assert served.metrics()[("jaxserve_queue_depth", ())] == MAX_WAITING
        with pytest.raises(grpc.RpcError) as e:
            served.client.generate([5], max_tokens=2)
        hold.set()
        blocked.result(10)
        results = [f.result(60) for f in futs]
    err = e.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in err.details()
    delay = retry_after_s(err)
    assert delay is not None and 0.05 <= delay <= 30
    trailers = dict(err.trailing_metadata())
    assert int(trailers[RETRY_AFTER_KEY]) == round(delay * 1000)
    status = RpcStatus.FromString(trailers[STATUS_DETAILS_KEY])  # the google.rpc.Status rich error
    assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert status.details[0].type_url == "type.googleapis.com/google.rpc.RetryInfo"
    info = RetryInfo.FromString(status.details[0].value)
    assert info.retry_delay.seconds * 1000 + info.retry_delay.nanos // 1_000_000 == round(delay * 1000)
    assert all(list(r.token_ids) == list(want) for r in results)  # the queued ones were served
    assert loop.waiting == 0


def test_integrity_failure_is_aborted_with_the_cause(served, cases):
    before = served.metrics()
    it = served.client.generate_stream(IDS_A, max_tokens=200, ignore_eos=True, request_id="tampered")
    assert next(it).WhichOneof("event") == "start"
    assert next(it).WhichOneof("event") == "delta"
    eid = served.server.service.active["tampered"].engine_id

    def tamper(eng):  # what a host bookkeeping bug would do: the page table no longer matches
        eng.seqs[eid].expected[0] += 2

    served.thread.call(tamper)
    with pytest.raises(grpc.RpcError) as e:
        for _ in it:
            pass
    assert e.value.code() == grpc.StatusCode.ABORTED
    assert "stale_generation" in e.value.details()
    assert dict(e.value.trailing_metadata())["x-jaxserve-integrity-cause"] == "stale_generation"
    after = served.metrics()
    key = ("jaxserve_integrity_mismatches_total", (("cause", "stale_generation"),))
    assert after[key] == before[key] + 1
    assert after[("jaxserve_requests_total", (("outcome", "aborted"), ("rpc", "GenerateStream")))] >= 1
    assert served.kv().used == 0
    p, kw, want = cases["sampled"]
    assert list(served.client.generate(p, **kw).token_ids) == list(want)


def test_unexpected_engine_exception_is_internal_and_serving_continues(served, cases):
    def break_next_step(eng):
        def boom():
            del eng.step  # one failure only: the class's step() is back
            raise RuntimeError("injected step failure")

        eng.step = boom

    served.thread.call(break_next_step)
    with pytest.raises(grpc.RpcError) as e:
        served.client.generate([5, 6, 7], max_tokens=4)
    assert e.value.code() == grpc.StatusCode.INTERNAL and "injected step failure" in e.value.details()
    assert served.kv().used == 0
    p, kw, want = cases["text_greedy"]
    r = served.client.generate(p, **kw)
    assert list(r.token_ids) == list(want) and r.text == want.text


def test_generate_before_warmup_is_unavailable(served):
    assert served.boot["generate"] == grpc.StatusCode.UNAVAILABLE

