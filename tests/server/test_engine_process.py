"""The engine in a process of its own (``--engine-process``): the same tokens, events, metrics,
aborts and errors as the engine on a thread, over the mock engine (``jaxserve.testing.MockLLM``
built in the child); a dead engine process fails the requests in flight and the server with
them; what crosses the socket (errors, frames) survives it; the CLI refuses what it cannot
serve and, on the tiny model, gives the Python API's tokens and drains on SIGTERM."""
import functools
import os
import pickle
import signal
import subprocess
import threading
import time

import grpc
import pytest

from jaxserve.client import finish_reason
from jaxserve.server import engine_messages as msg
from jaxserve.server.engine_process import EngineProcess, parse_cpus

from . import engine_calls
from .conftest import LIMITS, MAX_WAITING, MOCK_ENGINE, MODEL_NAME, Served, eventually, metric, mock_cases
from .serve_process import serve_args, server_env
from .test_generate import collect_stream


def start(**engine):
    from jaxserve.client import Client
    from jaxserve.server.app import ServerThread
    from jaxserve.server.limits import ServeLimits
    from jaxserve.testing import MockLLM

    model = EngineProcess(functools.partial(MockLLM, **(MOCK_ENGINE | engine)))
    st = ServerThread(model, max_waiting=MAX_WAITING, replica_id="test-replica", limits=ServeLimits(**LIMITS),
                      http_port=0, served_model_name=MODEL_NAME).start()
    client = Client(st.target, timeout=60)
    st.wait_ready(60)
    return Served(st, client, {"model": model})


@pytest.fixture(scope="module")
def proc_served():
    served = start()
    yield served
    served.client.close()
    served.thread.stop()
    assert not served.boot["model"].process.is_alive()  # a stopped server leaves no engine behind


def test_the_engine_runs_in_another_process(proc_served):
    pid = proc_served.server.engine_loop.call(engine_calls.pid).result(10)
    assert pid == proc_served.boot["model"].pid != os.getpid()
    # What lived at SERVING there is out of its collector's walk, as in one process.
    assert proc_served.server.engine_loop.call(engine_calls.frozen).result(10) > 0


@pytest.mark.parametrize("name", list(mock_cases()))
def test_unary_and_stream_give_the_mock_engines_tokens(proc_served, name):
    prompt, kw, want = mock_cases()[name]
    r = proc_served.client.generate(prompt, **kw)
    assert list(r.token_ids) == list(want) and r.text == want.text
    start, ids, text, end = collect_stream(proc_served.client, prompt, **kw)
    assert ids == list(want) and text == want.text
    assert end.usage.completion_tokens == len(want) and start.prompt_tokens == end.usage.prompt_tokens
    assert eventually(lambda: proc_served.kv().used == 0)


def test_concurrent_requests_and_the_metrics_cross_over(proc_served):
    from concurrent.futures import ThreadPoolExecutor

    cases = mock_cases()
    before = proc_served.metrics()
    names = list(cases) * 2
    with ThreadPoolExecutor(MAX_WAITING) as pool:
        got = list(pool.map(lambda n: list(proc_served.client.generate(cases[n][0], **cases[n][1]).token_ids), names))
    assert got == [list(cases[n][2]) for n in names]
    after = proc_served.metrics()
    # Written by the engine thread in the other process, replayed here.
    tokens = sum(len(cases[n][2]) for n in names)
    assert metric(after, "jaxserve_completion_tokens_total") - metric(before, "jaxserve_completion_tokens_total") == tokens
    assert metric(after, "jaxserve_time_to_first_token_seconds_count") - metric(before, "jaxserve_time_to_first_token_seconds_count") == len(names)
    assert metric(after, "jaxserve_kv_pages_total") == proc_served.kv().total > 0
    assert eventually(lambda: proc_served.kv().used == 0 and proc_served.server.engine_loop.waiting == 0)


