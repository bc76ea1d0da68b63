"""The OpenAI API's agent fields in a request body: ``response_format`` (``json_object``,
``json_schema``) and vLLM's extensions (``structured_outputs`` {json, regex, grammar, choice},
``guided_json`` / ``guided_regex`` / ``guided_grammar`` / ``guided_choice``), ``tools`` /
``tool_choice`` / ``parallel_tool_calls``, ``chat_template_kwargs``, and messages with
``role: "tool"`` or an assistant's ``tool_calls``. Anything wrong is INVALID_ARGUMENT naming the
field at fault.
"""
from __future__ import annotations

import dataclasses
import json

from jaxserve.server import errors
from jaxserve.structured.spec import StructuredOutput

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "grammar", "guided_choice": "choice"}


@dataclasses.dataclass
class AgentRequest:
    structured: StructuredOutput | None = None  # the response format (the answer's grammar)
    tools: list = dataclasses.field(default_factory=list)
    tool_choice: object = "auto"  # "none" | "auto" | "required" | the named function's name (str in a dict)
    parallel: bool = True
    template_kwargs: dict = dataclasses.field(default_factory=dict)
    field: str | None = None  # the body field the response format came from (for error reports)

    @property
    def named(self) -> str | None:
        return self.tool_choice["name"] if isinstance(self.tool_choice, dict) else None


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
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        raise _bad("tools: function names must be unique", "tools")
    return out


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
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str) or name not in {t["function"]["name"] for t in req.tools}:
            raise _bad("tool_choice names a function that is not in tools", "tool_choice")
        choice = {"name": name}
    elif choice not in ("none", "auto", "required"):
        raise _bad("tool_choice must be none, auto, required or {type: function, function: {name}}", "tool_choice")
    if choice == "required" and not req.tools:
        raise _bad("tool_choice required needs tools", "tool_choice")
    if (choice == "required" or isinstance(choice, dict)) and req.structured is not None:
        raise _bad("a required or named tool choice and a response format cannot both constrain the output",
                   "tool_choice")
    req.tool_choice = choice
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    req.parallel = parallel
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or any(k in ("messages", "tools", "add_generation_prompt") for k in kwargs):
        raise _bad("chat_template_kwargs must be an object (not messages, tools or add_generation_prompt)",
                   "chat_template_kwargs")
    req.template_kwargs = kwargs
    return req


def check_messages(messages, check) -> list[dict]:
    """Chat messages: {role, content} as ``check`` (the plain messages' validator) takes them, plus a tool's
    result (role "tool", tool_call_id) and an assistant's tool_calls (content may be empty;
    each call's JSON arguments become a dict, as chat templates read them)."""
    plain, extra = [], {}
    for i, m in enumerate(messages or []):
        m = dict(m)
        calls = m.get("tool_calls")
        if calls is not None:
            if m.get("role") != "assistant" or not isinstance(calls, list):
                raise errors.invalid_argument(f"messages[{i}].tool_calls: only an assistant's, as a list")
            extra[i] = {"tool_calls": [_history_call(c, i) for c in calls]}
            if m.get("content") is None:
                m["content"] = ""
        if m.get("role") == "tool":
            tid = m.get("tool_call_id")
            if tid is not None and not isinstance(tid, str):
                raise errors.invalid_argument(f"messages[{i}].tool_call_id must be a string")
            extra.setdefault(i, {}).update({k: m[k] for k in ("tool_call_id", "name") if m.get(k) is not None})
        plain.append(m)
    out = check(plain)
    return [dict(m, **extra.get(i, {})) for i, m in enumerate(out)]


def _history_call(c, i: int) -> dict:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise errors.invalid_argument(f"messages[{i}].tool_calls: each needs function.name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise errors.invalid_argument(f"messages[{i}].tool_calls: arguments are not JSON") from None
    return {"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}
