"""``MockLLM``: what the server reads of a ``jaxserve.LLM``, over a ``MockEngine`` and a
character tokenizer, so the gRPC and HTTP servers run without loading a model:

    with ServerThread(MockLLM(), http_port=0) as st:   # jaxserve.server.app.ServerThread
        st.wait_ready()

The tokenizer (``char_tokenizer``) is the project's ``Tokenizer`` over ``CharBackend``: ids 0-4
are the special tokens ``<s>``, ``</s>`` (EOS), ``<unk>``, ``<|im_start|>``, ``<|im_end|>``;
every other id is one character, ``id = ord(char) + 5`` (a character past the vocabulary, 49152
ids, is ``<unk>``). So text is checked by hand too: greedy after "abc" comes "def".
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

from jaxserve.testing.mock_engine import MockEngine
from jaxserve.tokenizer import Tokenizer

SPECIALS = ("<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>")
BOS, EOS, UNK, IM_START, IM_END = range(len(SPECIALS))
OFFSET = len(SPECIALS)
VOCAB_SIZE = 49152  # the tests' tiny model's (characters from U+BFFB on are <unk>)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")


@dataclasses.dataclass
class Encoding:
    ids: list[int]


class CharBackend:
    """A ``tokenizers.Tokenizer``-like backend: one id per character (see the module docstring)."""

    def token_to_id(self, token: str) -> int | None:
        return SPECIALS.index(token) if token in SPECIALS else None

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return VOCAB_SIZE

    def encode(self, text: str, add_special_tokens: bool = True) -> Encoding:
        ids = []
        for part in _SPECIAL_RE.split(text):
            if part in SPECIALS:
                ids.append(SPECIALS.index(part))
            else:
                ids.extend(ord(c) + OFFSET if ord(c) + OFFSET < VOCAB_SIZE else UNK for c in part)
        return Encoding(ids)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            if i < OFFSET:
                out.append("" if skip_special_tokens else SPECIALS[i])
            else:
                c = i - OFFSET
                out.append("\ufffd" if 0xD800 <= c <= 0xDFFF else chr(c))  # no lone surrogates in text
        return "".join(out)


def char_tokenizer() -> Tokenizer:
    return Tokenizer(CharBackend(), chat_template=CHAT_TEMPLATE, bos_token="<s>", eos_token="</s>")


def char_ids(text: str) -> list[int]:
    """The mock tokenizer's ids of ``text`` (no special tokens in it)."""
    return [ord(c) + OFFSET for c in text]


def greedy_ids(last: int, n: int, vocab_size: int = VOCAB_SIZE) -> list[int]:
    """The n tokens a greedy mock request generates after the token ``last``."""
    return [(last + k) % vocab_size for k in range(1, n + 1)]


@dataclasses.dataclass(frozen=True)
class MockConfig:
    """The model config fields the server reads."""

    architecture: str = "MockForCausalLM"
    model_type: str = "mock"
    vocab_size: int = VOCAB_SIZE


@dataclasses.dataclass(frozen=True)
class MockFormat:
    """The KV format the server names (``LLM.fmt``)."""

    name: str = "float32"


class MockLLM:
    """The interface the server uses of ``jaxserve.LLM`` over a ``MockEngine`` (step_seconds and
    engine_kwargs: its own, EngineConfig fields; tokenizer=False: a model without one)."""

    def __init__(self, model_path: str = "mock-model", tokenizer: bool = True, max_model_len: int = 4096,
                 step_seconds: float = 0.0, **engine_kwargs):
        self.model_path = model_path
        self.tokenizer = char_tokenizer() if tokenizer else None
        self.cfg = MockConfig()
        self.dtype = "float32"
        self.fmt = MockFormat()
        self.engine = MockEngine(self.tokenizer, VOCAB_SIZE, max_model_len, (EOS,), step_seconds, **engine_kwargs)
        self._weights = [np.arange(16, dtype=np.float32)]

    def memory_report(self) -> dict:
        return self.engine.memory_report()

    def weight_formats(self) -> dict:
        return {"prefill": None, "decode": None}

    def weight_paths(self) -> dict[str, str]:
        return {"prefill": "mock", "decode": "mock"}

    def weight_path_rows(self) -> dict:
        return {"prefill": [], "decode": []}

    def weights(self) -> list:
        return self._weights
