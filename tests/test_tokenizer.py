"""Tokenizer, chat template and streaming detokenizer on the real SmolLM2 tokenizer.

The reference is transformers' own GGUF tokenizer (`AutoTokenizer.from_pretrained(dir,
gguf_file=...)`), built from the same GGUF by code independent of ours.
"""
import json
import shutil

import pytest

from jaxserve.checkpoint.gguf import default_model_dir, default_model_gguf
from jaxserve.tokenizer import GIL_FREE_CHARS, REPLACEMENT_CHAR, IncrementalDetokenizer, Tokenizer, TokenizerError

TEXTS = {
    "polish": "Zażółć gęślą jaźń. Chrząszcz brzmi w trzcinie w Szczebrzeszynie.",
    "french": "L'été dernier, où êtes-vous allés ? À bientôt, garçon ! Œuvre, naïveté, façade.",
    "chinese": "我们今天去公园散步，天气非常好。机器学习模型的推理引擎。",
    "emoji": "Hello 👋🏽 world 🌍! Family: 👨‍👩‍👧‍👦, flag 🇵🇱, 🤖🚀✨ done.",
    "mixed": "Mixed: café 中文 😀 in 2024 — 12,345.67\n\ttabs and  spaces  ",
}
SPECIAL_TEXT = "<|im_start|>user\nCześć! 😀<|im_end|>\n"

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of Poland?"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Bonjour ! Ça va ?"},
        {"role": "assistant", "content": "Très bien, merci 😀"},
        {"role": "user", "content": "我们去哪里？"},
    ],
]


@pytest.fixture(scope="session")
def model_dir():
    # Converted once into the cache ($JAXSERVE_CACHE_DIR or ~/.cache/jaxserve) and reused.
    return default_model_dir(progress=False)


@pytest.fixture(scope="session")
def tok(model_dir):
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="session")
def hf_gguf_tok():
    from transformers import AutoTokenizer

    gguf = default_model_gguf()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def test_special_tokens_and_sizes(tok):
    assert tok.vocab_size == 49152
    assert tok.bos_token == "<|im_start|>" and tok.bos_token_id == 1
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_ids == [2]
    assert not tok.add_bos  # SmolLM2 adds no BOS; its chat template writes <|im_start|>
    # Control tokens are matched whole in text and dropped by a default decode.
    assert tok.encode("<|im_start|>") == [1]
    assert tok.decode([1, 2]) == ""
    assert tok.decode([1, 2], skip_special_tokens=False) == "<|im_start|><|im_end|>"


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_round_trip(tok, name):
    text = TEXTS[name]
    assert tok.decode(tok.encode(text)) == text


def test_round_trip_with_special_tokens(tok):
    ids = tok.encode(SPECIAL_TEXT)
    assert ids[0] == 1 and 2 in ids
    assert tok.decode(ids, skip_special_tokens=False) == SPECIAL_TEXT
    assert tok.decode(ids) == "user\nCześć! 😀\n"


@pytest.mark.parametrize("name", sorted(TEXTS) + ["special"])
def test_ids_match_transformers_gguf_tokenizer(tok, hf_gguf_tok, name):
    text = SPECIAL_TEXT if name == "special" else TEXTS[name]
    ours = tok.encode(text)
    assert ours == hf_gguf_tok.encode(text)
    assert tok.decode(ours) == hf_gguf_tok.decode(ours, skip_special_tokens=True)


def test_long_texts_take_the_gil_free_path_with_the_same_ids(tok, hf_gguf_tok):
    """Texts of GIL_FREE_CHARS or more are encoded another way (the batch API, which
    releases the GIL): the ids must still be the reference tokenizer's."""
    text = "".join(list(TEXTS.values()) + [SPECIAL_TEXT]) * 80
    assert len(text) >= GIL_FREE_CHARS
    assert tok.encode(text) == hf_gguf_tok.encode(text)
    assert tok.encode(text, add_special_tokens=False) == hf_gguf_tok.encode(text, add_special_tokens=False)


def test_converted_files_load_in_transformers(tok, model_dir):
    # The tokenizer.json/tokenizer_config.json we write are a valid HF tokenizer too.
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_dir))
    for text in list(TEXTS.values()) + [SPECIAL_TEXT]:
        assert hf.encode(text) == tok.encode(text)
    assert hf.eos_token == "<|im_end|>" and hf.bos_token == "<|im_start|>"


