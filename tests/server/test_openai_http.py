"""The OpenAI-compatible HTTP API through the official ``openai`` client, against the served
fixture (the same engine as gRPC): greedy output equal to ``LLM.generate`` and gRPC, streaming
to ``data: [DONE]``, usage with cached tokens, log-probs against an independent prefill, n with
seeds; and on the mock engine's server (``mock_served``, no model): errors in OpenAI's shape and
codes, the full queue, ids and sessions, and disconnects that abort and free pages."""
import http.client
import json
import socket
import threading
import urllib.parse

import numpy as np
import openai
import pytest

from jaxserve.client import build_request

from .conftest import CONVERSATION, IDS_A, MAX_WAITING, MODEL_NAME, eventually, http_call, metric, mock_cases


@pytest.fixture(scope="module")
def oai(served):
    with openai.OpenAI(base_url=served.http_target, api_key="unused", max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def mock_oai(mock_served):
    """The openai client of the mock engine's server (errors, limits, disconnects: no model needed)."""
    with openai.OpenAI(base_url=mock_served.http_target, api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def token_texts(llm, ids):
    return [llm.tokenizer.decode([t], skip_special_tokens=False) for t in ids]


def test_before_warmup_health_and_generation_are_503_with_retry_after(mock_served):
    status, body, headers = mock_served.boot["http_health"]
    assert status == 503 and body["error"]["type"] == "service_unavailable" and "warming up" in body["error"]["message"]
    status, body, headers = mock_served.boot["http_chat"]
    assert status == 503 and int(headers["retry-after"]) >= 1
    assert http_call(mock_served.http_target.removesuffix("/v1") + "/health")[:2] == (200, {"status": "serving",
                                                                                   "model": MODEL_NAME})


@pytest.mark.parametrize("name", ["multi_turn", "chat_template"])
def test_chat_gives_the_python_api_and_grpc_tokens(served, cases, llm, oai, name):
    prompt, kw, want = cases[name]
    messages = prompt if name == "multi_turn" else [{"role": "user", "content": prompt}]
    limit = {"max_completion_tokens" if name == "multi_turn" else "max_tokens": kw["max_tokens"]}  # either name
    r = oai.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, logprobs=True, **limit)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == want.text and c.finish_reason == want.finish_reason
    assert [t.token for t in c.logprobs.content] == token_texts(llm, want)  # token by token
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (want.usage.prompt_tokens, len(want))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    grpc_r = served.client.generate(messages, max_tokens=kw["max_tokens"])
    assert list(grpc_r.token_ids) == list(want) and grpc_r.text == c.message.content


def test_cached_tokens_are_reported(served, cases, oai):
    prompt, kw, want = cases["multi_turn"]
    oai.chat.completions.create(model=MODEL_NAME, messages=prompt, max_tokens=2, temperature=0)
    r = oai.chat.completions.create(model=MODEL_NAME, messages=prompt, max_tokens=2, temperature=0)
    page = served.server.info.page_size
    assert r.usage.prompt_tokens_details.cached_tokens == (want.usage.prompt_tokens - 1) // page * page > 0


@pytest.mark.parametrize("name", ["ids_greedy", "text_greedy", "stop_string", "penalties"])
def test_completions_give_the_python_api_text(served, cases, oai, name):
    prompt, kw, want = cases[name]
    extra = {k: kw[k] for k in ("ignore_eos", "repetition_penalty") if k in kw}  # vLLM's extra fields
    openai_kw = {k: kw[k] for k in ("presence_penalty", "frequency_penalty", "stop") if k in kw}
    r = oai.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=kw["max_tokens"], temperature=0,
                               extra_body=extra, **openai_kw)
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == want.finish_reason
    assert r.usage.completion_tokens == len(want)


