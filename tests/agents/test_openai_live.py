"""Structured outputs and tool calls through the official ``openai`` client against ONE live
server on the real default model (SmolLM2-135M-Instruct): every JSON-schema answer validates
(and without the constraint most do not), regex and Lark constraints hold, required and named
tool choices return calls whose arguments validate, streaming equals the whole response, a
grammar that cannot compile is a 400 naming it, and nothing compiles after warm-up with
constrained and unconstrained requests in the same batches. The same server's gRPC front is
checked too (a few schemas and tool choices, streams against unary responses)."""
from __future__ import annotations

import concurrent.futures
import json
import re
import urllib.request

import jsonschema
import pytest

from tests.agents.schemas import SCHEMAS, TOOL_PROMPTS, TOOLS, prompt
from tests.server.constrained import assemble as grpc_assemble, whole as grpc_whole

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow  # one server on the real model: its warm-up compiles ~20 programs
# Few buckets (the warm-up compiles each): one prefill row of up to 64 tokens (longer prompts are
# chunked), up to 4 decode rows.
ENGINE = dict(dtype="float32", kv_format="bf16", num_pages=160, page_size=16, max_num_seqs=4, max_prefill_seqs=1,
              prefill_chunk=64, max_num_batched_tokens=64, max_model_len=1024, strict_compiles=True)
MODEL = "smollm2"


@pytest.fixture(scope="module")
def server():
    from jaxserve import LLM
    from jaxserve.server.app import ServerThread

    llm = LLM(None, **ENGINE)
    st = ServerThread(llm, http_port=0, served_model_name=MODEL).start()
    st.wait_ready(timeout=900)
    yield st, llm
    st.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0].http_target, api_key="unused", max_retries=0, timeout=120)


def chat(client, content, **kw):
    kw.setdefault("max_tokens", 96)
    kw.setdefault("temperature", 0.0)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def parallel(fn, items):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # 4 at once: batches mix what they carry
        return list(pool.map(fn, items))


def valid(text, schema) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


@pytest.fixture(scope="module")
def schema_runs(client):
    """(constrained answers, unconstrained answers) for every schema, all requests at once: half
    greedy, half sampled with a seed; constrained and free requests share the batches."""
    def one(job):
        (what, schema), constrained, i = job
        rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}} if constrained else None
        sampled = dict(temperature=0.8, seed=i) if i % 2 else {}
        extra = {"response_format": rf} if rf else {}
        return chat(client, prompt(what) + " Schema: " + json.dumps(schema), **sampled, **extra)
    jobs = [(s, c, i) for i, s in enumerate(SCHEMAS) for c in (True, False)]
    outs = parallel(one, jobs)
    return [o for o, (_, c, _) in zip(outs, jobs) if c], [o for o, (_, c, _) in zip(outs, jobs) if not c]


def test_every_json_schema_answer_validates_and_most_free_answers_do_not(schema_runs):
    constrained, free = schema_runs
    assert len(SCHEMAS) >= 20
    bad = [(w, o.choices[0].message.content) for (w, s), o in zip(SCHEMAS, constrained)
           if not valid(o.choices[0].message.content, s)]
    assert not bad, bad
    free_ok = sum(valid(o.choices[0].message.content, s) for (_, s), o in zip(SCHEMAS, free))
    print(f"valid without the constraint: {free_ok}/{len(SCHEMAS)}")
    assert free_ok <= len(SCHEMAS) // 2


def test_json_object_regex_and_grammar(client):
    obj = chat(client, "Give a JSON object with a cat's name and age.", response_format={"type": "json_object"},
               max_tokens=200)
    assert obj.choices[0].finish_reason == "stop"  # the grammar completed (a JSON object), not max_tokens
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    rx = r"[0-9]{3}-[0-9]{4}"
    phone = chat(client, "Invent a phone number.", extra_body={"structured_outputs": {"regex": rx}})
    assert re.fullmatch(rx, phone.choices[0].message.content)
    lark = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no" | "maybe"'
    ans = chat(client, "Is the sky blue?", extra_body={"structured_outputs": {"grammar": lark}}, temperature=0.9, seed=5)
    assert re.fullmatch(r"The answer is (yes|no|maybe)\.", ans.choices[0].message.content)
    old = client.completions.create(model=MODEL, prompt="Colour of the sky:", max_tokens=8,
                                    extra_body={"guided_choice": ["blue", "green"]})
    assert old.choices[0].text in ("blue", "green")


def tool_by_name(name):
    return next(t for t in TOOLS if t["function"]["name"] == name)


def test_required_and_named_tool_choice_give_valid_calls(client):
    def one(job):
        (q, want), choice = job
        tc = {"type": "function", "function": {"name": want}} if choice == "named" else "required"
        return chat(client, q, tools=TOOLS, tool_choice=tc, parallel_tool_calls=False, max_tokens=80)
    jobs = [(p, c) for p in TOOL_PROMPTS for c in ("required", "named")]
    for ((q, want), choice), out in zip(jobs, parallel(one, jobs)):
        ch = out.choices[0]
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, (q, ch.message)
        call = ch.message.tool_calls[0]
        if choice == "named":
            assert call.function.name == want
        jsonschema.validate(json.loads(call.function.arguments), tool_by_name(call.function.name)["function"]["parameters"])


def assemble_stream(chunks):
    content, calls, reason = "", {}, None
    for c in chunks:
        if not c.choices:
            continue
        ch = c.choices[0]
        d = ch.delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            e = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                e["id"], e["name"] = tc.id, tc.function.name
            e["arguments"] += tc.function.arguments or ""
        reason = ch.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("kind", ["tools_required", "tools_auto", "json_schema"])
