"""gRPC agent fields (tools, tool_choice, parse_output, tool messages) on the mock engine: its
``script`` makes every request write a Hermes-style tool call after a <think> block, which the
server parses as the OpenAI front does; old clients (no agent fields) get the responses they
always did; a stream's content, reasoning and tool-call deltas add up to the unary result."""
from __future__ import annotations

import json

import grpc
import pytest

from jaxserve.server import agent_plan, grpc_agents
from jaxserve.testing.mock_llm import char_ids, char_tokenizer
from jaxserve.v1 import jaxserve_pb2 as pb
from jaxserve.v1 import jaxserve_pb2_grpc as pb_grpc

ANSWER = ('<think>Paris is a city.</think>Let me look.<tool_call>\n'
          '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>')
WEATHER = pb.Tool(name="get_weather", description="The weather in a city",
                  parameters=json.dumps({"type": "object", "properties": {"city": {"type": "string"}}}))
USER = [pb.ChatMessage(role="user", content="Weather in Paris?")]
NEW_FIELDS = {"content", "reasoning_text", "tool_calls"}


@pytest.fixture(scope="module")
def stub():
    from jaxserve.server.app import ServerThread
    from jaxserve.testing import MockLLM

    llm = MockLLM(num_pages=512, page_size=8, max_num_seqs=8)
    llm.engine.script = char_ids(ANSWER)
    st = ServerThread(llm, reasoning_parser="think").start()
    st.wait_ready()
    channel = grpc.insecure_channel(st.target)
    yield pb_grpc.JaxServeStub(channel)
    channel.close()
    st.stop()


def request(**kw) -> pb.GenerateRequest:
    kw.setdefault("messages", USER)
    return pb.GenerateRequest(stop=pb.StopCriteria(max_tokens=len(ANSWER) + 4), **kw)


def assemble(events):
    """A stream's parsed pieces joined: (content, reasoning, [(id, name, arguments)], finish reason)."""
    content, reasoning, calls, reason = "", "", {}, None
    for ev in events:
        if ev.HasField("delta"):
            content += ev.delta.content
            reasoning += ev.delta.reasoning_text
            for c in ev.delta.tool_calls:
                old = calls.get(c.index, ("", "", ""))
                calls[c.index] = (old[0] or c.id, old[1] or c.name, old[2] + c.arguments)
        elif ev.HasField("end"):
            reason = ev.end.finish_reason
    return content, reasoning, [calls[i] for i in sorted(calls)], reason


def test_tool_call_and_reasoning_whole_and_streamed(stub):
    resp = stub.Generate(request(tools=[WEATHER]))
    assert resp.text == ANSWER  # the raw text, as old clients read it
    assert resp.content == "Let me look."
    assert resp.reasoning_text == "Paris is a city."
    [call] = resp.tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "unit": "c"}
    assert call.id.startswith("call_")
    assert resp.finish_reason == pb.FINISH_REASON_TOOL_CALLS
    content, reasoning, calls, reason = assemble(stub.GenerateStream(request(tools=[WEATHER], request_id="s1")))
    whole = stub.Generate(request(tools=[WEATHER], request_id="s1"))  # the same ids as the stream's
    assert (content, reasoning, reason) == (whole.content, whole.reasoning_text, whole.finish_reason)
    assert calls == [(c.id, c.name, c.arguments) for c in whole.tool_calls]


def test_n_choices_each_parsed(stub):
    resp = stub.Generate(request(tools=[WEATHER], n=2))
    assert len(resp.choices) == 2
    for ch in resp.choices:
        assert ch.content == "Let me look." and [c.name for c in ch.tool_calls] == ["get_weather"]
        assert ch.finish_reason == pb.FINISH_REASON_TOOL_CALLS
    assert resp.choices[0].tool_calls[0].id != resp.choices[1].tool_calls[0].id
    events = list(stub.GenerateStream(request(tools=[WEATHER], n=2, request_id="n2")))
    whole = stub.Generate(request(tools=[WEATHER], n=2, request_id="n2"))
    for ch in whole.choices:
        mine = [ev for ev in events if getattr(ev, ev.WhichOneof("event")).index == ch.index]
        content, reasoning, calls, reason = assemble(mine)
        assert (content, reasoning, reason) == (ch.content, ch.reasoning_text, ch.finish_reason)
        assert calls == [(c.id, c.name, c.arguments) for c in ch.tool_calls]


def test_parse_output_without_tools_is_content_and_reasoning(stub):
    resp = stub.Generate(request(parse_output=True))
    assert resp.reasoning_text == "Paris is a city."
    assert resp.content.startswith("Let me look.<tool_call>") and not resp.tool_calls  # no tools: all content
    assert resp.finish_reason == pb.FINISH_REASON_STOP


