"""Generation over gRPC gives exactly what the Python API gives (unary, streaming), with usage,
tokenizer RPCs, model info and the integrity check's failures, on the tiny model; many requests at
once, cached tokens, ids and sessions on the mock engine's server (its arithmetic's tokens)."""
import hashlib
import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from jaxserve.client import finish_reason

from .conftest import CASES, IDS_A, mock_cases


def collect_stream(client, prompt, **kw):
    """-> (start, token ids, text, end) of one GenerateStream call."""
    start, ids, text, end = None, [], [], None
    for i, ev in enumerate(client.generate_stream(prompt, **kw)):
        kind = ev.WhichOneof("event")
        if kind == "start":
            assert i == 0 and start is None
            start = ev.start
        elif kind == "delta":
            assert start is not None and end is None
            ids += ev.delta.token_ids
            text.append(ev.delta.text)
        else:
            assert end is None
            end = ev.end
    assert start is not None and end is not None
    return start, ids, "".join(text), end


@pytest.mark.parametrize("name", list(CASES) + ["stop_token", "stop_string"])
def test_unary_and_stream_give_the_python_api_tokens(served, cases, name):
    prompt, kw, want = cases[name]
    r = served.client.generate(prompt, **kw)
    assert list(r.token_ids) == list(want)
    assert r.text == want.text
    assert finish_reason(r) == want.finish_reason
    assert r.usage.prompt_tokens == want.usage.prompt_tokens
    assert r.usage.completion_tokens == len(want)
    start, ids, text, end = collect_stream(served.client, prompt, **kw)
    assert ids == list(want) and text == want.text
    assert finish_reason(end) == want.finish_reason
    assert start.prompt_tokens == end.usage.prompt_tokens == want.usage.prompt_tokens
    assert end.usage.completion_tokens == len(want)
    assert end.timing.HasField("time_to_first_token_s") and 0 < end.timing.time_to_first_token_s <= end.timing.total_s


def test_concurrent_requests_give_the_same_tokens(mock_served):
    cases = mock_cases()
    names = list(cases) * 2  # 18 requests, 16 at a time (= MAX_WAITING), against max_num_seqs=8

    def run(i_name):
        i, name = i_name
        prompt, kw, _ = cases[name]
        if i % 2:
            return name, collect_stream(mock_served.client, prompt, **kw)[1]
        return name, list(mock_served.client.generate(prompt, **kw).token_ids)

    with ThreadPoolExecutor(16) as pool:
        for name, ids in pool.map(run, enumerate(names)):
            assert ids == list(cases[name][2]), name
    assert mock_served.kv().used == 0


def test_cached_tokens_are_reported_at_start_and_end(mock_served):
    prompt = IDS_A + [11, 12, 13, 14]  # 24 tokens: 2 full pages can come from the prefix cache
    mock_served.client.generate(prompt, max_tokens=3, ignore_eos=True)
    start, _, _, end = collect_stream(mock_served.client, prompt, max_tokens=3, ignore_eos=True)
    assert start.cached_tokens == end.usage.cached_tokens == (len(prompt) - 1) // 8 * 8 == 16
    assert end.usage.prompt_tokens == len(prompt)


def test_request_ids_are_generated_or_kept(mock_served):
    a = mock_served.client.generate([5, 6, 7], max_tokens=2)
    b = mock_served.client.generate([5, 6, 7], max_tokens=2)
    assert a.request_id and b.request_id and a.request_id != b.request_id
    c = mock_served.client.generate([5, 6, 7], max_tokens=2, request_id="mine-1")
    assert c.request_id == "mine-1"
    start, *_ = collect_stream(mock_served.client, [5, 6, 7], max_tokens=2, request_id="mine-1")  # reusable when done
    assert start.request_id == "mine-1"


def test_session_id_from_field_or_header_is_echoed(mock_served):
    stub = mock_served.client.stub
    from jaxserve.client import build_request

    r, call = stub.Generate.with_call(build_request([5, 6], max_tokens=2), metadata=(("x-session-affinity", "s-hdr"),))
    assert r.session_id == "s-hdr"
    md = dict(call.initial_metadata())
    assert md["x-session-affinity"] == "s-hdr" and md["x-jaxserve-replica"] == "test-replica"
    assert md["x-request-id"] == r.request_id
    r = mock_served.client.generate([5, 6], max_tokens=2, session_id="s-field", session_header="s-hdr")
    assert r.session_id == "s-field"  # the field wins over the header
    start, *_ = collect_stream(mock_served.client, [5, 6], max_tokens=2, session_id="s-stream")
    assert start.session_id == "s-stream"


def test_tokenize_and_detokenize_match_the_tokenizer(served, llm):
    text = "The capital of France is Paris."
    ids = served.client.tokenize(text)
    assert ids == llm.tokenizer.encode(text)
    assert served.client.detokenize(ids) == llm.tokenizer.decode(ids)
    chat = served.client.tokenize("hi", chat_template=True)
    assert chat == llm.tokenizer.encode(llm.apply_chat_template("hi"))


