"""Agent requests on gRPC: ``GenerateRequest``'s tools, tool_choice, parallel_tool_calls,
chat_template_kwargs and parse_output (and ChatMessage's tool fields) parsed into the shared
``agent_plan.AgentRequest`` and planned by the shared ``AgentFront``, as the OpenAI API does;
the output parsed into content, reasoning_text and tool_calls (``AgentOutput``: whole for
Generate, deltas for GenerateStream, the deltas' sum equal to the whole).

A request that sets none of the agent fields takes none of this (``wanted`` is False): its
responses are byte for byte what they were before the fields existed.
"""
from __future__ import annotations

import dataclasses
import json

from jaxserve.agents.message import MessageParser, MessageStream
from jaxserve.server import agent_plan, convert, errors, validate
from jaxserve.server.limits import check_chat
from jaxserve.v1 import jaxserve_pb2 as pb

CHOICE_KINDS = ("none", "auto", "required")


def parses(req: pb.GenerateRequest) -> bool:
    """parse_output, or by default: on when tools or chat_template_kwargs are given."""
    return req.parse_output if req.HasField("parse_output") else bool(req.tools or req.chat_template_kwargs)


def wanted(req: pb.GenerateRequest) -> bool:
    """Whether the request takes the agent path (an agent field set; parse_output false alone is
    the default path); agent fields need messages."""
    fields = [name for name, on in (
        ("tools", bool(req.tools)), ("tool_choice", req.HasField("tool_choice")),
        ("parallel_tool_calls", req.HasField("parallel_tool_calls")),
        ("chat_template_kwargs", bool(req.chat_template_kwargs)), ("parse_output", req.parse_output))
        if on]
    if fields and not req.messages:
        raise errors.invalid_argument(f"{fields[0]} needs messages (a chat request)", fields[0])
    return bool(fields)


def tools(req: pb.GenerateRequest) -> list[dict]:
    out = []
    for i, t in enumerate(req.tools):
        if not t.name:
            raise errors.invalid_argument(f"tools[{i}].name is empty", "tools")
        try:
            params = json.loads(t.parameters) if t.parameters.strip() else {}
        except ValueError:
            params = None
        if not isinstance(params, dict):
            raise errors.invalid_argument(f"tools[{i}].parameters must be a JSON schema object", "tools")
        fn = {"name": t.name, "parameters": params}
        if t.description:
            fn["description"] = t.description
        out.append({"type": "function", "function": fn})
    return agent_plan.check_tools(out)


def agent_request(req: pb.GenerateRequest) -> agent_plan.AgentRequest:
    """The request's agent fields; INVALID_ARGUMENT naming the field at fault."""
    spec = convert.structured_output(req.structured) if req.HasField("structured") else None
    agent = agent_plan.AgentRequest(structured=spec, field="structured", tools=tools(req))
    kind = req.tool_choice.WhichOneof("kind") if req.HasField("tool_choice") else None
    if kind is None:
        choice = "auto" if agent.tools else "none"
    else:
        choice = {"name": req.tool_choice.function} if kind == "function" else kind
    agent.tool_choice = agent_plan.check_choice(choice, agent.tools, spec)
    agent.parallel = req.parallel_tool_calls if req.HasField("parallel_tool_calls") else True
    kwargs = {}
    if req.chat_template_kwargs:
        try:
            kwargs = json.loads(req.chat_template_kwargs)
        except ValueError:
            raise errors.invalid_argument("chat_template_kwargs is not JSON", "chat_template_kwargs") from None
    agent.template_kwargs = agent_plan.check_template_kwargs(kwargs)
    return agent


def messages(req: pb.GenerateRequest, max_messages: int) -> list[dict]:
    """ChatMessages as chat templates read them (OpenAI's shape: tool_calls, tool_call_id, name)."""
    dicts, reasoning = [], {}
    for i, m in enumerate(req.messages):
        d = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id or None, "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments}} for c in m.tool_calls]
        d.update({k: getattr(m, k) for k in ("tool_call_id", "name") if getattr(m, k)})
        if m.reasoning_content:
            reasoning[i] = m.reasoning_content
        dicts.append(d)
    out = agent_plan.check_messages(dicts, lambda ms: validate.messages(ms, max_messages, "messages"))
    return [dict(m, reasoning_content=reasoning[i]) if i in reasoning else m for i, m in enumerate(out)]


