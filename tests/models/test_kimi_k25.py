"""Kimi K2.5/K2.6 (``kimi_k25``): a multimodal wrapper whose text model is a DeepSeek-V3.

The wrapper is built and saved by transformers' own Kimi_K25ForConditionalGeneration (tiny
text model, one-layer vision tower of width 8), with the text weights of a tiny
DeepseekV3ForCausalLM copied in. jaxserve must serve the wrapper's text model exactly as it
serves the bare DeepSeek-V3 checkpoint, and match transformers' wrapper.
"""
import json
import logging

import numpy as np
import pytest
import torch
from flax import nnx
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.hf_models import build_deepseek_v3, build_kimi_k25
from jaxserve import LLM
from jaxserve.cli import main as jaxserve_main
from jaxserve.config import ConfigError
from jaxserve.loader import CheckpointError, load_config, load_model
from jaxserve.planner.inventory import count_params
from jaxserve.quant.phase import PhaseWeight
from tests.test_prequantized import make_prequantized

PROMPT = [int(x) for x in np.random.RandomState(1).randint(2, 256, size=19)]
KW = dict(dtype="float32", kv_format="float32", num_pages=32, page_size=8)
TEXT = ("language_model.model.", "language_model.lm_head.")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    text_dir, wrapped_dir = tmp_path_factory.mktemp("dsv3"), tmp_path_factory.mktemp("kimi_k25")
    text_model = build_deepseek_v3(text_dir, num_hidden_layers=2)
    wrapper = build_kimi_k25(wrapped_dir, text_model)
    return text_dir, wrapped_dir, wrapper


@pytest.fixture(scope="module")
def text_llm(ckpts):
    return LLM(str(ckpts[0]), **KW)


def logits(llm, ids):
    """[T, V] float32 logits of one prefill over `ids`."""
    pages = np.array([list(range(1, len(ids) // llm.page_size + 2))], np.int32)
    out = llm.runner.run(np.array([ids], np.int32), [0], [len(ids)], pages, all_logits=True)
    return np.asarray(out)[0]


def rewrite(src, dst, rename, edit_config=lambda c: c):
    """Copy checkpoint `src` to `dst`, renaming each tensor (None drops it) and editing config.json."""
    dst.mkdir()
    tensors = {rename(k): v for k, v in load_file(src / "model.safetensors").items() if rename(k) is not None}
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(edit_config(json.loads((src / "config.json").read_text()))))
    return dst


def release_form(name):
    """transformers 5.24 writes `language_model.model.blocks.N`; Moonshot's release names `layers`."""
    return name.replace("language_model.model.blocks.", "language_model.model.layers.")


def module_form(name):
    """transformers' own module names (Kimi_K25ForConditionalGeneration.model.language_model, .lm_head)."""
    name = release_form(name)
    if name.startswith("language_model.model."):
        return "model.language_model." + name[len("language_model.model."):]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model."):]
    return "model." + name if not name.startswith("model.") else name


def kimi_release_config(c):
    """The config as Moonshot ships it: remote-code architecture name, text model_type kimi_k2."""
    text = dict(c["text_config"], model_type="kimi_k2")
    return dict(c, architectures=["KimiK25ForConditionalGeneration"], text_config=text)


def test_the_checkpoint_is_a_real_wrapper(ckpts):
    raw = json.loads((ckpts[1] / "config.json").read_text())
    assert raw["model_type"] == "kimi_k25" and raw["text_config"]["model_type"] == "deepseek_v3"
    with safe_open(ckpts[1] / "model.safetensors", "pt") as f:
        names = list(f.keys())
    assert any(n.startswith("vision_tower.") for n in names) and any("mm_projector." in n for n in names)
    assert all(n.startswith(TEXT) or "vision_tower." in n or "mm_projector." in n for n in names)
    cfg = load_config(ckpts[1])
    assert cfg.architecture == "DeepseekV3ForCausalLM" and cfg.num_hidden_layers == 2 and cfg.kv_lora_rank == 32


@pytest.mark.parametrize("form", ["saved", "release", "modules"])
def test_logits_equal_the_bare_text_model(ckpts, text_llm, tmp_path, form):
    path = ckpts[1] if form == "saved" else (
        rewrite(ckpts[1], tmp_path / "w", release_form, kimi_release_config) if form == "release"
        else rewrite(ckpts[1], tmp_path / "w", module_form))
    err = np.abs(logits(LLM(str(path), **KW), PROMPT) - logits(text_llm, PROMPT)).max()
    print(f"{form}: max |logit diff| wrapped vs bare = {err:.1e}")
    assert err <= 1e-5


def test_greedy_tokens_equal_the_bare_text_model(ckpts, text_llm):
    ours = LLM(str(ckpts[1]), **KW).generate([PROMPT], max_tokens=16, ignore_eos=True)[0]
    assert len(ours) == 16
    assert ours == text_llm.generate([PROMPT], max_tokens=16, ignore_eos=True)[0]


def test_logits_match_the_transformers_wrapper(ckpts):
    with torch.no_grad():
        ref = ckpts[2](torch.tensor([PROMPT])).logits[0].float().numpy()
    err = np.abs(logits(LLM(str(ckpts[1]), **KW), PROMPT) - ref).max()
    print(f"max |logit diff| vs transformers Kimi_K25ForConditionalGeneration = {err:.1e}")
    assert err <= 1e-4


def test_skipped_vision_tensors_are_logged(ckpts, caplog):
    with safe_open(ckpts[1] / "model.safetensors", "pt") as f:
        vision = [f.get_tensor(n) for n in f.keys() if not n.startswith(TEXT)]
    nbytes = sum(t.numel() * t.element_size() for t in vision)
    with caplog.at_level(logging.INFO, logger="jaxserve.loader"):
        LLM(str(ckpts[1]), **KW)
    assert all(r.levelno == logging.WARNING for r in caplog.records if "skipped" in r.getMessage())
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"skipped {len(vision)} vision/projector tensor(s), {nbytes} bytes" in lines[0]
    assert "vision_tower.*" in lines[0] and "mm_projector.*" in lines[0]


def test_top_level_quantization_config_applies_to_the_text_weights(tmp_path):
    """Kimi ships compressed-tensors int4 experts with quantization_config at the wrapper's top level."""
    base = tmp_path / "base"
    build_deepseek_v3(base, num_hidden_layers=2, seed=4)
    int4, _ = make_prequantized(base, tmp_path / "int4", "int4")
    qc = json.loads((int4 / "config.json").read_text())["quantization_config"]

    def wrap(c):
        text = {k: v for k, v in c.items() if k != "quantization_config"}
        return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                "text_config": dict(text, model_type="kimi_k2"), "quantization_config": qc}

    wrapped = rewrite(int4, tmp_path / "wrapped", lambda n: "language_model." + n, wrap)
    extra = load_file(wrapped / "model.safetensors")
    extra["mm_projector.proj.0.weight"] = torch.ones(4, 4)
    save_file(extra, wrapped / "model.safetensors", metadata={"format": "pt"})
    _, model = load_model(wrapped)
    _, state = nnx.split(model)
    vals = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)}
    assert vals["layers/1/mlp/w_up"].qw.format == "int4:g32"  # experts stay int4, as shipped
    for key in ("layers/1/attn/q_b", "lm_head"):  # the ignore list ("lm_head", ...) names the text model's
        assert not isinstance(vals[key], PhaseWeight), key
    a, b = LLM(str(int4), **KW), LLM(str(wrapped), **KW)
    assert np.abs(logits(a, PROMPT) - logits(b, PROMPT)).max() <= 1e-5