def _stream(tok, ids, prompt_ids=None):
    det = IncrementalDetokenizer(tok, prompt_ids=prompt_ids)
    pieces = [det.push(i) for i in ids]
    return pieces, det.flush()


@pytest.mark.parametrize("name", sorted(TEXTS) + ["special"])
def test_incremental_detokenizer(tok, name):
    text = SPECIAL_TEXT if name == "special" else TEXTS[name]
    ids = tok.encode(text)
    pieces, tail = _stream(tok, ids)
    assert not any(REPLACEMENT_CHAR in p for p in pieces), pieces
    assert "".join(pieces) + tail == tok.decode(ids)
    assert tail == ""  # the texts end on complete characters: nothing left to flush


def test_incremental_detokenizer_holds_split_characters(tok):
    # Emoji and CJK characters span several byte-level tokens; decoding those ids one by
    # one gives U+FFFD, which the streamer must never emit.
    ids = tok.encode(TEXTS["emoji"] + TEXTS["chinese"])
    assert sum(REPLACEMENT_CHAR in tok.decode([i]) for i in ids) >= 5
    pieces, _ = _stream(tok, ids)
    assert pieces.count("") >= 5  # held back while a character was incomplete
    assert not any(REPLACEMENT_CHAR in p for p in pieces)


def test_incremental_detokenizer_after_prompt(tok):
    prompt = tok.encode(tok.apply_chat_template(CONVERSATIONS[0]), add_special_tokens=False)
    answer = "Warszawa 🇵🇱, czyli stolica Polski."
    pieces, tail = _stream(tok, tok.encode(answer), prompt_ids=prompt)
    assert "".join(pieces) + tail == answer
    assert not any(REPLACEMENT_CHAR in p for p in pieces)


def test_incremental_detokenizer_random_ids(tok):
    # Arbitrary id streams, rich in partial-UTF-8 byte tokens (so also invalid sequences):
    # whatever is held back, pushes + flush must add up to the full decode.
    import random

    rng = random.Random(0)
    fragments = [i for i in range(tok.vocab_size) if REPLACEMENT_CHAR in tok.decode([i])]
    assert len(fragments) > 100
    for _ in range(300):
        ids = [rng.choice(fragments) if rng.random() < 0.6 else rng.randrange(tok.vocab_size)
               for _ in range(rng.randrange(1, 30))]
        for skip in (True, False):
            det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            text = "".join(det.push(i) for i in ids) + det.flush()
            assert text == tok.decode(ids, skip_special_tokens=skip), ids


def test_incremental_detokenizer_real_replacement_char(tok):
    # A U+FFFD the text really contains is only held until the stream ends.
    text = "ok \ufffd"
    pieces, tail = _stream(tok, tok.encode(text))
    assert "".join(pieces) == "ok " and tail == "\ufffd"


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["one-turn", "multi-turn"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf_gguf_tok, conversation, add_generation_prompt):
    ours = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    ref = hf_gguf_tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == ref
    assert ours.startswith("<|im_start|>system\n")
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_missing_chat_template_is_a_clear_error(model_dir, tmp_path):
    shutil.copy(model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    bare = Tokenizer.from_dir(tmp_path)
    assert bare.encode("hi") == Tokenizer.from_dir(model_dir).encode("hi")
    with pytest.raises(TokenizerError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_template_file_bos_and_generation_config(model_dir, tmp_path):
    shutil.copy(model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config.update(add_bos_token=True, bos_token={"content": "<|endoftext|>", "special": True})
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    # chat_template.jinja wins over tokenizer_config's template (as in transformers).
    (tmp_path / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}\n"
        "  {%- if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}\n"
        "[{{ m.role }}] {{ m.content | tojson }}\n"
        "{% endfor %}"
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    t = Tokenizer.from_dir(tmp_path)
    assert t.eos_token_ids == [2, 0]
    ids = t.encode("hi")
    assert ids[0] == 0 and ids.count(0) == 1
    assert t.encode("<|endoftext|>hi") == ids  # BOS never doubled
    assert t.encode("hi", add_special_tokens=False) == ids[1:]
    rendered = t.apply_chat_template([{"role": "user", "content": "é \"q\""}])
    assert rendered == '<|endoftext|>[user] "é \\"q\\""\n'  # trim/lstrip blocks, json not ascii-escaped
    with pytest.raises(TokenizerError, match="no tools"):
        t.apply_chat_template([{"role": "tool", "content": "x"}])