def render(front: agent_plan.AgentFront, req: pb.GenerateRequest, agent, max_messages: int) -> tuple[list[int], str]:
    """-> (prompt ids, prompt text): the messages through the chat template with the tools."""
    if front.tokenizer is None:
        raise errors.failed_precondition("this model has no tokenizer: chat messages need the model's "
                                         "tokenizer and chat template")
    if req.WhichOneof("prompt") is not None or req.apply_chat_template:
        raise errors.invalid_argument("set messages or a prompt (text / token_ids), not both")
    text = front.render(messages(req, max_messages), agent)
    return convert.encode_text(front.tokenizer, text, False), text


async def plan(core, front: agent_plan.AgentFront, req: pb.GenerateRequest, params: list):
    """-> (prompt ids, choice params under the plan, AgentOutput factory or None): checks,
    renders off the event loop, plans, and refuses a grammar that cannot compile. Errors name
    the field at fault in their message (gRPC has no separate field for it)."""
    try:
        check_chat(req.messages, core.limits, tool_texts(req))  # before parsing the tools and templating
        agent = agent_request(req)
        ids, text = await core.off_loop(text_of(req), render, front, req, agent, core.limits.max_messages)
        p = front.plan(True, agent, text)
        params = [dataclasses.replace(s, **p.sampling()) for s in params]
        if p.structured is not None:
            await agent_plan.check_grammar(core.check_structured, agent, p.structured)
    except errors.ServeError as e:
        if e.param and not e.message.startswith(e.param):
            e.message = f"{e.param}: {e.message}"
        raise
    return ids, params, (p if parses(req) else None)


def tool_texts(req: pb.GenerateRequest) -> list[str]:
    """Each tool's definition as sent (what --max-prompt-bytes counts beside the messages)."""
    return [t.name + t.description + t.parameters for t in req.tools]


def text_of(req: pb.GenerateRequest) -> str:
    """What off_loop sizes the work by: the conversation's text."""
    return "".join(m.content for m in req.messages)


class AgentOutput:
    """One request's parsed output, per choice: ``whole`` fills a GenerateResponse; ``delta`` /
    ``end`` give a stream's TokenDelta fields (their sum is ``whole``'s)."""

    def __init__(self, p: agent_plan.Plan, request_id: str, n: int, metrics, parser_name: str):
        self.parser = p.parser or MessageParser()  # nothing to parse: the text is all content
        self.request_id, self.metrics, self.parser_name = request_id, metrics, parser_name
        self.streams = [MessageStream(self.parser, agent_plan.call_ids(request_id, i)) for i in range(n)]

    def whole(self, resp: pb.GenerateResponse, texts: list[str]) -> pb.GenerateResponse:
        choices = list(resp.choices) or [resp]
        for i, text in enumerate(texts):
            snap = self.parser.parse(text, final=True)
            agent_plan.count_calls(self.metrics, self.parser_name, snap.calls)
            call_id = agent_plan.call_ids(self.request_id, i)
            calls = [pb.ToolCall(id=c.id or call_id(j), name=c.name, arguments=c.arguments)
                     for j, c in enumerate(snap.calls)]
            targets = [resp, choices[i]] if i == 0 and resp.choices else [choices[i]]
            for t in targets:
                t.content, t.reasoning_text = snap.content, snap.reasoning
                t.tool_calls.extend(calls)
                if calls and t.finish_reason == pb.FINISH_REASON_STOP:
                    t.finish_reason = pb.FINISH_REASON_TOOL_CALLS
        return resp

    def delta(self, i: int, text: str) -> dict:
        return fields(self.streams[i].push(text))

    def end(self, i: int) -> dict:
        """The last pieces (held back until the end); counts the choice's calls."""
        s = self.streams[i]
        out = fields(s.finish())
        agent_plan.count_calls(self.metrics, self.parser_name, s.last.calls)
        return out

    def reason(self, i: int, reason: int) -> int:
        calls = self.streams[i].has_calls
        return pb.FINISH_REASON_TOOL_CALLS if calls and reason == pb.FINISH_REASON_STOP else reason


def fields(pieces: list[dict]) -> dict:
    """MessageStream's OpenAI-shaped deltas -> TokenDelta keyword arguments."""
    out = {"content": "", "reasoning_text": "", "tool_calls": []}
    for d in pieces:
        out["content"] += d.get("content", "")
        out["reasoning_text"] += d.get("reasoning_content", "")
        for c in d.get("tool_calls", ()):
            fn = c.get("function", {})
            out["tool_calls"].append(pb.ToolCallDelta(index=c["index"], id=c.get("id") or "", name=fn.get("name", ""),
                                                      arguments=fn.get("arguments", "")))
    return {k: v for k, v in out.items() if v}