def test_cancel_and_abort_free_the_pages(proc_served):
    it = proc_served.client.generate_stream([5, 6, 7], max_tokens=200, ignore_eos=True, request_id="long")
    assert next(it).WhichOneof("event") == "start"
    assert eventually(lambda: proc_served.kv().used > 0)
    assert list(proc_served.client.abort("long").aborted) == ["long"]
    events = list(it)
    assert finish_reason(events[-1].end) == "abort"
    it = proc_served.client.generate_stream([5, 6, 8], max_tokens=200, ignore_eos=True)
    assert next(it).WhichOneof("event") == "start"
    it.cancel()
    assert proc_served.eventually_idle()


def test_a_failed_step_fails_the_requests_in_flight_and_serving_goes_on(proc_served):
    it = proc_served.client.generate_stream([5, 6, 9], max_tokens=200, ignore_eos=True)
    assert next(it).WhichOneof("event") == "start"
    proc_served.server.engine_loop.call(engine_calls.fail_next_step).result(10)
    with pytest.raises(grpc.RpcError) as e:
        list(it)
    assert e.value.code() == grpc.StatusCode.INTERNAL and "injected step failure" in e.value.details()
    prompt, kw, want = mock_cases()["ids_greedy"]
    assert list(proc_served.client.generate(prompt, **kw).token_ids) == list(want)
    assert proc_served.eventually_idle()


def test_the_openai_client_is_served(proc_served):
    import openai

    oai = openai.OpenAI(base_url=proc_served.http_target, api_key="unused", max_retries=0)
    prompt, kw, want = mock_cases()["text_greedy"]
    r = oai.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=kw["max_tokens"], temperature=0)
    assert r.choices[0].text == want.text and r.usage.completion_tokens == len(want)


def test_a_dead_engine_process_fails_what_runs_and_the_server_stops_serving():
    served = start(step_seconds=0.02)
    try:
        it = served.client.generate_stream([5, 6, 7], max_tokens=200, ignore_eos=True)
        assert next(it).WhichOneof("event") == "start"
        os.kill(served.boot["model"].pid, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as e:
            list(it)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "engine's process ended" in e.value.details()
        assert eventually(lambda: served.client.health() == "NOT_SERVING", 10)
        assert served.server.replica_lost.is_set()
        with pytest.raises(grpc.RpcError) as e:
            served.client.generate([5], max_tokens=2)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(RuntimeError, match="engine's process"):
            served.server.engine_loop.call(engine_calls.pid).result(10)
    finally:
        served.client.close()
        served.thread.stop()


def test_a_failed_load_raises_here_what_it_raised_there():
    with pytest.raises(ValueError, match="no such checkpoint"):
        EngineProcess(functools.partial(engine_calls.fail_to_load, "no such checkpoint"))
    with pytest.raises(RuntimeError, match=r"ended before loading the model \(exit code 3\)"):
        EngineProcess(functools.partial(engine_calls.exit_while_loading, 3))


def test_the_engine_process_ends_with_the_front_end_even_mid_load():
    import sys
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", engine_calls.ORPHAN], capture_output=True, text=True, timeout=60,
                         cwd=repo, env=dict(os.environ, PYTHONPATH=repo))
    pid = int(out.stdout.split()[0])
    assert eventually(lambda: not os.path.exists(f"/proc/{pid}") or "Z" in _state(pid), 15), "the engine outlived its front end"


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_the_servers_errors_cross_whole():
    from jaxserve.disagg.handoff_request import KvHandoffError
    from jaxserve.engine.outputs import RequestFailed
    from jaxserve.kv.page_tracker import IntegrityError
    from jaxserve.server import errors

    class Local(Exception):  # not importable by name: cannot be unpickled elsewhere
        pass

    for e in (errors.client_queue_full(3, 2, 0.5), errors.refused_at_door(1.5), IntegrityError("r#1", "stale_generation"),
              KvHandoffError("r#2", "digest_mismatch", "layer 3"), RequestFailed("r#3", "sample", KeyError("k"))):
        back = pickle.loads(pickle.dumps(msg.portable(e)))
        assert type(back) is type(e) and str(back) == str(e)
        assert vars(back).keys() >= {k for k in vars(e) if k != "cause"}
    served_error = pickle.loads(pickle.dumps(errors.refused_at_door(1.5)))
    assert served_error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and served_error.http_status == 429
    assert served_error.retry_after_s == 1.5 and not served_error.client_fault
    for e, kind in ((Local("x"), RuntimeError), (type("Bad", (ValueError,), {})("y"), ValueError)):
        back = pickle.loads(pickle.dumps(msg.portable(e)))
        assert type(back) is kind and type(e).__name__ in str(back)


