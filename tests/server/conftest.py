"""Two in-process servers for the whole directory (``ServerThread``: a grpc.aio server and the
OpenAI HTTP API on its own thread, ephemeral ports on 127.0.0.1):

- ``served``: a tiny text model. Before serving, the same LLM computes the expected completions
  of every case with the Python API (``llm.generate``); the server must then give exactly those
  tokens. For the end-to-end tests that need a model (tokens, tokenizer, log-probs, formats).
- ``mock_served``: the mock engine (``jaxserve.testing.MockLLM``: no model, tokens by arithmetic,
  ``mock_cases``) for the server's own behaviour: errors, limits, abuse, fuzzing, disconnects,
  fair share. Its warm-up is held on a gate until the fixture has observed the not-yet-warm
  server (health NOT_SERVING, Generate UNAVAILABLE), so that observation is deterministic.
"""
from __future__ import annotations

import dataclasses
import json
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.engine.sampling_params import SamplingParams

from .tiny_model import build_tiny_text_model

ENGINE = dict(kv_format="float32", num_pages=64, page_size=8, max_num_seqs=8, max_prefill_seqs=2,
              prefill_chunk=32, max_num_batched_tokens=64, max_model_len=256)
MAX_WAITING = 16
MODEL_NAME = "tiny-llama"  # the served fixture's model name in the OpenAI HTTP API
# The served fixture's limits: prompts up to 2 MiB (so a multi-MB text is tokenized while other
# requests run), stream caps above the 8 streams per connection test_generate opens at once
# and (in total) below MAX_WAITING, so a test can fill them while the engine is held.
LIMITS = dict(max_prompt_bytes=2 << 20, max_streams_per_peer=10, max_streams=14, stream_idle_timeout_s=1.0)
IDS_A = [312, 4093, 198, 1115, 27, 9804, 351, 17, 2032, 4110, 36, 720, 5, 87, 1501, 6612, 198, 42, 77, 908]
IDS_B = [28, 9, 17012, 4422, 91, 118, 3, 4490, 6]
CONVERSATION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one?"}]

# name -> (prompt, build_request keyword arguments); the same keywords make the SamplingParams.
CASES = {
    "ids_greedy": (IDS_A, dict(max_tokens=12, ignore_eos=True)),
    "text_greedy": ("The capital of France is", dict(max_tokens=10)),
    "chat_template": ("What is two plus two?", dict(max_tokens=10, chat_template=True)),
    "sampled": (IDS_B, dict(max_tokens=12, temperature=0.8, top_k=50, top_p=0.9, seed=7, ignore_eos=True)),
    "min_p": (IDS_B, dict(max_tokens=10, temperature=1.3, min_p=0.05, seed=11, ignore_eos=True)),
    "penalties": (IDS_A[:13], dict(max_tokens=12, repetition_penalty=1.3, presence_penalty=0.5,
                                   frequency_penalty=0.4, ignore_eos=True)),
    "multi_turn": (CONVERSATION, dict(max_tokens=10)),
    "logprobs": (IDS_A[:9], dict(max_tokens=6, ignore_eos=True, logprobs=3)),
}


def sampling_params(kw) -> SamplingParams:
    kw = {k: v for k, v in kw.items() if k not in ("chat_template", "session_id", "request_id")}
    for k in ("stop", "stop_token_ids"):
        if k in kw:
            kw[k] = tuple(kw[k])
    return SamplingParams(**kw)


def expected_completion(llm, prompt, kw):
    if kw.get("chat_template"):
        prompt = llm.apply_chat_template(prompt)
    elif isinstance(prompt[0], dict):  # a conversation: the checkpoint's chat template
        prompt = llm.tokenizer.apply_chat_template(prompt)
    return llm.generate([prompt], sampling_params(kw))[0]


@pytest.fixture(scope="session")
def tiny_text_model(tmp_path_factory):
    return build_tiny_text_model(tmp_path_factory.mktemp("tiny_text_llama"))


@pytest.fixture(scope="session")
def llm(tiny_text_model):
    from jaxserve import LLM

    return LLM(tiny_text_model, **ENGINE)


