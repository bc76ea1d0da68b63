"""Kimi K2.x tool calls:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
    {JSON arguments}<|tool_call_end|>...<|tool_calls_section_end|>

(markers are special tokens: the text must keep them, skip_special_tokens off). The call id is
the model's own ``functions.NAME:IDX``; the arguments are the JSON text as written.
"""
from __future__ import annotations

from jaxserve.agents.snapshot import Call, Snapshot, scan, until

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARG_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
# The singular spellings some K2 outputs use for the section markers.
ALT = {"<|tool_call_section_begin|>": SECTION_BEGIN, "<|tool_call_section_end|>": SECTION_END}


def name_of(call_id: str) -> str:
    """functions.get_weather:0 -> get_weather (an id without the prefix / index is the name)."""
    name = call_id.strip()
    name = name.split(".", 1)[1] if name.startswith("functions.") else name
    return name.rsplit(":", 1)[0] if ":" in name else name


class KimiK2Parser:
    name = "kimi_k2"
    markers = (SECTION_BEGIN,)
    special_markers = True

    def parse(self, text: str, final: bool) -> Snapshot:
        for alt, canon in ALT.items():
            text = text.replace(alt, canon)
        return scan(text, SECTION_BEGIN, final, self._section)

    def _section(self, text: str, pos: int, final: bool, snap: Snapshot) -> int | None:
        """Calls from ``pos``; -> the position after the section's end (None: not ended yet)."""
        while True:
            nxt = [(text.find(m, pos), m) for m in (CALL_BEGIN, SECTION_END)]
            found = [(i, m) for i, m in nxt if i >= 0]
            if not found:
                return None
            i, m = min(found)
            if m == SECTION_END:
                return i + len(m)
            call_id, after = until(text, i + len(m), ARG_BEGIN, final)
            if after is None:
                return None  # the name is not complete
            call = Call(name_of(call_id), id=call_id.strip())
            snap.calls.append(call)
            call.arguments, end = until(text, after, CALL_END, final)
            if end is None:
                return None
            call.done, pos = True, end