def test_frames_are_read_whole_however_the_reads_cut_them():
    messages = [msg.Start(), msg.Result(3, value=[1, 2]), msg.Abort("a#1", 4), msg.Result(5, value="x" * 100_000)]
    data = b"".join(msg.frame(m) for m in messages)
    reader, got = msg.FrameReader(), []
    for i in range(0, len(data), 7):
        got += reader.feed(data[i:i + 7])
    assert got == messages
    assert msg.FrameReader().feed(data) == messages


def test_engine_cpus_are_parsed_and_checked():
    assert parse_cpus("0-3,8") == {0, 1, 2, 3, 8} and parse_cpus("2") == {2}
    for bad in ("", "a", "3-1", "-1"):
        with pytest.raises(ValueError, match="--engine-cpus"):
            parse_cpus(bad)
    with pytest.raises(ValueError, match="not among this process's CPUs"):
        EngineProcess(engine_calls.pid, cpus={max(os.sched_getaffinity(0)) + 1})


@pytest.mark.parametrize("flags, says", [(("--engine-process", "--role", "decode"), "--engine-process serves one"),
                                         (("--engine-cpus", "0"), "needs --engine-process"),
                                         (("--engine-process", "--engine-cpus", "x"), "not a CPU list")])
def test_serve_refuses_what_the_engine_process_cannot_serve(tiny_text_model, flags, says):
    r = subprocess.run(serve_args(tiny_text_model, *flags), capture_output=True, text=True, timeout=120,
                       env=server_env())
    assert r.returncode == 2 and says in r.stderr, r.stderr


def test_serve_with_the_engine_process_gives_the_python_api_tokens_then_drains(tiny_text_model, cases):
    from jaxserve.client import Client

    proc = subprocess.Popen(serve_args(tiny_text_model, "--engine-process", "--profile-startup", "--log-level", "info"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=server_env())
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "SERVING on" in line:
                target = line.split("SERVING on ")[1].split()[0]
                break
        else:
            pytest.fail("".join(lines))
        engines = _children(proc.pid)
        assert engines, "no engine process"
        assert any("[engine]: start-up profile" in x for x in lines), "".join(lines)  # logged there, once warm
        with Client(target, timeout=60) as client:
            for name in ("ids_greedy", "text_greedy", "sampled"):
                prompt, kw, want = cases[name]
                assert list(client.generate(prompt, **kw).token_ids) == list(want), name
            stream = client.generate_stream([5, 6, 7], max_tokens=200, ignore_eos=True)
            assert next(stream).WhichOneof("event") == "start"
            proc.send_signal(signal.SIGTERM)  # drain: the running stream still finishes
            assert list(stream)[-1].end.usage.completion_tokens == 200
        rest = threading.Thread(target=lambda: lines.extend(proc.stdout))
        rest.start()
        assert proc.wait(60) == 0, "".join(lines)
        rest.join(5)
        assert all(eventually(lambda p=p: not os.path.exists(f"/proc/{p}"), 10) for p in engines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _children(pid: int) -> list[int]:
    """The engine process among ``pid``'s children (multiprocessing's resource tracker aside)."""
    end, found = time.monotonic() + 10, []
    while not found and time.monotonic() < end:
        for task in os.listdir(f"/proc/{pid}/task"):
            for kid in open(f"/proc/{pid}/task/{task}/children").read().split():
                if "resource_tracker" not in open(f"/proc/{kid}/cmdline").read():
                    found.append(int(kid))
        time.sleep(0.05)
    return found
