"""Reasoning blocks: ``<think>...</think>`` (Kimi K2 thinking models, GLM-4.5 and later) as the
message's ``reasoning_content``, apart from its answer.

The thinking starts at the output's first ``<think>`` if the output begins with one (after
whitespace), or at the output's start when the prompt already opened it (the chat template's
generation prompt ends with ``<think>``); it ends at ``</think>``. A thinking block never closed
is all reasoning.
"""
from __future__ import annotations

from jaxserve.agents.snapshot import until

OPEN, CLOSE = "<think>", "</think>"


class ThinkParser:
    name = "think"

    def __init__(self, opened_in_prompt: bool = False):
        self.opened_in_prompt = opened_in_prompt

    def split(self, text: str, final: bool) -> tuple[str, str, bool]:
        """-> (reasoning so far, the answer's text so far, whether the answer has begun)."""
        pos = 0
        if not self.opened_in_prompt:
            stripped = text.lstrip()
            if not stripped.startswith(OPEN):
                if not final and OPEN.startswith(stripped):
                    return "", "", False  # it may still become a <think>
                return "", text, True
            pos = len(text) - len(stripped) + len(OPEN)
        reasoning, after = until(text, pos, CLOSE, final)
        if after is None:
            return reasoning, "", False
        return reasoning, text[after:].lstrip(), True


def no_reasoning(text: str, final: bool) -> tuple[str, str, bool]:
    return "", text, True