def test_streaming_equals_the_whole_response(client, kind):
    what, schema = SCHEMAS[5]
    kw = dict(temperature=0.7, seed=11, max_tokens=80)
    if kind == "json_schema":
        q = prompt(what)
        kw["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    else:
        q = "What is the weather in Oslo? Then add 2 and 2."
        kw.update(tools=TOOLS, tool_choice="required" if kind == "tools_required" else "auto")
    whole = chat(client, q, **kw).choices[0]
    content, calls, reason = assemble_stream(chat(client, q, stream=True, **kw))
    assert content == (whole.message.content or "")
    # The same calls (ids are per response: the two are different requests).
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments)
                                                           for c in whole.message.tool_calls or []]
    assert all(c["id"].startswith("call_") for c in calls)
    assert reason == whole.finish_reason
    if kind == "tools_required":
        assert calls


def test_tool_results_in_the_history_are_accepted(client):
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"}]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=24, temperature=0)
    assert out.choices[0].message.content or out.choices[0].message.tool_calls


def test_a_grammar_that_cannot_compile_is_400_naming_it(client):
    for kw, field, words in (
        (dict(extra_body={"structured_outputs": {"regex": "[a-"}}), "structured_outputs", "regex"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}),
         "response_format", "bogus"),
        (dict(extra_body={"guided_grammar": "start: missing_rule"}), "guided_grammar", "missing_rule"),
        (dict(tool_choice={"type": "function", "function": {"name": "nope"}}, tools=TOOLS), "tool_choice", "nope"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, "hi", **kw)
        body = e.value.body
        assert body["param"] == field and (words in body["message"] or field == "tool_choice"), body


def test_no_compilation_after_warmup_and_metrics(server, schema_runs):
    st, llm = server
    assert llm.engine.snapshot().compiles_after_warmup == 0
    text = urllib.request.urlopen(f"http://127.0.0.1:{st.server.metrics_port}/metrics", timeout=10).read().decode()
    got = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(jaxserve_[a-z_]+(?:_total|_count)?) ([0-9.e+-]+)$",
                                                               text, re.M)}
    assert got["jaxserve_structured_requests_total"] >= len(SCHEMAS)
    assert got["jaxserve_grammar_compile_seconds_count"] >= len(SCHEMAS)
    assert got["jaxserve_grammar_mask_steps_total"] > 0 and got["jaxserve_structured_invalid_outputs_total"] == 0


def test_grpc_structured_field(server):
    import grpc

    from jaxserve.client import Client
    from jaxserve.v1 import jaxserve_pb2 as pb

    with Client(server[0].target, timeout=120) as c:
        req = pb.GenerateRequest(text="Invent a phone number.", apply_chat_template=True,
                                 structured=pb.StructuredOutput(regex=r"[0-9]{3}-[0-9]{4}"))
        req.stop.max_tokens = 16
        out = c.stub.Generate(req, timeout=120)
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", out.text)
        req.structured.regex = "[a-"
        with pytest.raises(grpc.RpcError) as e:
            c.stub.Generate(req, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "regex" in e.value.details()


def test_n_choices_each_follow_the_schema(client):
    what, schema = SCHEMAS[0]
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    out = chat(client, prompt(what), n=2, temperature=0.9, seed=3, response_format=rf)
    assert len(out.choices) == 2 and all(valid(c.message.content, schema) for c in out.choices)


def test_grpc_schemas_and_tool_choices_validate_and_streams_equal_the_whole(server):
    """The gRPC front on the same server (jaxserve.client's agent arguments): JSON-schema answers
    validate, required and named tool choices return one call whose arguments validate, and a
    stream of each kind equals its unary response token for token and in the assembled calls."""
    from jaxserve.client import Client, build_request
    from jaxserve.v1 import jaxserve_pb2 as pb

    picked = [SCHEMAS[i] for i in (0, 3, 5)]
    reqs = [build_request([{"role": "user", "content": prompt(w) + " Schema: " + json.dumps(s)}], max_tokens=96,
                          structured={"json_schema": s}, request_id=f"grpc-schema-{i}")
            for i, (w, s) in enumerate(picked)]
    (q1, _), (q2, named) = TOOL_PROMPTS[0], TOOL_PROMPTS[1]
    reqs += [build_request([{"role": "user", "content": q}], max_tokens=80, tools=TOOLS, tool_choice=choice,
                           parallel_tool_calls=False, request_id=f"grpc-tool-{i}")
             for i, (q, choice) in enumerate([(q1, "required"), (q2, {"name": named})])]
    with Client(server[0].target, timeout=300) as c:
        outs = parallel(lambda r: c.stub.Generate(r, timeout=300), reqs)
        for (what, schema), out in zip(picked, outs[:3]):
            assert out.finish_reason == pb.FINISH_REASON_STOP and valid(out.text, schema), (what, out.text)
        for out, want in zip(outs[3:], (None, named)):
            assert out.finish_reason == pb.FINISH_REASON_TOOL_CALLS and len(out.tool_calls) == 1, out
            call = out.tool_calls[0]
            assert want is None or call.name == want
            jsonschema.validate(json.loads(call.arguments), tool_by_name(call.name)["function"]["parameters"])
        streams = parallel(lambda r: grpc_assemble(c.stub.GenerateStream(r, timeout=300)), [reqs[0], reqs[3]])
    for got, out in zip(streams, (outs[0], outs[3])):
        assert got == grpc_whole(out)
