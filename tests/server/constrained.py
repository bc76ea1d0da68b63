"""Constrained requests the disaggregated and routed tests send to the tiny model (random
weights: only a grammar makes its output well formed): a JSON schema on a token-id prompt and a
required tool call in a conversation, and what a client reads from their answers.

The schema and the tool's parameters leave the model no free whitespace (llguidance lets a JSON
value be padded with whitespace by default; a random model pads until max_tokens), so each
answer is complete in a few tokens and checkable with ``jsonschema``."""
from __future__ import annotations

import json

import jsonschema

from jaxserve.v1 import jaxserve_pb2 as pb

from .conftest import IDS_A

COMPACT = {"x-guidance": {"whitespace_flexible": False}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "colour"], "additionalProperties": False}
UNIT = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}
WEATHER = pb.Tool(name="get_weather", description="The weather in a city", parameters=json.dumps(UNIT))
CLOCK = pb.Tool(name="get_time", parameters=json.dumps({"type": "object", "properties": {}}))
# The tools described in the system turn (the SmolLM2 template has no tool support) make a
# prompt of about 150 tokens: the disaggregated workers' max_model_len leaves room for the call.


def sampling(sampled: bool) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.9, top_k=40, seed=5) if sampled else pb.SamplingParams()


def schema_request(rid: str, sampled: bool = False) -> pb.GenerateRequest:
    """IDS_A under SCHEMA (greedy, or sampled with a seed)."""
    return pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=IDS_A), sampling=sampling(sampled),
                              stop=pb.StopCriteria(max_tokens=40),
                              structured=pb.StructuredOutput(json_schema=json.dumps(dict(SCHEMA, **COMPACT))))


def tool_request(rid: str, sampled: bool = False) -> pb.GenerateRequest:
    """A conversation that must call one of two tools (tool_choice required, one call)."""
    return pb.GenerateRequest(request_id=rid, messages=[pb.ChatMessage(role="user", content="Weather in Paris?")],
                              tools=[WEATHER, CLOCK], tool_choice=pb.ToolChoice(required=True),
                              parallel_tool_calls=False, sampling=sampling(sampled),
                              stop=pb.StopCriteria(max_tokens=60))


def check_schema_answer(resp: pb.GenerateResponse) -> None:
    assert resp.finish_reason == pb.FINISH_REASON_STOP, resp
    jsonschema.validate(json.loads(resp.text), SCHEMA)


def check_tool_answer(resp: pb.GenerateResponse) -> None:
    assert resp.finish_reason == pb.FINISH_REASON_TOOL_CALLS and len(resp.tool_calls) == 1, resp
    call = resp.tool_calls[0]
    schema = {"get_weather": UNIT, "get_time": {"type": "object", "additionalProperties": False}}[call.name]
    jsonschema.validate(json.loads(call.arguments), schema)


def assemble(events) -> dict:
    """A stream's events joined: token ids, text, parsed content and tool calls, finish reason."""
    out = dict(token_ids=[], text="", content="", calls={}, finish_reason=None)
    for ev in events:
        if ev.HasField("delta"):
            d = ev.delta
            out["token_ids"] += d.token_ids
            out["text"] += d.text
            out["content"] += d.content
            for c in d.tool_calls:
                old = out["calls"].get(c.index, ("", "", ""))
                out["calls"][c.index] = (old[0] or c.id, old[1] or c.name, old[2] + c.arguments)
        elif ev.HasField("end"):
            out["finish_reason"] = ev.end.finish_reason
    out["calls"] = [out["calls"][i] for i in sorted(out["calls"])]
    return out


def whole(resp: pb.GenerateResponse) -> dict:
    """A unary response in ``assemble``'s shape."""
    return dict(token_ids=list(resp.token_ids), text=resp.text, content=resp.content,
                calls=[(c.id, c.name, c.arguments) for c in resp.tool_calls], finish_reason=resp.finish_reason)
