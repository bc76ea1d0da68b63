"""Grammars (llguidance Lark) that make the model write a tool call in its own format, for
``tool_choice="required"`` or a named function: the call's name is one of the tools (or the
named one) and its arguments follow that tool's JSON schema. With ``parallel`` several calls
may follow one another.

``token(marker)`` gives how a marker is written in the grammar: ``<[id]>`` when the tokenizer
has it as one token (Kimi's and GLM's markers are special tokens), else a quoted string.
"""
from __future__ import annotations

import json
from typing import Callable


def _fn(tool: dict) -> dict:
    return tool.get("function", tool)


def _params(tool: dict) -> dict:
    """The arguments' schema; an object schema that does not say otherwise takes no properties
    beyond its own (as OpenAI's strict function calling has it: extra keys are no call's)."""
    p = _fn(tool).get("parameters")
    p = dict(p) if isinstance(p, dict) and p else {"type": "object", "properties": {}}
    if p.get("type") == "object" and "additionalProperties" not in p:
        p["additionalProperties"] = False
    return p


def _json(schema) -> str:
    """A JSON value in the grammar: compact (", " and ": " separators, no other whitespace), so
    a model cannot pad a call with whitespace until max_tokens."""
    if isinstance(schema, dict):
        schema = dict(schema, **{"x-guidance": {"whitespace_flexible": False, "item_separator": ", ",
                                                "key_separator": ": "}})
    return "%json " + json.dumps(schema, separators=(",", ":"))


def _q(text: str) -> str:
    return json.dumps(text)


def hermes(tools: list[dict], parallel: bool, token: Callable[[str], str]) -> str:
    schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": _fn(t)["name"]}, "arguments": _params(t)},
                         "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}
    call = f'{token("<tool_call>")} "\\n" {_json(schema)} "\\n" {token("</tool_call>")}'
    more = ' ("\\n" call)*' if parallel else ""
    return f"start: call{more}\ncall: {call}\n"


def kimi_k2(tools: list[dict], parallel: bool, token: Callable[[str], str]) -> str:
    alts = [f'{_q("functions." + _fn(t)["name"] + ":")} /[0-9]+/ {token("<|tool_call_argument_begin|>")} '
            f'{_json(_params(t))}' for t in tools]
    rules = "\n".join(f"call{i}: {token('<|tool_call_begin|>')} {a} {token('<|tool_call_end|>')}"
                      for i, a in enumerate(alts))
    call = " | ".join(f"call{i}" for i in range(len(tools)))
    reps = "+" if parallel else ""
    return (f"start: {token('<|tool_calls_section_begin|>')} (call){reps} {token('<|tool_calls_section_end|>')}\n"
            f"call: {call}\n{rules}\n")


def glm(tools: list[dict], parallel: bool, token: Callable[[str], str], newlines: bool = True) -> str:
    nl = ' "\\n"' if newlines else ""
    rules, names = [], []
    for i, t in enumerate(tools):
        p = _params(t)
        props, required = p.get("properties") or {}, set(p.get("required") or ())
        pairs = []
        for j, (k, sub) in enumerate(props.items()):
            value = "/[^<]*/" if (sub or {}).get("type") == "string" else _json(sub or {})
            pair = f'{token("<arg_key>")} {_q(k)} {token("</arg_key>")}{nl} {token("<arg_value>")} {value} ' \
                   f'{token("</arg_value>")}{nl}'
            pairs.append(pair if k in required else f"({pair})?")
        names.append(f"call{i}")
        rules.append(f'call{i}: {token("<tool_call>")} {_q(_fn(t)["name"])}{nl} {" ".join(pairs)} '
                     f'{token("</tool_call>")}')
    more = ' ("\\n" call)*' if parallel else ""
    return f"start: call{more}\ncall: {' | '.join(names)}\n" + "\n".join(rules) + "\n"


BUILDERS = {"hermes": hermes, "kimi_k2": kimi_k2, "glm45": glm,
            "glm47": lambda tools, parallel, token: glm(tools, parallel, token, newlines=False)}


def tool_call_grammar(parser: str, tools: list[dict], parallel: bool, token: Callable[[str], str]) -> str:
    return BUILDERS[parser](tools, parallel, token)


def marker_token(tokenizer) -> Callable[[str], str]:
    """The ``token`` function for a jaxserve Tokenizer."""
    def token(marker: str) -> str:
        tid = tokenizer.backend.token_to_id(marker) if tokenizer is not None else None
        return f"<[{tid}]>" if tid is not None else _q(marker)
    return token
