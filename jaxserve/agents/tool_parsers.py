"""Tool-call parsers by name, and the one a checkpoint gets (``--tool-call-parser`` overrides)."""
from __future__ import annotations

from jaxserve.agents.glm import Glm47Parser, GlmParser
from jaxserve.agents.hermes import HermesParser
from jaxserve.agents.kimi_k2 import KimiK2Parser

PARSERS = {"kimi_k2": KimiK2Parser, "glm45": GlmParser, "glm47": Glm47Parser, "hermes": HermesParser}
REASONING_PARSERS = ("think", "none")


def make(name: str, tools=None):
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(PARSERS)}")
    cls = PARSERS[name]
    return cls(tools) if issubclass(cls, GlmParser) else cls()


def choose(architecture: str, model_type: str, chat_template: str | None) -> str:
    """The format a checkpoint's model writes: from its chat template's markers, then its
    architecture; Hermes-style JSON for anything else."""
    t = chat_template or ""
    if "<|tool_calls_section_begin|>" in t or "<|tool_call_begin|>" in t or model_type in ("kimi_k2", "kimi_k25"):
        return "kimi_k2"
    if "<arg_key>" in t or architecture in ("Glm4MoeForCausalLM", "GlmMoeDsaForCausalLM"):
        glm47 = architecture == "GlmMoeDsaForCausalLM" or "</arg_key><arg_value>" in t
        return "glm47" if glm47 else "glm45"
    return "hermes"


def choose_reasoning(chat_template: str | None) -> str:
    """"think" when the chat template knows a <think> block, else "none"."""
    return "think" if "<think>" in (chat_template or "") or "</think>" in (chat_template or "") else "none"
