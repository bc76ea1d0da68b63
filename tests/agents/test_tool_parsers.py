"""Tool-call and reasoning parsers on the exact strings each model's format produces: the whole
text, and streamed with a split at every character boundary (two pieces) and one character at
a time; the assembled stream must equal the whole parse."""
import json

import pytest

from jaxserve.agents import tool_parsers
from jaxserve.agents.message import MessageParser, MessageStream, message
from jaxserve.agents.reasoning import ThinkParser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "opts": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
NESTED = {"city": "Zürich \"centre\"", "opts": {"units": ["c", "f"], "deep": {"x": [1, {"y": None}]}}}

K = dict(sb="<|tool_calls_section_begin|>", se="<|tool_calls_section_end|>", cb="<|tool_call_begin|>",
         ab="<|tool_call_argument_begin|>", ce="<|tool_call_end|>")


def kimi_call(name, idx, args):
    return f"{K['cb']}functions.{name}:{idx}{K['ab']}{json.dumps(args, ensure_ascii=False)}{K['ce']}"


def glm_call(name, args, nl):
    n = "\n" if nl else ""
    pairs = "".join(f"<arg_key>{k}</arg_key>{n}<arg_value>{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
                    f"</arg_value>{n}" for k, v in args.items())
    return f"<tool_call>{name}{n}{pairs}</tool_call>"


def hermes_call(name, args):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n</tool_call>"


# parser, text, expected content, expected [(name, arguments as a dict)]
CASES = [
    ("kimi_k2", "Let me check." + K["sb"] + kimi_call("get_weather", 0, {"city": "Paris"}) + K["se"],
     "Let me check.", [("get_weather", {"city": "Paris"})]),
    ("kimi_k2", K["sb"] + kimi_call("now", 0, {}) + kimi_call("get_weather", 1, NESTED) + K["se"] + " done",
     " done", [("now", {}), ("get_weather", NESTED)]),
    ("kimi_k2", "no calls here, just <|tool text", "no calls here, just <|tool text", []),
    ("glm45", "Sure.\n" + glm_call("get_weather", {"city": "Paris", "days": 3}, True), "Sure.\n",
     [("get_weather", {"city": "Paris", "days": 3})]),
    ("glm45", glm_call("now", {}, True) + "\n" + glm_call("get_weather", NESTED, True) + " after",
     "\n after", [("now", {}), ("get_weather", NESTED)]),
    ("glm47", "x" + glm_call("get_weather", {"city": "東京", "days": 2}, False) + glm_call("now", {}, False),
     "x", [("get_weather", {"city": "東京", "days": 2}), ("now", {})]),
    ("glm47", glm_call("get_weather", NESTED, False), "", [("get_weather", NESTED)]),
    ("hermes", "Checking.\n" + hermes_call("get_weather", NESTED) + "\nok", "Checking.\n\nok",
     [("get_weather", NESTED)]),
    ("hermes", hermes_call("now", {}) + hermes_call("get_weather", {"city": "a\\b \"q\" ☃"}), "",
     [("now", {}), ("get_weather", {"city": "a\\b \"q\" ☃"})]),
    ("hermes", "a <tool_call> that is not JSON </tool_call> b", "a <tool_call> that is not JSON </tool_call> b", []),
]


def assemble(deltas):
    content, reasoning, calls = "", "", {}
    for d in deltas:
        content += d.get("content", "")
        reasoning += d.get("reasoning_content", "")
        for tc in d.get("tool_calls", []):
            c = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in tc:
                assert c["id"] is None, "a call's id is sent once"
                c["id"], c["name"] = tc["id"], tc["function"]["name"]
            c["arguments"] += tc["function"].get("arguments", "")
    return content, reasoning, [calls[i] for i in sorted(calls)]


def ids(i):
    return f"call_{i}"


def streamed(parser, pieces):
    s = MessageStream(parser, ids)
    out = []
    for p in pieces:
        out += s.push(p)
    return assemble(out + s.finish())


def whole(parser, text):
    msg = message(parser.parse(text, final=True), ids)
    calls = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in msg.get("tool_calls", [])]
    return msg["content"] or "", msg.get("reasoning_content", ""), calls


@pytest.mark.parametrize("name,text,content,calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_whole_and_every_split(name, text, content, calls):
    parser = MessageParser(tool_parsers.make(name, TOOLS))
    got = whole(parser, text)
    assert got[0] == content
    assert [(c["name"], json.loads(c["arguments"])) for c in got[2]] == calls
    if name == "kimi_k2":
        assert [c["id"] for c in got[2]] == [f"functions.{n}:{i}" for i, (n, _) in enumerate(calls)]
    for k in range(len(text) + 1):
        assert streamed(parser, [text[:k], text[k:]]) == got, k
    assert streamed(parser, list(text)) == got


THINK = [
    (False, "<think>Paris is in France.</think>\n\nParis.", "Paris is in France.", "Paris."),
    (True, "Let me think... <b></think>The answer.", "Let me think... <b>", "The answer."),
    (False, "No thinking here.", "", "No thinking here."),
    (False, "<think>never closed", "never closed", ""),
]


@pytest.mark.parametrize("opened,text,reasoning,content", THINK)
def test_reasoning_split_at_every_boundary(opened, text, reasoning, content):
    parser = MessageParser(None, ThinkParser(opened))
    got = whole(parser, text)
    assert got[:2] == (content, reasoning)
    for k in range(len(text) + 1):
        assert streamed(parser, [text[:k], text[k:]]) == got
    assert streamed(parser, list(text)) == got


def test_reasoning_then_tool_calls():
    text = "<think>I need the weather.</think>" + K["sb"] + kimi_call("get_weather", 0, {"city": "Oslo"}) + K["se"]
    parser = MessageParser(tool_parsers.make("kimi_k2"), ThinkParser(False))
    got = whole(parser, text)
    assert got[1] == "I need the weather." and got[2][0]["name"] == "get_weather"
    for k in range(len(text) + 1):
        assert streamed(parser, [text[:k], text[k:]]) == got


def test_parser_chosen_from_the_checkpoint():
    assert tool_parsers.choose("KimiK25ForConditionalGeneration", "kimi_k25", None) == "kimi_k2"
    assert tool_parsers.choose("Glm4MoeForCausalLM", "glm4_moe", "<arg_key>{{k}}</arg_key>\n<arg_value>") == "glm45"
    assert tool_parsers.choose("Glm4MoeForCausalLM", "glm4_moe", "<arg_key>{{k}}</arg_key><arg_value>") == "glm47"
    assert tool_parsers.choose("GlmMoeDsaForCausalLM", "glm_moe_dsa", None) == "glm47"
    assert tool_parsers.choose("LlamaForCausalLM", "llama", "{{ messages }}") == "hermes"
    assert tool_parsers.choose_reasoning("{{ '<think>' }}") == "think"
    assert tool_parsers.choose_reasoning("plain") == "none"
