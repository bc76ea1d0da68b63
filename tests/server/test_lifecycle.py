"""Cancellation, deadlines and Abort free every page at once; health follows warm-up;
reflection lists the service; the metrics endpoint moves; what lives at SERVING is frozen out
of the garbage collector's walk."""
import gc
import threading
import time

import grpc
import pytest

from jaxserve.client import finish_reason

from .conftest import IDS_A, eventually, metric, on_the_mock_server


served, cases = on_the_mock_server()


def wait_pages_back(served, timeout=3.0):
    """Every usable page free (free or evictable) and none owned, within `timeout`."""
    end = time.monotonic() + timeout
    while True:
        kv = served.kv()
        if (kv.used == 0 and kv.free == kv.total) or time.monotonic() > end:
            return kv
        time.sleep(0.01)


def test_cancel_mid_stream_returns_every_page(served):
    before = served.metrics()
    streams = [served.client.generate_stream(IDS_A[: 5 + 3 * i], max_tokens=200, ignore_eos=True) for i in range(4)]
    for it in streams:
        assert next(it).WhichOneof("event") == "start"
        for _ in range(3):
            assert next(it).WhichOneof("event") == "delta"
    assert served.kv().used > 0  # all four hold pages mid-generation
    t0 = time.monotonic()
    for it in streams:
        it.cancel()
    kv = wait_pages_back(served)
    assert kv.used == 0 and kv.free == kv.total == 63, kv
    assert time.monotonic() - t0 < 3.0
    key = dict(rpc="GenerateStream", outcome="cancelled")
    want = metric(before, "jaxserve_requests_total", **key) + 4
    assert eventually(lambda: metric(served.metrics(), "jaxserve_requests_total", **key) == want)


def test_expired_deadline_aborts_and_frees_pages(served):
    # The engine thread is held after a few tokens, so the deadline surely expires mid-stream
    # while the request owns pages; the abort then runs on the engine thread's next turn.
    it = served.client.generate_stream([5, 6, 7], max_tokens=240, ignore_eos=True, timeout=1.0)
    assert next(it).WhichOneof("event") == "start"
    next(it)
    hold = threading.Event()
    served.server.engine_loop.call(lambda eng: hold.wait(30))
    with pytest.raises(grpc.RpcError) as e:
        for _ in it:
            pass
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert served.kv().used > 0  # the engine has not run since: the pages are still held
    hold.set()
    kv = wait_pages_back(served)
    assert kv.used == 0 and kv.free == kv.total
    key = dict(rpc="GenerateStream", outcome="deadline_exceeded")
    assert eventually(lambda: metric(served.metrics(), "jaxserve_requests_total", **key) >= 1)


def test_expired_deadline_while_queued_leaves_nothing_behind(served):
    hold = threading.Event()
    served.server.engine_loop.call(lambda eng: hold.wait(30))
    with pytest.raises(grpc.RpcError) as e:
        served.client.generate([5, 6, 7], max_tokens=20, timeout=0.3)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    hold.set()
    assert wait_pages_back(served).used == 0
    assert eventually(lambda: served.server.engine_loop.waiting == 0)
    key = dict(rpc="Generate", outcome="deadline_exceeded")
    assert eventually(lambda: metric(served.metrics(), "jaxserve_requests_total", **key) >= 1)


def test_abort_rpc_ends_the_stream_with_finish_reason_abort(served):
    it = served.client.generate_stream([5, 6, 7], max_tokens=200, ignore_eos=True, request_id="to-abort")
    assert next(it).WhichOneof("event") == "start"
    next(it)
    r = served.client.abort("to-abort", "never-existed")
    assert list(r.aborted) == ["to-abort"] and list(r.not_found) == ["never-existed"]
    events = list(it)  # the stream ends normally (status OK) with an abort end event
    end = events[-1].end
    assert finish_reason(end) == "abort" and end.usage.completion_tokens < 200
    assert wait_pages_back(served).used == 0


def test_health_is_serving_only_after_warmup(served):
    assert served.boot["health"] == "NOT_SERVING"
    assert served.boot["service_health"] == "NOT_SERVING"
    assert served.boot["info_while_warming"] == "MockForCausalLM"
    assert served.boot["health_after"] == "SERVING"
    assert served.client.health("jaxserve.v1.JaxServe") == "SERVING"


