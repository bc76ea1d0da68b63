"""Rebuild a Hugging Face ``tokenizer.json`` + ``tokenizer_config.json`` from GGUF metadata.

A GGUF has no tokenizer.json: llama.cpp stores the vocabulary, merges, token types and
special ids as ``tokenizer.ggml.*`` arrays, and names its pre-tokenizer (how text is cut
before BPE) with ``tokenizer.ggml.pre``. Only byte-level BPE (``tokenizer.ggml.model ==
"gpt2"``) is supported, and only pre-tokenizers whose exact split we know: adding one is
one entry in `_PRE_TOKENIZERS`; an unknown one is an error, never a guess, because a wrong
split silently changes token ids.
"""
from __future__ import annotations

from typing import Any, Callable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp's token types (llama_token_type in llama.h).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_split() -> pre_tokenizers.PreTokenizer:
    # ByteLevel's built-in regex is GPT-2's: 's|'t|...| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    # StarCoder-family vocabularies (SmolLM, SmolLM2) were trained with every digit on its
    # own, then the GPT-2 split: the same Sequence their original tokenizer.json has, and
    # llama.cpp's regex pair ("\p{N}", GPT-2 regex) for these `pre` names.
    return pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])


def _llama3_split() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


# tokenizer.ggml.pre -> the HF pre-tokenizer with the same split.
_PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "gpt-2": _gpt2_split,
    "smollm": _digits_then_gpt2,
    "starcoder": _digits_then_gpt2,
    "refact": _digits_then_gpt2,
    "llama-bpe": _llama3_split,
    "llama3": _llama3_split,
}


def _token(meta: dict[str, Any], key: str) -> str | None:
    token_id = meta.get(f"tokenizer.ggml.{key}")
    return None if token_id is None else meta["tokenizer.ggml.tokens"][token_id]


def tokenizer_files_from_gguf(meta: dict[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    """`(tokenizers.Tokenizer, tokenizer_config dict)` described by GGUF metadata `meta`
    (as returned by ``gguf_fields``)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"only byte-level BPE GGUF tokenizers (tokenizer.ggml.model='gpt2') are supported, got {kind!r}")
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"unknown GGUF pre-tokenizer {pre!r}; known: {sorted(_PRE_TOKENIZERS)}")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF vocabulary has duplicate tokens; ids would not round-trip")
    # Tokens are already spelled in the byte-level alphabet ("Ġthe"), merges as "a b".
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]

    # No unk token: byte-level BPE covers (almost) every byte. This vocabulary lacks the
    # bytes that never occur in UTF-8 text and a few control characters, and like
    # transformers' own GGUF tokenizer we drop those rather than invent a fallback.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()

    # CONTROL tokens (<|im_start|>, <|endoftext|>, ...) must match whole in text and be
    # skippable on decode; USER_DEFINED ones match whole but are ordinary text.
    types = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == TOKEN_CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)

    bos, eos = _token(meta, "bos_token_id"), _token(meta, "eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if add_bos or add_eos:
        pieces = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
        used = [t for t, on in ((bos, add_bos), (eos, add_eos)) if on]
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(pieces), special_tokens=[(t, vocab[t]) for t in dict.fromkeys(used)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": _token(meta, "unknown_token_id"),
        "pad_token": _token(meta, "padding_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(f"{meta.get('general.architecture')}.context_length", 2048)),
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tok, config
