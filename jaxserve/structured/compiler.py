"""StructuredOutput -> a validated llguidance matcher for the checkpoint's tokenizer.

The llguidance tokenizer is built once per engine (about a second for a 50k vocabulary) from
the checkpoint's own ``tokenizer.json`` (HF tokenizers) or ``tiktoken.model`` ranks, over the
model's vocabulary size (ids past the tokenizer's are never allowed under a constraint), with
the engine's EOS ids as the tokens that end an accepted output.

Bounds: a grammar's source is at most ``max_bytes``; its compilation gets the lexer fuel
llguidance spends in about ``compile_ms`` milliseconds (its documented rate is ~50k units per
ms) and at most ``MAX_GRAMMAR_SYMBOLS`` symbols; past either, compilation fails with
llguidance's message, which the caller reports as a bad request. A compiled grammar is kept
(by its spec, a small LRU), so n choices or a repeated schema compile once; each request then
gets a copy of the fresh matcher.
"""
from __future__ import annotations

import collections
import threading
import time

from jaxserve.structured.spec import StructuredOutput

FUEL_PER_MS = 50_000  # llguidance's initial-lexer fuel spent per millisecond (its documentation)
MAX_GRAMMAR_SYMBOLS = 200_000
CACHED_GRAMMARS = 64


class GrammarError(ValueError):
    """A grammar that cannot compile (or breaks a bound): the request is refused, nothing runs."""


def lltokenizer(tokenizer, vocab_size: int, eos_ids):
    """The llguidance tokenizer of a jaxserve ``Tokenizer`` (tokenizers or tiktoken backend)."""
    import llguidance
    import tokenizers

    backend = tokenizer.backend
    eos = [int(i) for i in eos_ids if 0 <= int(i) < vocab_size] or None
    if isinstance(backend, tokenizers.Tokenizer):
        return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    enc = getattr(backend, "encoding", None)
    if enc is None:
        raise GrammarError(f"structured outputs need a tokenizers or tiktoken tokenizer, not {type(backend).__name__}")
    from llguidance.tiktoken import lltokenizer_from_encoding

    return lltokenizer_from_encoding(enc, n_vocab=vocab_size, eos_token=eos)


def grammar_text(spec: StructuredOutput) -> str:
    """llguidance's grammar definition for ``spec`` (not yet validated)."""
    from llguidance import LLMatcher

    try:
        if spec.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(spec.source)
        if spec.kind == "json_object":
            return LLMatcher.grammar_from_json_schema('{"type": "object"}')
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.source)
        return LLMatcher.grammar_from_lark(spec.source)
    except Exception as e:  # llguidance raises ValueError / RuntimeError with its own message
        raise GrammarError(f"{spec.kind}: {e}") from None


class GrammarCompiler:
    """Compiles specs into fresh matchers (thread-safe: the front ends may check a grammar off
    the engine thread)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, max_bytes: int = 65536, compile_ms: int = 2000):
        if tokenizer is None:
            raise GrammarError("structured outputs need the model's tokenizer (this checkpoint has none)")
        self.vocab_size = vocab_size
        self.max_bytes = max_bytes
        self.compile_ms = compile_ms
        self._tokenizer = lltokenizer(tokenizer, vocab_size, eos_ids)
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0
        self.compile_seconds: collections.deque = collections.deque(maxlen=1024)  # the latest compilations' times

    def _limits(self):
        from llguidance import LLParserLimits

        return LLParserLimits(initial_lexer_fuel=self.compile_ms * FUEL_PER_MS, max_grammar_size=MAX_GRAMMAR_SYMBOLS,
                              verbose_errors=False)

    def matcher(self, spec: StructuredOutput):
        """A fresh ``llguidance.LLMatcher`` for ``spec``; GrammarError naming the problem."""
        from llguidance import LLMatcher

        if spec.size > self.max_bytes:
            raise GrammarError(f"the {spec.kind} is {spec.size} bytes; the limit is {self.max_bytes} "
                               f"(--max-grammar-bytes)")
        with self._lock:
            proto = self._cache.get(spec)
            if proto is not None:
                self._cache.move_to_end(spec)
                return proto.deep_copy()
        t0 = time.perf_counter()
        grammar = grammar_text(spec)
        proto = LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._limits())
        elapsed = time.perf_counter() - t0
        if proto.is_error():
            raise GrammarError(f"the {spec.kind} does not compile: {proto.get_error()}")
        with self._lock:
            self.compile_seconds.append(elapsed)
            self.compiles += 1
            self._cache[spec] = proto
            while len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return proto.deep_copy()

    def check(self, spec: StructuredOutput) -> None:
        """Raise GrammarError if ``spec`` cannot compile (compiles it into the cache)."""
        self.matcher(spec)
