"""The OpenAI HTTP API under seeded hostile bodies, as test_fuzz.py does for gRPC: random JSON
values (deep, huge, lone surrogates, wrong types) in every field of both endpoints, and raw
bytes that are not JSON. Every answer is a status the client caused (never 5xx), nothing is
logged as an error or with a traceback, no page stays held, and a fixed greedy probe gives
the same tokens afterwards. Over a real socket (httpx); derandomized and bounded; on the mock
engine's server (``mock_served``)."""
import json
import logging

try:  # the openai client's HTTP transport: httpx, named httpx2 by newer openai releases
    import httpx
except ImportError:
    import httpx2 as httpx

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import MODEL_NAME, mock_cases

SETTINGS = dict(derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
TEXT = st.one_of(st.text(max_size=12), st.text(SURROGATE, min_size=1, max_size=2),
                 st.sampled_from(["", "hi", "\x00", "\u2028", "[[[[", "\\", '"']))
INTS = st.one_of(st.integers(-3, 40), st.integers(-2**63, 2**63), st.sampled_from([2**31 - 1, 2**31, 2**32, 10**400]))
FLOATS = st.floats(allow_nan=False, allow_infinity=False)
LEAF = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT)
JSON = st.recursive(LEAF, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                  st.dictionaries(TEXT, inner, max_size=3)), max_leaves=8)
# Field -> values that make sense for it (half the draws) or anything (the other half).
SANE = {
    "max_tokens": st.integers(1, 3), "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1),
    "top_k": st.integers(0, 100), "min_p": st.floats(0, 1), "seed": st.integers(-2**63, 2**63 - 1),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "n": st.integers(1, 2), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2), "stop_token_ids": st.lists(st.integers(0, 49151),
                                                                                              max_size=2),
    "ignore_eos": st.booleans(), "session_id": st.text("abc-", max_size=8), "logprobs": st.integers(0, 3),
}
PROMPTS = st.one_of(st.text(min_size=1, max_size=16), st.lists(st.integers(0, 49151), min_size=1, max_size=6))
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                           "content": st.text(min_size=1, max_size=12)}), min_size=1, max_size=3)


@st.composite
def bodies(draw):
    chat = draw(st.booleans())
    body = {"model": draw(st.one_of(st.just(MODEL_NAME), JSON)) if draw(st.booleans()) else MODEL_NAME}
    if chat:
        body["messages"] = draw(st.one_of(MESSAGES, MESSAGES, JSON,
                                          st.lists(st.fixed_dictionaries({"role": JSON, "content": JSON}),
                                                   max_size=2)))
    else:
        body["prompt"] = draw(st.one_of(PROMPTS, PROMPTS, JSON))
    for name in draw(st.lists(st.sampled_from(sorted(SANE)), max_size=5, unique=True)):
        body[name] = draw(SANE[name] if draw(st.booleans()) else JSON)
    if "max_tokens" not in body:
        body["max_tokens"] = 2  # short generations: valid requests run for real
    return chat, json.dumps(body).encode()


RAW = st.one_of(st.binary(max_size=40), st.sampled_from([
    b"", b"{", b"[]", b"null", b'{"model": "tiny-llama", "prompt": "\\ud800"}', b"[" * 5000 + b"]" * 5000,
    b'{"model": "tiny-llama", "prompt": "x", "n": 1e400}', b"\xff\xfe", b'{"a": NaN}']))


def test_no_body_gets_a_5xx_or_a_traceback_and_serving_continues(mock_served, caplog):
    seen = {}

    def check(path, data):
        r = http.post(path, content=data, headers={"content-type": "application/json"})
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            assert b'"server_error"' not in r.content, (path, data, r.content[:300])
        assert r.status_code < 500, (path, data, r.status_code, r.text[:300])
        seen[r.status_code] = seen.get(r.status_code, 0) + 1

    @settings(max_examples=160, **SETTINGS)
    @given(bodies())
    def fuzz_bodies(case):
        chat, data = case
        check("/v1/chat/completions" if chat else "/v1/completions", data)

    @settings(max_examples=40, **SETTINGS)
    @given(st.booleans(), RAW)
    def fuzz_raw(chat, data):
        check("/v1/chat/completions" if chat else "/v1/completions", data)

    base = mock_served.http_target.removesuffix("/v1")
    with caplog.at_level(logging.INFO), httpx.Client(base_url=base, timeout=60) as http:
        fuzz_bodies()
        fuzz_raw()
    assert seen.get(200, 0) >= 15 and seen.get(400, 0) >= 60, seen
    bad = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, bad[:5]
    assert mock_served.eventually_idle()
    for name in ("ids_greedy", "text_greedy"):  # the mock's arithmetic: each token the previous + 1
        prompt, kw, want = mock_cases()[name]
        r = mock_served.client.generate(prompt, **kw)
        assert (list(r.token_ids), r.text) == (list(want), want.text)