def test_async_client_has_the_client_methods(served, llm, cases):
    """AsyncClient offers every public method of Client, as coroutines, with the same answers."""
    import asyncio

    from jaxserve.client import AsyncClient, Client

    def public(cls):
        return {n for n in vars(cls) if not n.startswith("_") and callable(getattr(cls, n))}

    assert public(Client) - {"__enter__", "__exit__"} <= public(AsyncClient)
    text = "The capital of France is Paris."
    prompt, kw, want = cases["ids_greedy"]

    async def run():
        async with AsyncClient(served.target, timeout=60) as c:
            await c.wait_ready(timeout=30)
            ids = await c.tokenize(text)
            chat = await c.tokenize("hi", chat_template=True)
            back = await c.detokenize(ids)
            r = await c.generate(prompt, **kw)
        async with AsyncClient("127.0.0.1:1") as dead:  # nothing listens there
            with pytest.raises(TimeoutError, match="not SERVING"):
                await dead.wait_ready(timeout=0.3, poll=0.05)
        return ids, chat, back, r

    ids, chat, back, r = asyncio.run(run())
    assert ids == llm.tokenizer.encode(text) and back == llm.tokenizer.decode(ids)
    assert chat == llm.tokenizer.encode(llm.apply_chat_template("hi"))
    assert list(r.token_ids) == list(want.token_ids)


def test_model_info_reports_formats_pool_and_fingerprint(served, llm, tiny_text_model):
    from pathlib import Path

    from jaxserve.server.convert import fingerprint, phase_formats

    info = served.client.model_info()
    assert info.architecture == "LlamaForCausalLM" and info.dtype == "float32"
    # The checkpoint's name, never where it lives on the server.
    assert info.model == Path(tiny_text_model).name and "/" not in info.model
    assert (info.prefill.weights, info.decode.weights) == ("float32", "float32")
    assert (info.prefill.kv_cache, info.decode.kv_cache) == ("float32", "float32")
    assert info.decode.matmul_path == llm.runner.weight_paths()["decode"]
    assert info.decode.matmul_path.startswith("as loaded -> xla:dot (")
    rep = llm.memory_report()
    assert info.memory.kv_pages == rep["kv_pages"] == 63 and info.memory.max_cached_tokens == 63 * 8
    assert info.memory.kv_bytes == rep["kv_bytes"] > 0 and info.memory.weight_bytes_resident == rep["weight_bytes"]["resident"]
    assert (info.page_size, info.num_pages, info.max_context) == (8, 64, 256)
    assert info.vocab_size == 49152 and info.has_tokenizer and list(info.eos_token_ids) == [2]
    assert info.kv_pages.total == 63 and info.kv_pages.used == 0
    assert info.replica_id == "test-replica" and info.max_waiting > 0 and info.integrity_check
    # The served fingerprint is the documented digest of the served weights, built here straight
    # from hashlib: per weight "index:dtype:shape;" and its raw bytes, then the formats as JSON.
    h = hashlib.sha256()
    for i, leaf in enumerate(llm.runner.params):
        a = np.asarray(leaf)
        h.update(f"{i}:{a.dtype.name}:{a.shape};".encode() + a.tobytes(order="C"))
    h.update(json.dumps(phase_formats(llm), sort_keys=True).encode())
    assert info.fingerprint == h.hexdigest()
    other = dict(phase_formats(llm), decode={"weights": "int4:g128", "kv_cache": "fp8_e4m3"})
    assert fingerprint(llm.runner.params, other) != info.fingerprint  # formats are part of it


def test_fingerprint_known_values():
    """Digests of literal inputs, computed by hand with hashlib: every byte, dtype and shape
    of every weight, and the formats, count."""
    from jaxserve.server.convert import fingerprint

    w = [np.array([1.0, -2.0], np.float32), np.arange(6, dtype=np.int8).reshape(2, 3)]
    data = (b"0:float32:(2,);" + bytes.fromhex("0000803f000000c0")
            + b"1:int8:(2, 3);" + bytes(range(6)) + b'{"decode": "int4:g128"}')
    assert fingerprint(w, {"decode": "int4:g128"}) == hashlib.sha256(data).hexdigest()
    assert fingerprint([], {}) == hashlib.sha256(b"{}").hexdigest()
    changed = [w[0], w[1].copy()]
    changed[1][1, 2] = 7  # one byte of the last weight
    assert fingerprint(changed, {"decode": "int4:g128"}) != fingerprint(w, {"decode": "int4:g128"})
    assert fingerprint([w[1].reshape(3, 2)], {}) != fingerprint([w[1]], {})  # same bytes, another shape


def test_integrity_failure_is_aborted_with_the_cause(served, cases):
    before = served.metrics()
    it = served.client.generate_stream(IDS_A, max_tokens=200, ignore_eos=True, request_id="tampered")
    assert next(it).WhichOneof("event") == "start"
    assert next(it).WhichOneof("event") == "delta"
    eid = served.server.service.active["tampered"].engine_id

    def tamper(eng):  # what a host bookkeeping bug would do: the page table no longer matches
        eng.get_request(eid).expected[0] += 2

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
    for name in ("jaxserve_integrity_checks_total", "jaxserve_integrity_rows_checked_total"):
        assert after[(name, ())] > before[(name, ())]  # every program call checks its rows
    assert after[("jaxserve_requests_total", (("outcome", "aborted"), ("rpc", "GenerateStream")))] >= 1
    assert served.kv().used == 0
    p, kw, want = cases["sampled"]
    assert list(served.client.generate(p, **kw).token_ids) == list(want)
