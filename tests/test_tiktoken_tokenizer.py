"""Kimi K2.x-style tokenizer directories: ``tiktoken.model`` + ``tokenizer_config.json``.

The test trains its own tiny byte-level BPE (all 256 bytes, then merges counted on a small
multilingual text), writes it in tiktoken's ``base64(token) rank`` format beside a
tokenizer_config.json with two named special tokens and a chat template, and checks
`Tokenizer.from_dir` against two references built here from the same ranks: a
`tiktoken.Encoding` constructed directly, and a pure-Python BPE over a split done by the
`regex` module (V1 mode, which implements the `&&` class intersections of Kimi's pattern).
"""
import base64
import json
import random
import shutil
from collections import Counter
from pathlib import Path

import pytest
import regex
import tiktoken
import tiktoken.load

from jaxserve.tiktoken_tokenizer import _split_whitespaces_or_nonwhitespaces, load_ranks
from jaxserve.tokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, Tokenizer, TokenizerError

# Kimi K2's pat_str (tokenization_kimi.py), copied here independently of jaxserve's copy.
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
SPLIT_V1 = regex.compile("(?V1)" + KIMI_PATTERN)  # V1: `[A&&B]` is an intersection

CORPUS = """\
The quick brown fox jumps over the lazy dog. It's what we'll do, and they're here; I'd say we've won.
Inference engines stream tokens: the model writes one token at a time, and the server sends text.
Zażółć gęślą jaźń. Chrząszcz brzmi w trzcinie w Szczebrzeszynie. Dzień dobry, jak się masz?
我们今天去公园散步，天气非常好。机器学习模型的推理引擎。中文分词和字节级编码。
東京タワーに行きました。日本語のテキストです。
Emoji: 😀 🚀 ✨ 👋🏽 🇵🇱 — numbers 12345 and 3.14159, code: def f(x): return x + 1
"""
NUM_MERGES = 150
MODEL_VOCAB = 512  # checkpoints/tiny-kimi-k2's vocab_size: every id it can sample must decode

TEXTS = {
    "ascii": "Hello, World! It's DONE'S time; we'LL see. x=42, y=3.14159\n\n\tindent   spaces  \n",
    "polish": "Zażółć gęślą jaźń. Chrząszcz brzmi w trzcinie w Szczebrzeszynie.",
    "chinese": "我们今天去公园散步，天气非常好。机器学习模型的推理引擎。",
    "emoji": "Hello 👋🏽 world 🌍! Family: 👨‍👩‍👧‍👦, flag 🇵🇱, 🤖🚀✨ done.",
    "mixed": "abc中文def ÉCOLE東京タワーです Ünïcode 12345678 — café\r\n\r\n  end",
}
BOS, EOS = "[BOS]", "<|im_end|>"
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|{{ m.role }}|>{{ m.content }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_ranks(text: str, num_merges: int) -> dict[bytes, int]:
    """A tiny byte-level BPE: bytes 0..255 as ranks 0..255, then the most frequent adjacent
    pair within regex pieces is merged, `num_merges` times (ties: the larger pair)."""
    words = [[bytes([b]) for b in piece.encode()] for piece in SPLIT_V1.findall(text)]
    ranks = {bytes([b]): b for b in range(256)}
    while len(ranks) < 256 + num_merges:
        counts = Counter(pair for w in words for pair in zip(w, w[1:]))
        if not counts:
            break
        (a, b), _ = max(counts.items(), key=lambda kv: (kv[1], kv[0]))
        ranks.setdefault(a + b, len(ranks))
        for w in words:
            i = 0
            while i < len(w) - 1:
                if w[i] == a and w[i + 1] == b:
                    w[i:i + 2] = [a + b]
                i += 1
    assert len(ranks) == 256 + num_merges
    return ranks


def write_ranks(path: Path, ranks: dict[bytes, int]) -> None:
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))


RANKS = train_ranks(CORPUS, NUM_MERGES)
BASE = len(RANKS)  # named specials: [BOS] = BASE, <|im_end|> = BASE + 2 (BASE + 1 left unnamed)


def write_tokenizer_files(d: Path) -> None:
    write_ranks(d / "tiktoken.model", RANKS)
    config = {
        "added_tokens_decoder": {
            str(BASE): {"content": BOS, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True},
            str(BASE + 2): {"content": EOS, "lstrip": False, "normalized": False, "rstrip": False,
                            "single_word": False, "special": True},
        },
        "bos_token": BOS,
        "eos_token": {"content": EOS, "special": True},
        "chat_template": TEMPLATE,
        "tokenizer_class": "TikTokenTokenizer",
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiktoken_tok")
    write_tokenizer_files(d)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def reference():
    """tiktoken.Encoding built directly from the ranks, with Kimi's 256 special slots."""
    names = {BASE: BOS, BASE + 2: EOS}
    specials = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(BASE, BASE + 256)}
    return tiktoken.Encoding("reference", pat_str=KIMI_PATTERN, mergeable_ranks=RANKS, special_tokens=specials)