def test_chat_stream_ends_with_usage_and_done(served, cases, oai):
    prompt, kw, want = cases["multi_turn"]
    chunks = list(oai.chat.completions.create(model=MODEL_NAME, messages=prompt, max_tokens=kw["max_tokens"],
                                              temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want)
    assert chunks[-1].usage.prompt_tokens == want.usage.prompt_tokens
    # The raw stream: server-sent events, the last one `data: [DONE]`.
    url = urllib.parse.urlsplit(served.http_target)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL_NAME, "prompt": IDS_A, "max_tokens": 3,
                                                        "stream": True}), {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    events = [e for e in resp.read().decode().split("\n\n") if e]
    conn.close()
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: {") for e in events[:-1])


def test_logprobs_match_the_reference_and_grpc(served, cases, llm, oai, logprobs_reference):
    prompt, kw, want = cases["logprobs"]
    k, ref = kw["logprobs"], logprobs_reference
    r = oai.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=kw["max_tokens"], temperature=0,
                               logprobs=k, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp.tokens == token_texts(llm, want)
    np.testing.assert_allclose(lp.token_logprobs, ref[np.arange(len(want)), list(want)], atol=2e-4)
    for t, top in enumerate(lp.top_logprobs):
        best = np.argsort(-ref[t], kind="stable")[:k]
        assert list(top) == token_texts(llm, best)
        np.testing.assert_allclose(list(top.values()), ref[t, best], atol=2e-4)
    assert lp.text_offset == list(np.cumsum([0] + [len(s) for s in lp.tokens[:-1]]))
    grpc_lps = [e.logprob for e in served.client.generate(prompt, **kw).logprobs]
    np.testing.assert_allclose(lp.token_logprobs, grpc_lps, atol=1e-6)
    chat = oai.chat.completions.create(model=MODEL_NAME, messages=CONVERSATION, max_tokens=3, temperature=0,
                                       logprobs=True, top_logprobs=2, stream=True)
    entries = [e for c in chat if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 3 and all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in entries)


def test_n_choices_with_a_seed_equal_grpc(served, cases, oai):
    prompt, kw, want = cases["sampled"]
    sampling = dict(temperature=kw["temperature"], top_p=kw["top_p"], seed=kw["seed"], max_tokens=kw["max_tokens"])
    r = oai.completions.create(model=MODEL_NAME, prompt=prompt, n=3, extra_body={"top_k": kw["top_k"],
                                                                                 "ignore_eos": True}, **sampling)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert texts[0] == want.text and len(set(texts)) == 3
    assert [c.text for c in served.client.generate(prompt, n=3, **kw).choices] == texts
    assert r.usage.completion_tokens == 3 * len(want)


def error_of(call):
    with pytest.raises(openai.APIStatusError) as e:
        call()
    return e.value.status_code, e.value.body, e.value.response.headers


def test_errors_have_openai_shape_and_status(mock_served, mock_oai):
    chat = mock_oai.chat.completions.create
    status, body, _ = error_of(lambda: chat(model=MODEL_NAME, messages=CONVERSATION, top_p=0))
    assert status == 400 and body["param"] == "top_p" and body["type"] == "invalid_request_error"
    status, body, _ = error_of(lambda: chat(model="gpt-4o", messages=CONVERSATION))
    assert status == 404 and body["code"] == "model_not_found" and body["param"] == "model"
    status, body, _ = error_of(lambda: chat(model=MODEL_NAME, messages=[{"role": "user", "content": 3}]))
    assert status == 400 and body["param"] == "messages"
    status, body, _ = error_of(lambda: chat(model=MODEL_NAME, messages=CONVERSATION, n=99))
    assert status == 400 and "n must be" in body["message"]
    status, body, _ = error_of(lambda: mock_oai.completions.create(model=MODEL_NAME, prompt=[5, 10**6]))
    assert status == 400 and "vocabulary" in body["message"]
    status, body, _ = error_of(lambda: mock_oai.completions.create(model=MODEL_NAME, prompt="x", stop=["s"] * 65))
    assert status == 400 and "--max-stop-strings" in body["message"]
    status, body, headers = http_call(mock_served.http_target + "/nothing-here", {})
    assert status == 404 and "error" in body
    assert mock_served.eventually_idle()


def test_full_queue_is_429_with_retry_after(mock_served, mock_oai):
    cases = mock_cases()
    loop = mock_served.server.engine_loop
    hold = threading.Event()
    blocked = loop.call(lambda eng: hold.wait(30))  # the engine thread admits nothing meanwhile
    p, kw, want = cases["ids_greedy"]
    futs = [mock_served.client.stub.Generate.future(build_request(p, **kw), timeout=60) for _ in range(MAX_WAITING)]
    try:
        assert eventually(lambda: loop.waiting == MAX_WAITING, 10)
        status, body, headers = error_of(lambda: mock_oai.completions.create(model=MODEL_NAME, prompt=[5], max_tokens=2))
    finally:
        hold.set()
    blocked.result(10)
    assert all(list(f.result(60).token_ids) == list(want) for f in futs)
    assert status == 429 and body["type"] == "rate_limit_error" and "queue is full" in body["message"]
    assert int(headers["retry-after"]) >= 1 and int(headers["retry-after-ms"]) >= 50


def _cancelled(served, api):
    return metric(served.metrics(), "jaxserve_requests_total", rpc=api, outcome="cancelled")


def test_a_stream_whose_client_disconnects_is_aborted_and_frees_its_pages(mock_served):
    before = _cancelled(mock_served, "http.chat")
    url = urllib.parse.urlsplit(mock_served.http_target)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 180, "temperature": 0,
        "stream": True, "ignore_eos": True}), {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    while b"content" not in (line := resp.readline()):  # a token has been generated: the request holds pages
        assert line, "the stream ended before its first token"
    assert mock_served.kv().used > 0
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    assert mock_served.eventually_idle()
    assert eventually(lambda: _cancelled(mock_served, "http.chat") == before + 1)


def test_a_waiting_client_that_disconnects_is_aborted_and_frees_its_pages(mock_served):
    before = _cancelled(mock_served, "http.completions")
    url = urllib.parse.urlsplit(mock_served.http_target)
    body = json.dumps({"model": MODEL_NAME, "prompt": IDS_A, "max_tokens": 200, "ignore_eos": True}).encode()
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n" % len(body) + body)
    assert eventually(lambda: mock_served.kv().used > 0, 10)  # running
    sock.close()
    assert mock_served.eventually_idle()
    assert eventually(lambda: _cancelled(mock_served, "http.completions") == before + 1)


def test_session_header_and_ids_are_echoed(mock_served, mock_oai):
    raw = mock_oai.chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=CONVERSATION, max_tokens=2, extra_headers={"x-session-affinity": "s-42"})
    r = raw.parse()
    assert raw.headers["x-session-affinity"] == "s-42" and raw.headers["x-request-id"] == r.id
    assert raw.headers["x-jaxserve-replica"] == "test-replica"
    status, body, _ = error_of(lambda: mock_oai.chat.completions.create(
        model=MODEL_NAME, messages=CONVERSATION, extra_body={"session_id": "has space"}))
    assert status == 400 and "session_id" in body["message"]
    assert [m.id for m in mock_oai.models.list().data] == [MODEL_NAME]
