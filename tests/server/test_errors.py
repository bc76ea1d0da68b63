"""The error catalogue: every bad input or failure gets its status code and a reason, and
the server keeps answering (exactly) afterwards. On the mock engine's server (no model); the
integrity failure, which needs the checked programs, is test_generate's."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from jaxserve.server.errors import RETRY_AFTER_KEY, STATUS_DETAILS_KEY, RetryInfo, RpcStatus, retry_after_s

from .conftest import MAX_WAITING, on_the_mock_server


served, cases = on_the_mock_server()

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


def test_unexpected_engine_exception_is_internal_and_serving_continues(served, cases):
    served.thread.call(lambda eng: eng.fail_next_step(RuntimeError("injected step failure")))
    with pytest.raises(grpc.RpcError) as e:
        served.client.generate([5, 6, 7], max_tokens=4)
    assert e.value.code() == grpc.StatusCode.INTERNAL and "injected step failure" in e.value.details()
    assert served.kv().used == 0
    p, kw, want = cases["text_greedy"]
    r = served.client.generate(p, **kw)
    assert list(r.token_ids) == list(want) and r.text == want.text


def test_generate_before_warmup_is_unavailable(served):
    assert served.boot["generate"] == grpc.StatusCode.UNAVAILABLE



# name -> (build_request keywords, x-session-affinity header, words the message must contain)
BAD_IDS = {
    "non-ASCII request id": (dict(request_id="caf\u00e9"), None, "request_id contains '\u00e9'"),
    "control character in session id": (dict(session_id="a\nb"), None, "session_id contains '\\n'"),
    "space in request id": (dict(request_id="a b"), None, "request_id contains ' '"),
    "request id over the limit": (dict(request_id="r" * 257), None, "257 characters long; the limit is 256"),
    "20 KiB session id": (dict(session_id="s" * 20480), None, "the limit is 256"),
    "session header over the limit": ({}, "h" * 257, "x-session-affinity is 257 characters long"),
    "space in session header": ({}, "a b", "x-session-affinity contains ' '"),
}


@pytest.mark.parametrize("name", list(BAD_IDS))
def test_bad_ids_are_invalid_before_anything_runs(served, name):
    from jaxserve.client import build_request

    kw, header, words = BAD_IDS[name]
    req = build_request([5, 6, 7], max_tokens=2, **kw)
    md = (("x-session-affinity", header),) if header else None
    before = served.metrics()
    for rpc in (served.client.stub.Generate, lambda r, **k: list(served.client.stub.GenerateStream(r, **k))):
        with pytest.raises(grpc.RpcError) as e:
            rpc(req, metadata=md)
        assert e.value.code() == INVALID, (name, e.value.code(), e.value.details())
        assert words in e.value.details(), e.value.details()
    after = served.metrics()
    assert after[("jaxserve_prompt_tokens_total", ())] == before[("jaxserve_prompt_tokens_total", ())]  # never ran


def test_ids_at_the_limit_run_and_are_echoed_in_headers(served, cases):
    from jaxserve.client import build_request

    p, kw, want = cases["ids_greedy"]
    rid, session = "~" + "r" * 254 + "!", "s" * 256
    r, call = served.client.stub.Generate.with_call(build_request(p, request_id=rid, session_id=session, **kw))
    assert list(r.token_ids) == list(want) and r.request_id == rid and r.session_id == session
    headers = dict(call.initial_metadata())
    assert headers["x-request-id"] == rid and headers["x-session-affinity"] == session


def test_id_options_that_cannot_be_echoed_are_refused():
    from jaxserve.server.convert import check_id_options

    check_id_options(4096, "replica-1:50051")
    for max_id_length, replica in ((0, None), (4097, None), (256, "replica one"), (256, "r\u00e9plica")):
        with pytest.raises(ValueError):
            check_id_options(max_id_length, replica)


@pytest.mark.parametrize("path,kind,message", [
    ("/jaxserve.v1.JaxServe/Generate", "unary", "jaxserve.v1.GenerateRequest"),
    ("/jaxserve.v1.JaxServe/GenerateStream", "stream", "jaxserve.v1.GenerateRequest"),
    ("/jaxserve.v1.JaxServe/Tokenize", "unary", "jaxserve.v1.TokenizeRequest"),
    ("/jaxserve.v1.JaxServe/Detokenize", "unary", "jaxserve.v1.DetokenizeRequest"),
    ("/jaxserve.v1.JaxServe/GetModelInfo", "unary", "jaxserve.v1.GetModelInfoRequest"),
    ("/jaxserve.v1.JaxServe/Abort", "unary", "jaxserve.v1.AbortRequest"),
    ("/grpc.health.v1.Health/Check", "unary", "grpc.health.v1.HealthCheckRequest"),
    ("/grpc.health.v1.Health/Watch", "stream", "grpc.health.v1.HealthCheckRequest"),
    ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", "bidi", "ServerReflectionRequest")])
def test_bytes_that_are_not_a_message_are_invalid_argument(served, caplog, path, kind, message):
    channel = served.client.channel
    with pytest.raises(grpc.RpcError) as e:
        if kind == "stream":
            list(channel.unary_stream(path)(b"\x0a\xff", timeout=10))
        elif kind == "bidi":
            list(channel.stream_stream(path)(iter([b"\x0a\xff"]), timeout=10))
        else:
            channel.unary_unary(path)(b"\x0a\xff", timeout=10)
    details = e.value.details()
    assert e.value.code() == INVALID and f"malformed request to {path}" in details and message in details
    assert not [r for r in caplog.records if r.levelno >= 40]  # no traceback logged


def test_a_client_with_retries_waits_the_servers_pushback():
    """gRPC's own retry policy (Client(retries=N)) retries RESOURCE_EXHAUSTED after the server's
    grpc-retry-pushback-ms; without retries the error reaches the caller with its hint."""
    from concurrent import futures

    from jaxserve.client import Client
    from jaxserve.server import errors
    from jaxserve.v1 import jaxserve_pb2 as pb

    calls = []

    def model_info(request, context):
        calls.append(time.monotonic())
        if len(calls) % 2:  # every other call: the queue is full, come back in 0.4 s
            e = errors.queue_full(3, 3, 0.4)
            context.abort_with_status(_status(e))
        return pb.ModelInfo(model="fake")

    def _status(e):
        class S(grpc.Status):
            code, details, trailing_metadata = e.code, e.message, e.trailing_metadata()
        return S()

    handler = grpc.method_handlers_generic_handler("jaxserve.v1.JaxServe", {"GetModelInfo": grpc.unary_unary_rpc_method_handler(
        model_info, request_deserializer=pb.GetModelInfoRequest.FromString, response_serializer=pb.ModelInfo.SerializeToString)})
    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with Client(f"127.0.0.1:{port}", timeout=10, retries=2) as c:
            assert c.model_info().model == "fake"
        assert len(calls) == 2 and calls[1] - calls[0] >= 0.35  # the pushback was obeyed
        with Client(f"127.0.0.1:{port}", timeout=10) as c, pytest.raises(grpc.RpcError) as e:
            c.model_info()
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and retry_after_s(e.value) == 0.4
    finally:
        server.stop(0)
