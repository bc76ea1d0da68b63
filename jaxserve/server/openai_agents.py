"""Agent results on the OpenAI API: each choice's assistant message from its whole text
(``whole_messages``) and stream chunk choices (``delta_choices``); the plan they follow is
``jaxserve.server.agent_plan`` (shared with gRPC), the request fields ``openai_agent_fields``.
"""
from __future__ import annotations

from jaxserve.agents.message import message
from jaxserve.server.agent_plan import Plan, call_ids, count_calls


def whole_messages(plan: Plan, choices: list[dict], texts: list[str], request_id: str, metrics, parser: str):
    """Each choice's message from its whole text (content, reasoning, tool calls)."""
    for i, ch in enumerate(choices):
        snap = plan.parser.parse(texts[i], final=True)
        count_calls(metrics, parser, snap.calls)
        ch["message"] = message(snap, call_ids(request_id, i))
        if snap.calls and ch["finish_reason"] == "stop":
            ch["finish_reason"] = "tool_calls"


def delta_choices(index: int, deltas: list[dict], logprobs):
    """Stream chunk choices, one per parsed delta (the token log-probs on the first; alone if none)."""
    if not deltas and logprobs is not None:
        deltas = [{"content": ""}]
    for j, d in enumerate(deltas):
        yield {"index": index, "delta": d, "logprobs": logprobs if j == 0 else None, "finish_reason": None}