def test_what_lives_at_serving_is_out_of_the_collectors_walk(served):
    # A full collection walks every tracked object; what the server made before SERVING is
    # frozen (a full collection's pause under load was the well-behaved client's p99).
    loop = served.server.engine_loop
    assert gc.is_tracked(loop) and gc.get_freeze_count() > 0
    assert not any(o is loop for g in range(3) for o in gc.get_objects(generation=g))


def test_reflection_lists_and_describes_the_service(served):
    from google.protobuf.descriptor_pool import DescriptorPool
    from google.protobuf.message_factory import GetMessageClass
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(served.target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"jaxserve.v1.JaxServe", "grpc.health.v1.Health"} <= services
        pool = DescriptorPool(db)
        svc = pool.FindServiceByName("jaxserve.v1.JaxServe")
        assert {m.name for m in svc.methods} == {
            "Generate", "GenerateStream", "Tokenize", "Detokenize", "GetModelInfo", "Abort"}
        # A generic client needs nothing but reflection to call a method:
        method = svc.methods_by_name["GetModelInfo"]
        req_cls, resp_cls = GetMessageClass(method.input_type), GetMessageClass(method.output_type)
        call = channel.unary_unary("/jaxserve.v1.JaxServe/GetModelInfo",
                                   request_serializer=req_cls.SerializeToString,
                                   response_deserializer=resp_cls.FromString)
        assert call(req_cls(), timeout=10).architecture == "MockForCausalLM"


def test_metrics_endpoint_shows_counters_moving(served, cases):
    before = served.metrics()
    prompt = IDS_A + [21, 22, 23, 24, 25]
    served.client.generate(prompt, max_tokens=6, ignore_eos=True)
    served.client.generate(prompt, max_tokens=6, ignore_eos=True, session_id="metrics-session")  # cache hit
    after = served.metrics()

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("jaxserve_requests_total", rpc="Generate", outcome="length") == 2
    assert delta("jaxserve_prompt_tokens_total") == 2 * len(prompt)
    assert delta("jaxserve_completion_tokens_total") == 12
    assert delta("jaxserve_cached_tokens_total") >= 16
    assert delta("jaxserve_time_to_first_token_seconds_count") == 2
    assert delta("jaxserve_inter_token_latency_seconds_count") == 10
    assert delta("jaxserve_request_duration_seconds_count") == 2
    assert delta("jaxserve_session_requests_total") == 1
    # (the integrity counters move with a real model's checked programs: test_errors' integrity test)
    for cause in ("stale_generation", "out_of_range_page", "page_not_owned"):
        assert ("jaxserve_integrity_mismatches_total", (("cause", cause),)) in after
    assert metric(after, "jaxserve_queue_depth") == 0
    assert metric(after, "jaxserve_kv_pages_total") == 63
    assert metric(after, "jaxserve_kv_pages_used") + metric(after, "jaxserve_kv_pages_free") == 63
    assert metric(after, "jaxserve_serving") == 1
    assert metric(after, "jaxserve_compiles_after_warmup") == 0  # warm-up covered every bucket
    info = served.client.model_info()
    assert metric(after, "jaxserve_model_info", architecture="MockForCausalLM", model=info.model,
                  fingerprint=info.fingerprint, prefill_weights="float32", decode_weights="float32",
                  prefill_kv="float32", decode_kv="float32", replica_id="test-replica") == 1


THAW_SCRIPT = """
import gc
from jaxserve.server.app import ServerThread
from jaxserve.testing import MockLLM

def frozen(obj):
    return gc.is_tracked(obj) and not any(o is obj for g in range(3) for o in gc.get_objects(generation=g))

a, b = ServerThread(MockLLM()).start(), ServerThread(MockLLM()).start()
a.wait_ready(), b.wait_ready()
la, lb = a.server.engine_loop, b.server.engine_loop
assert frozen(la) and frozen(lb)
a.stop()
assert frozen(lb), "a server still running keeps its objects frozen"
b.stop()
assert gc.get_freeze_count() == 0 and not frozen(la) and not frozen(lb), "the last stop unfreezes"
print("ok")
"""


def test_the_last_server_to_stop_gives_the_collector_its_objects_back():
    # In a fresh process (this one runs session-wide servers): objects frozen at SERVING stay
    # frozen while any server of the process runs, and are collectable again once none does.
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", THAW_SCRIPT], capture_output=True, text=True, timeout=300,
                         cwd=root, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0 and out.stdout.split()[-1:] == ["ok"], out.stderr[-3000:]
