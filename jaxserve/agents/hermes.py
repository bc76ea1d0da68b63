"""Hermes-style JSON tool calls, the fallback for models without a format of their own (the
default model):

    <tool_call>
    {"name": "NAME", "arguments": {...}}
    </tool_call>

A call is known once its closing tag is there (or, at the end of the output, once the text
after the opening tag is a JSON object with a name); an opening tag followed by anything else
is content.
"""
from __future__ import annotations

import json

from jaxserve.agents.snapshot import Call, Snapshot, until

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def read_call(body: str) -> Call | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return Call(obj["name"], text, done=True)


class HermesParser:
    name = "hermes"
    markers = (OPEN,)
    special_markers = False

    def parse(self, text: str, final: bool) -> Snapshot:
        snap, pos = Snapshot(), 0
        while True:
            piece, after = until(text, pos, OPEN, final)
            snap.content += piece
            if after is None:
                return snap
            body, end = until(text, after, CLOSE, True)
            call = read_call(body)
            if end is None and not final:
                return snap  # wait for the closing tag
            if call is None:  # not a call after all: the tag and what follows are content
                snap.content += text[after - len(OPEN): end if end is not None else len(text)]
            else:
                snap.calls.append(call)
            if end is None:
                return snap
            pos = end
