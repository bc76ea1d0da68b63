"""A tiktoken tokenizer as Kimi K2.x checkpoints ship it: ``tiktoken.model`` + ``tokenizer_config.json``.

``tiktoken.model`` holds the BPE ranks (one ``base64(token_bytes) rank`` per line). As in
Moonshot's ``tokenization_kimi.py``, the ids right after the ranks are special-token slots
(256 of them): ``added_tokens_decoder`` in ``tokenizer_config.json`` names some, the rest
are ``<|reserved_token_{id}|>``; the split regex is Kimi's `KIMI_PAT_STR` (a
``tiktoken_pattern`` or ``pat_str`` key in ``tokenizer_config.json`` overrides it).

`TiktokenBackend` offers the few methods of ``tokenizers.Tokenizer`` that
`jaxserve.tokenizer.Tokenizer` calls, so BOS/EOS policy, the chat template and the
`IncrementalDetokenizer` work unchanged on top of it.
"""
from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import tiktoken

# The split pattern of Kimi K2 (tokenization_kimi.py), verbatim. Its `[A&&[^B]]` classes
# are set intersections (letters/marks that are not Han): tiktoken's regex engine
# (fancy-regex, delegating classes to the Rust regex crate) supports them, so the
# pattern is used as is; tests/test_tiktoken_tokenizer.py checks the split against
# Python's `regex` module in V1 mode, which implements `&&` the same way.
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NUM_RESERVED_SPECIAL_TOKENS = 256  # special-token slots after the ranks (Kimi, as Llama 3)
# Kimi (like Llama 3) feeds tiktoken at most this many characters at a time, and cuts runs
# of more than MAX_NO_WHITESPACES_CHARS whitespace / non-whitespace characters, which
# keeps the regex from going quadratic; replicated so long inputs tokenize the same.
TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACES_CHARS = 25_000


def _split_whitespaces_or_nonwhitespaces(s: str, max_len: int) -> Iterator[str]:
    """Cut `s` so no piece holds a run of more than `max_len` consecutive whitespace (or
    non-whitespace) characters (the same cuts as Kimi's / Llama 3's tokenizer)."""
    if len(s) <= max_len:  # no run can be longer: the loop below would yield `s` whole
        yield s
        return
    run_len, run_is_space, start = 0, s[0].isspace(), 0
    for i, ch in enumerate(s):
        is_space = ch.isspace()
        if run_is_space ^ is_space:
            run_len, run_is_space = 1, is_space
        else:
            run_len += 1
            if run_len > max_len:
                yield s[start:i]
                start, run_len = i, 1
    yield s[start:]


def load_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """Parse a tiktoken BPE file exactly as ``tiktoken.load.load_tiktoken_bpe`` does.

    Not that function itself: it copies every file it reads into a cache keyed by the
    *path* ($TIKTOKEN_CACHE_DIR, else /tmp/data-gym-cache) and, without an expected hash,
    returns the cached copy from then on, so a tiktoken.model replaced at the same path
    would silently keep its old ranks.
    """
    with open(path, "rb") as f:
        contents = f.read()
    ranks: dict[bytes, int] = {}
    for line in contents.splitlines():
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        except (ValueError, binascii.Error) as e:
            raise ValueError(f"error parsing line {line!r} of {os.fspath(path)}") from e
    return ranks


@dataclass(frozen=True)
class _Encoded:
    ids: list[int]  # what Tokenizer reads from a tokenizers.Encoding


class TiktokenBackend:
    """tiktoken `Encoding` with Kimi's special-token slots, duck-typing ``tokenizers.Tokenizer``
    (`encode(...).ids`, `decode`, `token_to_id`, `get_vocab_size`)."""

    def __init__(self, mergeable_ranks: dict[bytes, int], special_tokens: dict[str, int],
                 pat_str: str = KIMI_PAT_STR, skipped_ids: Iterable[int] | None = None,
                 name: str = "tiktoken"):
        self.encoding = tiktoken.Encoding(
            name=name, pat_str=pat_str, mergeable_ranks=mergeable_ranks, special_tokens=special_tokens
        )
        self.special_tokens = dict(special_tokens)
        # Ids a decode with skip_special_tokens drops (all specials unless told otherwise).
        self.skipped_ids = frozenset(special_tokens.values() if skipped_ids is None else skipped_ids)
        self._known_ids = frozenset(mergeable_ranks.values()) | frozenset(special_tokens.values())

    @classmethod
    def from_files(cls, model_file: str | os.PathLike, config: dict[str, Any]) -> "TiktokenBackend":
        """Build from ``tiktoken.model`` and the parsed ``tokenizer_config.json``, as Kimi does."""
        ranks = load_ranks(model_file)
        num_base = len(ranks)
        named: dict[int, str] = {}
        skipped: set[int] = set()
        for key, entry in (config.get("added_tokens_decoder") or {}).items():
            token_id = int(key)
            content = entry.get("content") if isinstance(entry, dict) else entry
            if not isinstance(content, str):
                raise ValueError(f"added_tokens_decoder[{key}] has no content")
            named[token_id] = content
            if not isinstance(entry, dict) or entry.get("special", True):
                skipped.add(token_id)
        end = max([num_base + NUM_RESERVED_SPECIAL_TOKENS] + [i + 1 for i in named])
        special_tokens: dict[str, int] = {}
        for token_id in range(num_base, end):
            if token_id in named:
                content = named[token_id]
            elif token_id < num_base + NUM_RESERVED_SPECIAL_TOKENS:
                content = f"<|reserved_token_{token_id}|>"  # Kimi's name for an unnamed slot
                skipped.add(token_id)
            else:
                continue
            if content in special_tokens:
                raise ValueError(f"special token {content!r} has two ids")
            special_tokens[content] = token_id
        # An added token with an id inside the ranks would shadow a BPE token.
        clash = sorted(i for i in named if i < num_base)
        if clash:
            raise ValueError(f"added_tokens_decoder id {clash[0]} is a BPE rank (< {num_base})")
        pat_str = config.get("tiktoken_pattern") or config.get("pat_str") or KIMI_PAT_STR
        return cls(ranks, special_tokens, pat_str=pat_str, skipped_ids=skipped,
                   name=os.path.basename(os.fspath(model_file)))

    def token_to_id(self, token: str) -> int | None:
        if token in self.special_tokens:
            return self.special_tokens[token]
        try:
            return self.encoding.encode_single_token(token.encode("utf-8"))
        except KeyError:
            return None

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        if with_added_tokens:
            return self.encoding.n_vocab
        return self.encoding.n_vocab - len(self.special_tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> _Encoded:
        """Special-token text is matched whole (Kimi's default, allow_special_tokens=True,
        and what the tokenizer.json path does); `add_special_tokens` is for Tokenizer's BOS."""
        ids: list[int] = []
        for i in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
            for piece in _split_whitespaces_or_nonwhitespaces(text[i:i + TIKTOKEN_MAX_ENCODE_CHARS],
                                                               MAX_NO_WHITESPACES_CHARS):
                ids.extend(self.encoding.encode(piece, allowed_special="all"))
        return _Encoded(ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Bytes of the ids as UTF-8, invalid sequences as U+FFFD (as byte-level tokenizers
        decode). Ids outside the vocabulary are dropped, as tokenizers.Tokenizer does."""
        ids = [int(i) for i in ids]
        keep = [i for i in ids if i in self._known_ids and not (skip_special_tokens and i in self.skipped_ids)]
        return self.encoding.decode_bytes(keep).decode("utf-8", errors="replace")