def test_old_client_unchanged(stub):
    """No agent field (or parse_output false alone): none of the new fields is on the wire."""
    for req in (request(), request(parse_output=False)):
        resp = stub.Generate(req)
        assert resp.text == ANSWER and resp.finish_reason == pb.FINISH_REASON_STOP
        assert not NEW_FIELDS & {f.name for f, _ in resp.ListFields()}
        for ev in stub.GenerateStream(req):
            if ev.HasField("delta"):
                assert ev.delta.token_ids and not NEW_FIELDS & {f.name for f, _ in ev.delta.ListFields()}
            if ev.HasField("end"):
                assert ev.end.finish_reason == pb.FINISH_REASON_STOP


@pytest.mark.parametrize("kw, field", [
    (dict(tools=[WEATHER], tool_choice=pb.ToolChoice(function="nope")), "tool_choice"),
    (dict(tool_choice=pb.ToolChoice(required=True)), "tool_choice"),
    (dict(tools=[pb.Tool(name="f", parameters="[1]")]), "tools"),
    (dict(tools=[WEATHER, WEATHER]), "tools"),
    (dict(tools=[pb.Tool(name="")]), "tools"),
    (dict(chat_template_kwargs="{not json"), "chat_template_kwargs"),
    (dict(chat_template_kwargs='{"tools": 1}'), "chat_template_kwargs"),
    (dict(tools=[WEATHER], tool_choice=pb.ToolChoice(required=True),
          structured=pb.StructuredOutput(json_object=True)), "tool_choice"),
    (dict(messages=[], text="hi", tools=[WEATHER]), "tools"),
    # required: a grammar in the model's tool-call format (the mock engine compiles none)
    (dict(tools=[WEATHER], tool_choice=pb.ToolChoice(required=True)), "tools"),
])
def test_invalid_agent_fields(stub, kw, field):
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(request(**kw))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(field), e.value.details()


def test_history_tool_messages_rendered():
    """An assistant's earlier call and the tool's result reach the template (Hermes text here)."""
    front = agent_plan.AgentFront(char_tokenizer())
    req = request(tools=[WEATHER], messages=USER + [
        pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="c1", name="get_weather",
                                                                 arguments='{"city": "Paris"}')]),
        pb.ChatMessage(role="tool", tool_call_id="c1", content="18 C, sunny")])
    ids, text = grpc_agents.render(front, req, grpc_agents.agent_request(req), 16)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "18 C, sunny" in text and '"name": "get_weather"' in text.split("<|im_end|>")[0]  # tools in system
    assert ids == char_tokenizer().encode(text)


class Counter:
    def labels(self, *a):
        return self

    def inc(self):
        pass


class Metrics:
    tool_calls = tool_calls_invalid = Counter()


@pytest.mark.parametrize("text", [ANSWER, "<think>a</think>no call", '<tool_call>\n{"name": "f"}\n</tool_call>x',
                                  'a<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><tool_call>\n'
                                  '{"name": "g", "arguments": {"q": "\\"é\\""}}\n</tool_call>',
                                  '<tool_call>\n{"name": "f", "arguments": {"a": [1]}}',  # unclosed: a call at the end
                                  "<think>still thinking", "answer ending in <tool"])
def test_stream_deltas_assemble_to_whole(text):
    """Every split of the text in two: the deltas' sum is the whole result (ids included)."""
    front = agent_plan.AgentFront(char_tokenizer(), reasoning_parser="think")
    tools = [{"type": "function", "function": {"name": n, "parameters": {}}} for n in ("f", "g", "get_weather")]
    plan = front.plan(True, agent_plan.AgentRequest(tools=tools), "prompt")
    whole = grpc_agents.AgentOutput(plan, "r", 1, Metrics(), "hermes").whole(
        pb.GenerateResponse(finish_reason=pb.FINISH_REASON_STOP), [text])
    for cut in range(len(text) + 1):
        out = grpc_agents.AgentOutput(plan, "r", 1, Metrics(), "hermes")
        deltas = [pb.TokenDelta(**out.delta(0, text[:cut])), pb.TokenDelta(**out.delta(0, text[cut:])),
                  pb.TokenDelta(**out.end(0))]
        events = [pb.GenerateStreamResponse(delta=d) for d in deltas]
        events.append(pb.GenerateStreamResponse(end=pb.StreamEnd(finish_reason=out.reason(0, pb.FINISH_REASON_STOP))))
        content, reasoning, calls, reason = assemble(events)
        assert (content, reasoning, reason) == (whole.content, whole.reasoning_text, whole.finish_reason), cut
        assert calls == [(c.id, c.name, c.arguments) for c in whole.tool_calls], cut


def test_template_kwargs_thinking_off(stub):
    """chat_template_kwargs reach the plan: enable_thinking false, so no reasoning is split off."""
    resp = stub.Generate(request(chat_template_kwargs='{"enable_thinking": false}'))
    assert resp.reasoning_text == "" and resp.content.startswith("<think>Paris is a city.</think>")