def python_bpe(text: str) -> list[int]:
    """Split with `regex` (V1), then merge the lowest-ranked adjacent pair until none is left."""
    ids = []
    for piece in SPLIT_V1.findall(text):
        parts = [bytes([b]) for b in piece.encode()]
        while True:
            best = min(((RANKS[parts[i] + parts[i + 1]], i) for i in range(len(parts) - 1)
                        if parts[i] + parts[i + 1] in RANKS), default=None)
            if best is None:
                break
            i = best[1]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        ids += [RANKS[p] for p in parts]
    return ids


def test_ranks_file_parses_like_tiktoken(tok_dir, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # no copy into tiktoken's cache
    assert load_ranks(tok_dir / "tiktoken.model") == tiktoken.load.load_tiktoken_bpe(str(tok_dir / "tiktoken.model"))
    assert load_ranks(tok_dir / "tiktoken.model") == RANKS


def test_pattern_class_intersection(tok):
    # `[\p{Lo}...&&[^\p{Han}]]`: Latin/kana runs stop at Han, which forms its own piece. An
    # engine reading `&&` as literal characters would keep "abc中文" together.
    pattern = tok.backend.encoding._pat_str  # what jaxserve loaded (the default: Kimi's)

    def pieces(text):  # tiktoken's (fancy-regex) split: a vocab where every piece is one token
        b = text.encode()
        subs = sorted({b[i:j] for i in range(len(b)) for j in range(i + 1, len(b) + 1)}, key=lambda s: (len(s), s))
        ranks = {bytes([i]): i for i in range(256)}
        for s in subs:
            ranks.setdefault(s, len(ranks))
        enc = tiktoken.Encoding("split", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
        return [enc.decode_single_token_bytes(t).decode() for t in enc.encode(text)]

    assert pieces("abc中文") == ["abc", "中文"]
    assert pieces("ÉCOLE東京タワー") == ["ÉCOLE", "東京", "タワー"]
    assert pieces("x&&y") == ["x", "&&", "y"]
    assert pieces(" 中文abc") == [" ", "中文", "abc"]
    extra = [" ÉCOLE東京タワーです", "。中文Abc", "Ab中文'S x'll", "ŻÓŁW中zw", "1234中5"]
    for text in list(TEXTS.values()) + extra:
        assert pieces(text) == SPLIT_V1.findall(text), text


def test_sizes_and_special_tokens(tok):
    assert tok.vocab_size == BASE + 256 > MODEL_VOCAB
    assert tok.bos_token == BOS and tok.bos_token_id == BASE
    assert tok.eos_token == EOS and tok.eos_token_ids == [BASE + 2]
    assert not tok.add_bos
    reserved = f"<|reserved_token_{BASE + 1}|>"  # Kimi's name for an unnamed slot
    assert tok.encode(BOS) == [BASE] and tok.encode(EOS) == [BASE + 2] and tok.encode(reserved) == [BASE + 1]
    assert tok.decode([BASE, BASE + 1, BASE + 2]) == ""
    assert tok.decode([BASE, BASE + 1, BASE + 2], skip_special_tokens=False) == BOS + reserved + EOS
    text = f"{BOS}użytkownik: 中文 😀{EOS}\n"
    ids = tok.encode(text)
    assert ids[0] == BASE and ids.count(BASE + 2) == 1
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "użytkownik: 中文 😀\n"
    # Ids the tokenizer does not have are dropped, as tokenizers.Tokenizer does.
    assert tok.decode([RANKS[b"a"], BASE + 256, 10**6, RANKS[b"b"]]) == "ab"


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_round_trip_and_reference_ids(tok, reference, name):
    text = TEXTS[name]
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids == reference.encode(text, allowed_special="all") == python_bpe(text)
    assert max(ids) < BASE  # no special tokens in these texts
    assert len(ids) < len(text.encode())  # the merges are used


def test_special_text_matches_reference(tok, reference):
    text = f"{BOS}a{EOS}{EOS}<|reserved_token_{BASE + 7}|>中文<|im_end|"
    assert tok.encode(text) == reference.encode(text, allowed_special="all")
    assert tok.encode(text)[:4] == [BASE, RANKS[b"a"], BASE + 2, BASE + 2]


def test_long_runs_are_cut_as_kimi_does(tok, reference):
    # Kimi cuts runs of > 25,000 non-whitespace characters before tiktoken sees them.
    pair = next(t.decode() for t in RANKS if len(t) == 2 and t.isalpha() and t.islower() and t[0] != t[1])
    text = "x" + pair * 15_000  # one regex piece of 30,001 letters
    expected = reference.encode(text[:25_000]) + reference.encode(text[25_000:])
    assert expected != reference.encode(text)  # the cut falls inside a merged pair
    assert tok.encode(text) == expected
    assert tok.decode(tok.encode(text)) == text
    assert list(_split_whitespaces_or_nonwhitespaces("aaaa  bbbbbb     c", 3)) == ["aaa", "a  bbb", "bbb   ", "  c"]


def test_chat_template(tok):
    conversation = [{"role": "user", "content": "Cześć! 中文 😀"}, {"role": "assistant", "content": "Hej"},
                    {"role": "user", "content": "ok?"}]
    rendered = tok.apply_chat_template(conversation)
    assert rendered == f"{BOS}<|user|>Cześć! 中文 😀{EOS}\n<|assistant|>Hej{EOS}\n<|user|>ok?{EOS}\n<|assistant|>"
    ids = tok.encode(rendered, add_special_tokens=False)
    assert ids[0] == BASE and ids.count(BASE + 2) == 3
    assert tok.decode(ids, skip_special_tokens=False) == rendered
    assert tok.apply_chat_template(conversation[:1], add_generation_prompt=False).endswith(f"{EOS}\n")


def _stream(tok, ids, skip=True):
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces = [det.push(i) for i in ids]
    return pieces, det.flush()


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_incremental_detokenizer(tok, name):
    ids = tok.encode(TEXTS[name])
    pieces, tail = _stream(tok, ids)
    assert not any(REPLACEMENT_CHAR in p for p in pieces)
    assert "".join(pieces) == TEXTS[name] and tail == ""


def test_incremental_detokenizer_random_streams(tok):
    rng = random.Random(0)
    fragments = [i for i in range(BASE) if REPLACEMENT_CHAR in tok.decode([i])]
    assert len(fragments) >= 128  # at least the bytes 0x80..0xFF
    alphabet = "".join(TEXTS.values()) + "ąęźżł东京😀🚀🇵🇱"
    specials = [BASE, BASE + 1, BASE + 2, BASE + 100]
    for _ in range(200):
        # Valid text (its multi-byte characters split over byte tokens), special ids mixed in:
        # nothing emitted may contain U+FFFD, and the pieces add up to the full decode.
        ids = []
        for _ in range(rng.randrange(1, 12)):
            ids += tok.encode("".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 6))))
            if rng.random() < 0.3:
                ids.append(rng.choice(specials))
        for skip in (True, False):
            pieces, tail = _stream(tok, ids, skip)
            assert not any(REPLACEMENT_CHAR in p for p in pieces + [tail]), ids
            assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip)
        # Arbitrary ids (invalid UTF-8 too): pieces never end mid-character (in U+FFFD)
        # and, with what flush() returns, still add up to the full decode.
        ids = [rng.choice(fragments) if rng.random() < 0.6 else rng.randrange(MODEL_VOCAB)
               for _ in range(rng.randrange(1, 30))]
        for skip in (True, False):
            pieces, tail = _stream(tok, ids, skip)
            assert not any(p.endswith(REPLACEMENT_CHAR) for p in pieces), ids
            assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip), ids


