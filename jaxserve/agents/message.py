"""A whole assistant message from its text: reasoning, content and tool calls, at once
(``final``) or as OpenAI's stream deltas (``MessageStream``), the one the sum of the other."""
from __future__ import annotations

from typing import Callable

from jaxserve.agents.reasoning import ThinkParser
from jaxserve.agents.snapshot import Snapshot


class MessageParser:
    """``tools``: a tool-call parser (None: the answer is all content); ``reasoning``: a
    ThinkParser (None: no reasoning block)."""

    def __init__(self, tools=None, reasoning: ThinkParser | None = None):
        self.tools, self.reasoning = tools, reasoning

    def parse(self, text: str, final: bool) -> Snapshot:
        reasoning, answer, begun = ("", text, True) if self.reasoning is None else self.reasoning.split(text, final)
        if not begun:
            return Snapshot(reasoning=reasoning)
        snap = self.tools.parse(answer, final) if self.tools is not None else Snapshot(content=answer)
        snap.reasoning = reasoning
        return snap


def message(snap: Snapshot, call_id: Callable[[int], str]) -> dict:
    """OpenAI's assistant message (content None when it is only tool calls)."""
    msg = {"role": "assistant", "content": snap.content if snap.content or not snap.calls else None}
    if snap.reasoning:
        msg["reasoning_content"] = snap.reasoning
    if snap.calls:
        msg["tool_calls"] = [{"id": c.id or call_id(i), "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}}
                             for i, c in enumerate(snap.calls)]
    return msg


class MessageStream:
    """Text deltas in, OpenAI delta dicts out (``push``; ``finish`` at the end)."""

    def __init__(self, parser: MessageParser, call_id: Callable[[int], str]):
        self.parser, self.call_id = parser, call_id
        self.text = ""
        self.last = Snapshot()

    def push(self, text: str) -> list[dict]:
        self.text += text
        return self._diff(self.parser.parse(self.text, final=False))

    def finish(self) -> list[dict]:
        return self._diff(self.parser.parse(self.text, final=True))

    @property
    def has_calls(self) -> bool:
        return bool(self.last.calls)

    def _diff(self, snap: Snapshot) -> list[dict]:
        out, last = [], self.last
        for field, key in (("reasoning", "reasoning_content"), ("content", "content")):
            new, old = getattr(snap, field), getattr(last, field)
            if len(new) > len(old) and new.startswith(old):
                out.append({key: new[len(old):]})
        for i, c in enumerate(snap.calls):
            if i >= len(last.calls):
                out.append({"tool_calls": [{"index": i, "id": c.id or self.call_id(i), "type": "function",
                                            "function": {"name": c.name, "arguments": c.arguments}}]})
            else:
                old = last.calls[i].arguments
                if len(c.arguments) > len(old) and c.arguments.startswith(old):
                    out.append({"tool_calls": [{"index": i, "function": {"arguments": c.arguments[len(old):]}}]})
        self.last = _merged(last, snap)
        return out


def _merged(last: Snapshot, snap: Snapshot) -> Snapshot:
    """What has been streamed: ``snap`` where it extends ``last`` (it always does; a field that
    did not is kept as streamed, so nothing is sent twice)."""
    keep = lambda new, old: new if new.startswith(old) else old  # noqa: E731
    calls = [c if i >= len(last.calls) else type(c)(c.name, keep(c.arguments, last.calls[i].arguments), c.done, c.id)
             for i, c in enumerate(snap.calls)]
    calls += last.calls[len(calls):]
    return Snapshot(keep(snap.content, last.content), calls, keep(snap.reasoning, last.reasoning))