@pytest.fixture(scope="session")
def cases(llm):
    """name -> (prompt, kwargs, expected Completion), computed before the server owns the engine."""
    out = {name: (p, kw, expected_completion(llm, p, kw)) for name, (p, kw) in CASES.items()}
    greedy = out["ids_greedy"][2]
    # Stop criteria derived from a known output, so they are sure to fire mid-generation.
    stop_tok = dict(max_tokens=12, ignore_eos=True, stop_token_ids=[greedy[4]])
    text = out["text_greedy"][2].text
    stop_str = dict(max_tokens=10, stop=[text[len(text) // 2:len(text) // 2 + 3]])
    for name, prompt, kw in (("stop_token", IDS_A, stop_tok), ("stop_string", "The capital of France is", stop_str)):
        out[name] = (prompt, kw, expected_completion(llm, prompt, kw))
    assert out["stop_token"][2].finish_reason == "stop" and out["stop_string"][2].finish_reason == "stop"
    return out


@pytest.fixture(scope="session")
def logprobs_reference(llm, cases):
    """[T, vocab] log-probs of the "logprobs" case's output tokens from one prefill over prompt +
    output (every position's logits at once), not the decode path that sampled them: row t
    scores output token t. Computed before the server owns the engine."""
    p, _, want = cases["logprobs"]
    return llm.logprobs(list(p) + list(want)[:-1])[len(p) - 1:]


@dataclasses.dataclass
class Served:
    thread: object  # ServerThread
    client: object  # jaxserve.client.Client
    boot: dict  # what the fixture saw before and after warm-up

    @property
    def server(self):
        return self.thread.server

    @property
    def target(self) -> str:
        return self.thread.target

    def metrics(self) -> dict:
        return scrape(self.server.metrics_port)

    def kv(self):
        return self.client.model_info().kv_pages

    def eventually_idle(self, timeout: float = 10.0) -> bool:
        """No request in flight and every KV page back (cancels reach the engine a moment later)."""
        return bool(eventually(lambda: not self.server.service.active and self.kv().used == 0, timeout))

    @property
    def http_target(self) -> str:
        """The OpenAI API's base URL."""
        return self.thread.http_target


@pytest.fixture(scope="session")
def served(llm, cases, logprobs_reference):
    """The tiny model's server (gRPC and HTTP), once the expected completions are computed. What a
    server does before SERVING is watched on the mock engine's (``mock_served``)."""
    from jaxserve.client import Client
    from jaxserve.server.app import ServerThread
    from jaxserve.server.limits import ServeLimits

    st = ServerThread(llm, max_waiting=MAX_WAITING, replica_id="test-replica", limits=ServeLimits(**LIMITS),
                      http_port=0, served_model_name=MODEL_NAME).start()
    client = Client(st.target, timeout=60)
    st.wait_ready()
    yield Served(st, client, {})
    client.close()
    st.stop()


def http_call(url: str, body: dict | None = None, headers: dict | None = None,
              context=None) -> tuple[int, dict, dict]:
    """GET (or POST `body` as JSON) -> (status, JSON body, response headers), errors included;
    context: an ssl.SSLContext for https."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60, context=context) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def scrape(port: int) -> dict:
    """/metrics -> {(sample name, (sorted label items)): value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def eventually(fn, timeout: float = 5.0):
    """fn() until truthy (returned) or timeout (last value returned): for effects that
    happen after the client has seen its answer (a cancel travels to the server)."""
    end = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > end:
            return value
        time.sleep(0.01)


# ---------------------------------------------------------------------- the mock engine's server
# The same server over ``jaxserve.testing.MockLLM`` (no model): the engine's scheduler, pages and
# outputs with arithmetic for a model (greedy: each token is the previous + 1), the tokenizer one
# id per character (id = ord(char) + OFFSET). Server, limits, abuse and fuzz tests run on it.
MOCK_ENGINE = {k: v for k, v in ENGINE.items() if k != "kv_format"} | dict(step_seconds=0.005)
MOCK_TEXT = "The capital of France is"  # greedy: "tuvwxyz{|}..." (after the final "s")


def mock_text(ids) -> str:
    """The mock tokenizer's text of generated (non-special) ids."""
    from jaxserve.testing.mock_llm import OFFSET

    return "".join(chr(t - OFFSET) for t in ids)


class MockCompletion(list):
    """Expected token ids (the list), text and finish reason of a mock-engine request."""

    def __init__(self, ids, text: str, finish_reason: str = "length"):
        super().__init__(ids)
        self.text, self.finish_reason = text, finish_reason


def _mock(ids, finish_reason: str = "length", text: str | None = None) -> MockCompletion:
    return MockCompletion(ids, mock_text(ids) if text is None else text, finish_reason)


def mock_cases() -> dict:
    """CASES' names for the mock engine -> (prompt, kwargs, expected MockCompletion), by hand:
    greedy tokens step by 1 from the prompt's last token, sampled ones by 1 + seed % 7; a chat's
    prompt ends with the template's "\n" (id 15); penalties do not move the mock."""
    from jaxserve.testing import char_ids, greedy_ids

    last = char_ids(MOCK_TEXT)[-1]  # "s"
    greedy = greedy_ids(IDS_A[-1], 12)
    chat = greedy_ids(char_ids("\n")[0], 10)
    return {
        "ids_greedy": (IDS_A, dict(max_tokens=12, ignore_eos=True), _mock(greedy)),
        "text_greedy": (MOCK_TEXT, dict(max_tokens=10), _mock(greedy_ids(last, 10), text="tuvwxyz{|}")),
        "chat_template": ("What is two plus two?", dict(max_tokens=10, chat_template=True), _mock(chat)),
        "sampled": (IDS_B, dict(max_tokens=12, temperature=0.8, top_k=50, top_p=0.9, seed=9, ignore_eos=True),
                    _mock([IDS_B[-1] + 3 * k for k in range(1, 13)])),  # 1 + 9 % 7 = 3
        "penalties": (IDS_A[:13], dict(max_tokens=12, repetition_penalty=1.3, presence_penalty=0.5,
                                       frequency_penalty=0.4, ignore_eos=True), _mock(greedy_ids(IDS_A[12], 12))),
        "multi_turn": (CONVERSATION, dict(max_tokens=10), _mock(chat)),
        "logprobs": (IDS_A[:9], dict(max_tokens=6, ignore_eos=True, logprobs=3), _mock(greedy_ids(IDS_A[8], 6))),
        "stop_token": (IDS_A, dict(max_tokens=12, ignore_eos=True, stop_token_ids=[greedy[4]]),
                       _mock(greedy[:5], "stop")),  # the stop token's own text stays, as the engine's
        "stop_string": (MOCK_TEXT, dict(max_tokens=10, stop=["wx"]), _mock(greedy_ids(last, 5), "stop", "tuv")),
    }


@pytest.fixture(scope="session")
def mock_served():
    """A ServerThread over a MockLLM with the served fixture's limits and names, observed before
    SERVING (its warm-up held on the mock engine's gate): ``boot``."""
    from jaxserve.client import Client
    from jaxserve.server.app import ServerThread
    from jaxserve.server.limits import ServeLimits
    from jaxserve.testing import MockLLM

    llm = MockLLM(**MOCK_ENGINE)
    llm.engine.warmup_gate = gate = threading.Event()
    st = ServerThread(llm, max_waiting=MAX_WAITING, replica_id="test-replica", limits=ServeLimits(**LIMITS),
                      http_port=0, served_model_name=MODEL_NAME).start()
    client = Client(st.target, timeout=60)
    boot = {"health": client.health(), "service_health": client.health("jaxserve.v1.JaxServe")}
    try:
        client.generate([5, 6, 7], max_tokens=2)
        boot["generate"] = grpc.StatusCode.OK
    except grpc.RpcError as e:
        boot["generate"] = e.code()
    boot["info_while_warming"] = client.model_info().architecture
    base = st.http_target.removesuffix("/v1")
    boot["http_health"] = http_call(base + "/health")
    boot["http_chat"] = http_call(base + "/v1/chat/completions", {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    gate.set()
    st.wait_ready()
    boot["health_after"] = client.health()
    yield Served(st, client, boot)
    client.close()
    st.stop()


def on_the_mock_server():
    """A module's ``served`` and ``cases`` fixtures on the mock engine's server (no model; tokens
    by ``mock_cases``' arithmetic): ``served, cases = on_the_mock_server()`` at module level."""
    @pytest.fixture(scope="module")
    def served(mock_served):
        return mock_served

    @pytest.fixture(scope="module")
    def cases():
        return mock_cases()

    return served, cases