def test_bad_wrappers_are_refused(ckpts, tmp_path):
    no_text = rewrite(ckpts[1], tmp_path / "no_text", lambda n: None if n.startswith(TEXT) else n)
    with pytest.raises(CheckpointError, match="no text-model tensors"):
        LLM(str(no_text), **KW)
    stray = rewrite(ckpts[1], tmp_path / "stray",
                    lambda n: "lm_head.weight" if n == "mm_projector.proj.0.weight" else n)
    with pytest.raises(CheckpointError, match="mixes naming forms: lm_head.weight"):
        LLM(str(stray), **KW)
    odd = tmp_path / "odd"
    odd.mkdir()
    text = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
    (odd / "config.json").write_text(json.dumps({"architectures": ["Foo"], "model_type": "foo", "text_config": text}))
    with pytest.raises(ConfigError, match="MixtralForCausalLM"):
        load_config(odd)


def test_plan_reads_the_text_model(ckpts, capsys):
    out = {}
    for key, path in (("bare", ckpts[0]), ("wrapped", ckpts[1])):
        assert jaxserve_main(["plan", "--model", str(path), "--devices", "1", "--json"]) == 0
        out[key] = json.loads(capsys.readouterr().out)
        out[key].pop("model")  # the path given
    assert out["wrapped"]["architecture"] == "DeepseekV3ForCausalLM"
    assert out["wrapped"] == out["bare"]


def test_the_wrappers_tie_setting_and_stop_ids_carry_over(ckpts, tmp_path):
    """transformers ties the wrapper's lm_head by the wrapper's own tie_word_embeddings; the
    wrapper's eos ids fill a text config that has none."""
    raw = json.loads((ckpts[1] / "config.json").read_text())
    tied = dict(raw, tie_word_embeddings=True)  # the text_config still says false
    (tmp_path / "config.json").write_text(json.dumps(tied))
    assert load_config(ckpts[1]).tie_word_embeddings is False
    assert load_config(tmp_path).tie_word_embeddings is True
    text = raw["text_config"]
    no_eos = dict(tied, eos_token_id=[7, 9], text_config={k: v for k, v in text.items() if k != "eos_token_id"})
    (tmp_path / "config.json").write_text(json.dumps(no_eos))
    assert load_config(tmp_path).eos_token_id == (7, 9)
    (tmp_path / "config.json").write_text(json.dumps(dict(no_eos, text_config=raw["text_config"])))
    assert load_config(tmp_path).eos_token_id == (1,)  # the text model's own wins
    untied = count_params(raw)
    assert count_params(tied)["embed"] == untied["embed"] - text["vocab_size"] * text["hidden_size"]
    tensors = rewrite(ckpts[1], tmp_path / "t", lambda n: n, lambda c: tied)
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\): lm_head.weight .*stores e.g."):
        LLM(str(tensors), **KW)
