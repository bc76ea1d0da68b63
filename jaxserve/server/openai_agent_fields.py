"""The OpenAI API's agent fields in a request body: ``response_format`` (``json_object``,
``json_schema``) and vLLM's extensions (``structured_outputs`` {json, regex, grammar, choice},
``guided_json`` / ``guided_regex`` / ``guided_grammar`` / ``guided_choice``), ``tools`` /
``tool_choice`` / ``parallel_tool_calls`` and ``chat_template_kwargs``, parsed into the
front-neutral ``agent_plan.AgentRequest`` (whose cross-field rules and history messages are
``agent_plan``'s). Anything wrong is INVALID_ARGUMENT naming the
field at fault.
"""
from __future__ import annotations

import dataclasses
import json

from jaxserve.server import errors
from jaxserve.server.agent_plan import AgentRequest, check_choice, check_template_kwargs, check_tools
from jaxserve.structured.spec import StructuredOutput

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "grammar", "guided_choice": "choice"}


def _bad(msg: str, param: str):
    return errors.invalid_argument(msg, param)


def _spec(kind: str, value, param: str) -> StructuredOutput:
    try:
        if kind == "json":
            return StructuredOutput.json_schema(value)
        if kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
                raise ValueError("choice must be a non-empty list of strings")
            return StructuredOutput("grammar", "start: " + " | ".join(json.dumps(c) for c in value))
        if not isinstance(value, str):
            raise ValueError(f"{kind} must be a string")
        return StructuredOutput(kind, value)
    except (ValueError, TypeError) as e:
        raise _bad(f"{param}: {e}", param) from None


def _response_format(rf) -> StructuredOutput | None:
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise _bad("response_format must be {type: text | json_object | json_schema}", "response_format")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return StructuredOutput("json_object")
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema", {}), (dict, bool)):
        raise _bad("response_format.json_schema must be {name, schema, strict}", "response_format")
    return _spec("json", js.get("schema", {}), "response_format")


def structured(body: dict) -> tuple[StructuredOutput | None, str | None]:
    """The one grammar a body asks for, and its field (two at once: INVALID_ARGUMENT)."""
    found = []
    if body.get("response_format") is not None:
        spec = _response_format(body["response_format"])
        if spec is not None:
            found.append(("response_format", spec))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("structured_outputs must be an object {json | regex | grammar | choice}", "structured_outputs")
        for key in ("json", "regex", "grammar", "choice"):
            if so.get(key) is not None:
                found.append(("structured_outputs", _spec(key, so[key], "structured_outputs")))
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            found.append((name, _spec(kind, body[name], name)))
    if len(found) > 1:
        raise _bad(f"give one output constraint, not {len(found)} ({', '.join(f for f, _ in found)})", found[1][0])
    return (found[0][1], found[0][0]) if found else (None, None)


def _tools(body: dict) -> list[dict]:
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise _bad("tools must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"tools[{i}] must be {{type: function, function: {{name, parameters}}}}", "tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise _bad(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        out.append({"type": "function", "function": fn})
    return check_tools(out)


def parse(body: dict, chat: bool) -> AgentRequest:
    spec, field = structured(body)
    req = AgentRequest(structured=spec, field=field)
    if not chat:
        for name in ("tools", "tool_choice", "chat_template_kwargs"):
            if body.get(name) not in (None, [], {}):
                raise _bad(f"{name} needs /v1/chat/completions", name)
        return req
    req.tools = _tools(body)
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if req.tools else "none"
    if isinstance(choice, dict):
        choice = {"name": (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None}
    elif choice not in ("none", "auto", "required"):
        raise _bad("tool_choice must be none, auto, required or {type: function, function: {name}}", "tool_choice")
    req.tool_choice = check_choice(choice, req.tools, req.structured)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    req.parallel = parallel
    req.template_kwargs = check_template_kwargs(body.get("chat_template_kwargs") or {})
    return req