def test_tokenizer_json_wins_and_errors(tok_dir, tmp_path):
    (tmp_path / "tiktoken.model").write_text("not base64!! 0\n")
    with pytest.raises(TokenizerError, match="tiktoken.model"):
        Tokenizer.from_dir(tmp_path)
    # A tiktoken.model rewritten at the same path is read afresh (tiktoken's own loader
    # would serve a cached copy keyed by the path).
    write_tokenizer_files(tmp_path)
    assert Tokenizer.from_dir(tmp_path).encode("ab") == Tokenizer.from_dir(tok_dir).encode("ab")
    write_ranks(tmp_path / "tiktoken.model", {bytes([b]): b for b in range(256)})
    fresh = Tokenizer.from_dir(tmp_path)
    assert fresh.encode("ab") == [97, 98] and fresh.bos_token_id == BASE and fresh.vocab_size == 512
    # A config key may override the split pattern.
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tiktoken_pattern": r"\S+|\s+"}))
    assert Tokenizer.from_dir(tmp_path).backend.encoding._pat_str == r"\S+|\s+"
    # tokenizer.json, when present, is what loads.
    import tokenizers

    tokenizers.Tokenizer(tokenizers.models.BPE(vocab={"a": 0}, merges=[])).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").unlink()
    assert isinstance(Tokenizer.from_dir(tmp_path).backend, tokenizers.Tokenizer)


def test_llm_accepts_text_prompt(tmp_path):
    from jaxserve.llm import LLM

    src = Path("checkpoints/tiny-kimi-k2")
    assert json.loads((src / "config.json").read_text())["vocab_size"] == MODEL_VOCAB
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(src / name, tmp_path / name)
    write_tokenizer_files(tmp_path)
    llm = LLM(str(tmp_path), num_pages=16, page_size=8)
    assert llm.tokenizer is not None and llm.tokenizer.vocab_size >= MODEL_VOCAB
    prompt = "Cześć, 中文 😀!"
    [out] = llm.generate([prompt], max_tokens=6, temperature=0.0, ignore_eos=True)
    assert list(out.prompt_token_ids) == llm.tokenizer.encode(prompt)
    assert len(out) == 6 and out.text == llm.tokenizer.decode(list(out))
    chat = llm.apply_chat_template("hi")
    assert chat == f"{BOS}<|user|>hi{EOS}\n<|assistant|>"
