"""GLM-4.5/4.6 and GLM-4.7/5 tool calls:

    <tool_call>NAME
    <arg_key>KEY</arg_key>
    <arg_value>VALUE</arg_value>
    </tool_call>

(4.7/5 write the same without the newlines). A value is text: kept as a string when the tool's
schema says the parameter is a string (or says nothing and it is not JSON), else read as JSON
(numbers, booleans, objects). The arguments are built as JSON text pair by pair, so the stream
gives each pair once it is complete and the closing brace with the call's end.
"""
from __future__ import annotations

import json

from jaxserve.agents.snapshot import Call, Snapshot, scan, until

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY, KEY_END, VALUE, VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"


def param_types(tools) -> dict[str, dict[str, object]]:
    """tool name -> {parameter: its JSON-schema type} from OpenAI's tools list."""
    out = {}
    for t in tools or ():
        fn = t.get("function", t) if isinstance(t, dict) else {}
        props = ((fn.get("parameters") or {}).get("properties") or {}) if isinstance(fn, dict) else {}
        out[fn.get("name")] = {k: (v or {}).get("type") for k, v in props.items() if isinstance(v, dict)}
    return out


def value_json(raw: str, kind) -> str:
    """One argument's value as JSON text."""
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return json.dumps(raw, ensure_ascii=False)
    try:
        return json.dumps(json.loads(raw.strip()), ensure_ascii=False)
    except ValueError:
        return json.dumps(raw, ensure_ascii=False)


class GlmParser:
    name = "glm45"
    markers = (OPEN,)
    special_markers = True

    def __init__(self, tools=None):
        self.types = param_types(tools)

    def parse(self, text: str, final: bool) -> Snapshot:
        return scan(text, OPEN, final, self._call)

    def _call(self, text: str, pos: int, final: bool, snap: Snapshot) -> int | None:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        ends = [i for i in (text.find("\n", pos), text.find(KEY, pos), text.find(CLOSE, pos)) if i >= 0]
        if not ends:
            if final and text[pos:].strip():
                snap.calls.append(Call(text[pos:].strip(), "{}"))
            return None
        name_end = min(ends)
        call = Call(text[pos:name_end].strip())
        snap.calls.append(call)
        types, pos, pairs = self.types.get(call.name, {}), name_end, []
        while True:
            k, c = text.find(KEY, pos), text.find(CLOSE, pos)
            if c >= 0 and (k < 0 or c < k):  # the call's end
                call.arguments, call.done = _args(pairs, True), True
                return c + len(CLOSE)
            if k < 0:
                break
            key, after = until(text, k + len(KEY), KEY_END, final)
            v = text.find(VALUE, after) if after is not None else -1
            if v < 0:
                break
            value, end = until(text, v + len(VALUE), VALUE_END, False)
            if end is None:
                break
            pairs.append((key.strip(), value_json(value, types.get(key.strip()))))
            pos = end
        call.arguments = _args(pairs, final)
        return None


def _args(pairs, closed: bool) -> str:
    body = ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {v}" for k, v in pairs)
    return "{" + body + ("}" if closed else "")


class Glm47Parser(GlmParser):
    name = "glm47"
