"""The grammars that enforce a required / named tool call accept exactly the calls of each
format (driven token by token through llguidance, with the markers as special tokens where the
model's tokenizer has them) and refuse a call to another tool or with arguments off its schema."""
import json

import pytest
import tokenizers

from jaxserve.agents import kimi_k2
from jaxserve.agents.tool_grammar import marker_token, tool_call_grammar
from jaxserve.checkpoint.gguf import default_model_dir
from jaxserve.structured.compiler import GrammarCompiler
from jaxserve.structured.spec import StructuredOutput
from jaxserve.tokenizer import Tokenizer
from tests.agents.test_tool_parsers import glm_call, hermes_call, kimi_call

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
SPECIALS = [kimi_k2.SECTION_BEGIN, kimi_k2.SECTION_END, kimi_k2.CALL_BEGIN, kimi_k2.ARG_BEGIN, kimi_k2.CALL_END,
            "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]


@pytest.fixture(scope="module")
def tok():
    """The default model's tokenizer with the Kimi / GLM markers added as special tokens."""
    backend = tokenizers.Tokenizer.from_file(str(default_model_dir(progress=False) / "tokenizer.json"))
    backend.add_special_tokens(SPECIALS)
    t = Tokenizer(backend, eos_token="<|im_end|>")
    return t, GrammarCompiler(t, t.vocab_size, t.eos_token_ids)


def accepts(tok, fmt, text, tools=TOOLS, parallel=True) -> bool:
    t, comp = tok
    m = comp.matcher(StructuredOutput("grammar", tool_call_grammar(fmt, tools, parallel, marker_token(t))))
    ids = t.encode(text, add_special_tokens=False)
    return all(m.consume_token(i) for i in ids) and m.is_accepting()


KIMI = kimi_k2.SECTION_BEGIN + "{}" + kimi_k2.SECTION_END


@pytest.mark.parametrize("fmt,good,bad", [
    ("kimi_k2", KIMI.format(kimi_call("get_weather", 0, {"city": "Oslo", "days": 2}) + kimi_call("now", 1, {})),
     KIMI.format(kimi_call("get_time", 0, {}))),
    ("kimi_k2", KIMI.format(kimi_call("get_weather", 0, {"city": "Oslo"})),
     KIMI.format(kimi_call("get_weather", 0, {"days": 2}))),  # the required city is missing
    ("glm45", glm_call("get_weather", {"city": "Oslo", "days": 2}, True), glm_call("get_weather", {"days": 2}, True)),
    ("glm47", glm_call("get_weather", {"city": "Oslo"}, False) + "\n" + glm_call("now", {}, False),
     glm_call("weather", {"city": "Oslo"}, False)),
    ("hermes", hermes_call("get_weather", {"city": "Oslo", "days": 2}) + "\n" + hermes_call("now", {}),
     hermes_call("get_weather", {"city": "Oslo", "days": "two"})),
])
def test_the_grammar_takes_the_format_and_refuses_other_calls(tok, fmt, good, bad):
    assert accepts(tok, fmt, good)
    assert not accepts(tok, fmt, bad)


def test_markers_are_special_tokens_in_the_grammar(tok):
    g = tool_call_grammar("kimi_k2", TOOLS, False, marker_token(tok[0]))
    assert f"<[{tok[0].backend.token_to_id(kimi_k2.CALL_BEGIN)}]>" in g


def test_one_call_only_without_parallel_calls(tok):
    two = hermes_call("now", {}) + "\n" + hermes_call("now", {})
    assert accepts(tok, "hermes", two) and not accepts(tok, "hermes", two, parallel=False)
    assert accepts(tok, "hermes", json.dumps({}) and hermes_call("now", {}), parallel=False)
