"""Text <-> token ids for a Hugging Face-format model directory.

`Tokenizer` wraps the Rust `tokenizers` library (``tokenizer.json``; or tiktoken, for
Kimi's ``tiktoken.model``: `jaxserve.tiktoken_tokenizer`) and adds what lives
beside it in a checkpoint: special tokens and BOS policy from ``tokenizer_config.json``,
stop ids from ``generation_config.json``, and the Jinja chat template (from
``chat_template.jinja`` or ``tokenizer_config.json``), rendered the way transformers does.

`IncrementalDetokenizer` turns a stream of generated ids into text pieces that are never
a broken UTF-8 fragment, for streaming responses.
"""
from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any, Iterable

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import tokenizers

# A decode that ends in this character stopped inside a multi-byte UTF-8 sequence (or the
# model really produced U+FFFD); either way the text is held back until more ids arrive.
REPLACEMENT_CHAR = "\ufffd"
# Texts at least this long are encoded without holding the GIL (see Tokenizer.encode).
GIL_FREE_CHARS = 16384


class TokenizerError(ValueError):
    """The tokenizer files are missing, malformed, or lack what was asked (a chat template)."""


def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a string or a serialised AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _pick_chat_template(raw: Any) -> str | None:
    """tokenizer_config.json holds one template, or a list of named ones (use "default")."""
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    raise TokenizerError(f"chat_template has unexpected type {type(raw).__name__}")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    some templates; for inference it just renders its body (as transformers does)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str):
    # Templates call this to reject bad conversations (e.g. roles not alternating).
    raise TokenizerError(f"chat template error: {message}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson HTML-escapes and sorts keys; HF templates expect plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a template with the same environment transformers uses: sandboxed,
    trim_blocks/lstrip_blocks, loop controls, and the raise_exception/strftime_now helpers."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """A `tokenizers.Tokenizer` (or a `TiktokenBackend`, which offers the same methods) plus
    the checkpoint's special-token and chat-template settings."""

    def __init__(
        self,
        backend: Any,  # tokenizers.Tokenizer | jaxserve.tiktoken_tokenizer.TiktokenBackend
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos: bool = False,
        extra_eos_token_ids: Iterable[int] = (),
    ):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos = add_bos
        self.bos_token_id = self._id_of(bos_token)
        if add_bos and self.bos_token_id is None:
            raise TokenizerError("add_bos_token is set but the tokenizer has no bos_token")
        eos_ids = [self._id_of(eos_token)] + [int(i) for i in extra_eos_token_ids]
        # Order kept (the tokenizer's own eos first), duplicates and unknowns dropped.
        self.eos_token_ids: list[int] = list(dict.fromkeys(i for i in eos_ids if i is not None))
        self._template: jinja2.Template | None = None

    def _id_of(self, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"special token {token!r} is not in the vocabulary")
        return token_id

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load ``tokenizer.json`` (else Kimi's ``tiktoken.model``, see
        `jaxserve.tiktoken_tokenizer`) and, when present, ``tokenizer_config.json``,
        ``chat_template.jinja`` and ``generation_config.json`` from a model directory."""
        path = Path(path)
        tok_file, tiktoken_file = path / "tokenizer.json", path / "tiktoken.model"
        config = _read_json(path / "tokenizer_config.json")
        if tok_file.is_file():
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        elif tiktoken_file.is_file():  # Kimi K2.x: tiktoken ranks, specials from the config
            from jaxserve.tiktoken_tokenizer import TiktokenBackend

            try:
                backend = TiktokenBackend.from_files(tiktoken_file, config)
            except ValueError as e:
                raise TokenizerError(f"{tiktoken_file}: {e}") from e
        else:
            raise TokenizerError(f"no tokenizer.json (or tiktoken.model) in {path}")
        template = _pick_chat_template(config.get("chat_template"))
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():  # newer transformers save the template here; it wins
            template = jinja_file.read_text(encoding="utf-8")
        # generation_config.json lists every id that ends a turn (Llama 3 has several).
        gen_eos = _read_json(path / "generation_config.json").get("eos_token_id")
        gen_eos = [] if gen_eos is None else ([gen_eos] if isinstance(gen_eos, int) else list(gen_eos))
        return cls(
            backend,
            chat_template=template,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            add_bos=bool(config.get("add_bos_token", False)),
            extra_eos_token_ids=gen_eos,
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special tokens written in the text are always matched whole;
        `add_special_tokens` controls only the BOS/post-processor additions."""
        if len(text) >= GIL_FREE_CHARS and hasattr(self.backend, "encode_batch"):
            # tokenizers' encode holds the GIL throughout (seconds for a few MB, freezing
            # every other thread); encode_batch releases it and gives the same ids.
            ids = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        # tokenizer_config's add_bos_token is not always reflected in tokenizer.json's
        # post-processor; add BOS here, but never twice.
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render a conversation to the prompt text the model was trained on.

        Extra keyword arguments (tools, documents, ...) are passed to the template, as in
        transformers. The result already contains any BOS the template writes; encode it
        with ``add_special_tokens=False`` unless the model also wants an automatic BOS.
        """
        if self.chat_template is None:
            raise TokenizerError(
                "this checkpoint has no chat template (no chat_template in tokenizer_config.json "
                "and no chat_template.jinja); pass raw text instead of chat messages"
            )
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )


class IncrementalDetokenizer:
    """Streams generated ids as text, emitting each character only once it is complete.

    Byte-level vocabularies split one character (an emoji, a CJK glyph) over several ids,
    and SentencePiece decoders drop a leading space when a decode starts mid-text, so
    decoding ids one at a time is wrong. For a `tokenizers` tokenizer this is the library's
    own ``DecodeStream``; for tiktoken (which has none), a window ``ids[prefix:]`` is decoded
    and compared with ``ids[prefix:read]`` (already emitted): the difference is new text,
    released only when it does not end in U+FFFD.

    Invariant: ``"".join(pushes) + flush() == decode(pushed ids)`` when no prompt is
    given; with `prompt_ids`, it is the text those ids add after the prompt.
    """

    # How many prompt ids to keep as left context, so the first generated id decodes with
    # the spacing it has in context (vLLM uses the same number).
    PROMPT_CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Iterable[int] | None = None,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.context: list[int] = list(prompt_ids or [])[-self.PROMPT_CONTEXT:]
        self.ids: list[int] = list(self.context)
        self.prefix_offset = 0  # window start: left context for the decode
        self.read_offset = len(self.ids)  # ids before this are already emitted
        self.emitted = ""
        backend = getattr(tokenizer, "backend", None)
        self._stream = None
        if isinstance(backend, tokenizers.Tokenizer):
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(ids=self.context or None, skip_special_tokens=skip_special_tokens)
            self._backend = backend

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes (often "", never a fragment)."""
        self.ids.append(int(token_id))
        if self._stream is not None:
            piece = self._stream.step(self._backend, int(token_id)) or ""
        else:
            piece = self._window_step()
        self.emitted += piece
        return piece

    def _window_step(self) -> str:
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            # The emitted text ends on a complete character, so the next window can
            # start here without changing how later bytes decode.
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return new_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """Return whatever is still held back (e.g. a real trailing U+FFFD) at end of stream."""
        full = self._decode(self.ids)
        added = full[len(self._decode(self.context)):] if full.startswith(self._decode(self.context)) else full
        tail = added[len(self.emitted):] if added.startswith(self.emitted) else ""
        self.emitted += tail
        return tail
