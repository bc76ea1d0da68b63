"""The agent fields of a client's GenerateRequest (``jaxserve.client.build_request``): a
structured output, tools, the tool choice, and conversations with tool calls and results, from
the shapes a Python caller (or the OpenAI API) writes them in.

    structured:  {"json_schema": schema} (a dict or its JSON text) | {"json_object": True} |
                 {"regex": "..."} | {"grammar": "<Lark>"}, OpenAI's response_format
                 ({"type": "json_schema", "json_schema": {"schema": ...}} or {"type": "json_object"}),
                 or a pb.StructuredOutput
    tools:       OpenAI tools ({"type": "function", "function": {name, description, parameters}}),
                 bare functions ({name, description, parameters}) or pb.Tool
    tool_choice: "none" | "auto" | "required" | {"type": "function", "function": {"name": N}} |
                 {"name": N} (that function, enforced)
    messages:    {"role", "content"} plus OpenAI's tool fields: an assistant's "tool_calls"
                 ([{"id", "function": {"name", "arguments"}}]), a tool result's "tool_call_id"
                 and "name", an assistant's "reasoning_content"
"""
from __future__ import annotations

import json

from jaxserve.v1 import jaxserve_pb2 as pb

CHOICES = ("none", "auto", "required")


def _json_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def structured_output(spec) -> pb.StructuredOutput:
    """A StructuredOutput from any of the module doc's shapes; ValueError for another."""
    if isinstance(spec, pb.StructuredOutput):
        return spec
    if not isinstance(spec, dict):
        raise ValueError(f"structured must be a dict or a StructuredOutput, not {type(spec).__name__}")
    if "type" in spec:  # OpenAI's response_format
        if spec["type"] == "json_object":
            return pb.StructuredOutput(json_object=True)
        if spec["type"] == "json_schema" and isinstance(spec.get("json_schema"), dict):
            return pb.StructuredOutput(json_schema=_json_text(spec["json_schema"].get("schema", {})))
        raise ValueError(f"unsupported response_format {spec!r}: json_object or json_schema")
    if len(spec) != 1:
        raise ValueError("structured takes one of json_schema, json_object, regex, grammar")
    (kind, value), = spec.items()
    if kind == "json_schema":
        return pb.StructuredOutput(json_schema=_json_text(value))
    if kind == "json_object":
        return pb.StructuredOutput(json_object=bool(value))
    if kind in ("regex", "grammar"):
        return pb.StructuredOutput(**{kind: value})
    raise ValueError(f"unknown structured kind {kind!r}: json_schema, json_object, regex or grammar")


def tool(t) -> pb.Tool:
    if isinstance(t, pb.Tool):
        return t
    fn = t.get("function", t) if isinstance(t, dict) else None
    if not isinstance(fn, dict) or not fn.get("name"):
        raise ValueError(f"a tool needs a function name: {t!r}")
    params = fn.get("parameters")
    return pb.Tool(name=fn["name"], description=fn.get("description", ""),
                   parameters="" if params is None else _json_text(params))


def tool_choice(choice) -> pb.ToolChoice:
    if isinstance(choice, pb.ToolChoice):
        return choice
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise ValueError(f"tool_choice must be one of {', '.join(CHOICES)} or a function, not {choice!r}")
        return pb.ToolChoice(**{choice: True})
    fn = choice.get("function", choice) if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"a named tool_choice needs the function's name: {choice!r}")
    return pb.ToolChoice(function=name)


def chat_message(m: dict) -> pb.ChatMessage:
    calls = [pb.ToolCall(id=c.get("id") or "", name=c["function"]["name"],
                         arguments=_json_text(c["function"].get("arguments", {})))
             for c in m.get("tool_calls") or ()]
    return pb.ChatMessage(role=m["role"], content=m.get("content") or "", tool_calls=calls,
                          tool_call_id=m.get("tool_call_id") or "", name=m.get("name") or "",
                          reasoning_content=m.get("reasoning_content") or "")


def set_agent_fields(req: pb.GenerateRequest, structured=None, tools=None, tool_choice_=None,
                     parallel_tool_calls: bool | None = None, parse_output: bool | None = None,
                     chat_template_kwargs: dict | None = None) -> None:
    """Set the given agent fields on ``req`` (None: unset, the server's default)."""
    if structured is not None:
        req.structured.CopyFrom(structured_output(structured))
    req.tools.extend(tool(t) for t in tools or ())
    if tool_choice_ is not None:
        req.tool_choice.CopyFrom(tool_choice(tool_choice_))
    if parallel_tool_calls is not None:
        req.parallel_tool_calls = parallel_tool_calls
    if parse_output is not None:
        req.parse_output = parse_output
    if chat_template_kwargs:
        req.chat_template_kwargs = json.dumps(chat_template_kwargs)
