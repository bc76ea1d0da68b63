"""Capacity planner: the article's figures, exact parameter counts, KV layouts, CLI."""
import json

import pytest

from jaxserve.planner import (MODEL_PRESETS, UnsupportedArchitecture, count_params, kv_layout, load_model_config,
                              parse_weight_format, plan)
from jaxserve.planner.cli import main, parse_size

KIMI, GLM46, GLM5 = (MODEL_PRESETS[k] for k in ("kimi-k2.6", "glm-4.6", "glm-5"))


# ---------------------------------------------------------------- the article


def test_kimi_kv_tokens_match_article():
    bf16 = plan(KIMI, devices=8, device="h200", kv_format="bf16")
    fp8 = plan(KIMI, devices=8, device="h200", kv_format="fp8")
    assert bf16.formats["experts"] == "int4:g32" and bf16.formats["attention"] == "bf16"  # as shipped
    assert bf16.kv_tokens == pytest.approx(686_000, rel=0.05)
    assert fp8.kv_tokens == pytest.approx(1_370_000, rel=0.05)
    assert 1.95 <= fp8.kv_tokens / bf16.kv_tokens <= 2.0  # fp8 scales cost a little
    # tp=8: MLA latent replicated, so aggregate == per device, and ~48.2 GB of KV per GPU
    assert bf16.kv_tokens == bf16.kv_tokens_per_device
    assert bf16.kv_budget_bytes_per_device == pytest.approx(48.2e9, rel=0.02)


def test_kimi_kv_bytes_per_token():
    assert plan(KIMI, kv_format="bf16").kv_bytes_per_token == 61 * 576 * 2 == 70_272
    assert plan(KIMI, kv_format="fp8", kv_scale_bytes=0).kv_bytes_per_token == 35_136
    fp8 = plan(KIMI, kv_format="fp8")  # float32 scale for latent and rope, per layer
    assert fp8.kv_bytes_per_token == 35_136 + 61 * 2 * 4
    assert fp8.kv_scale_bytes_per_token == 488
    assert fp8.kv_bytes_per_token_per_device == fp8.kv_bytes_per_token  # MLA: replicated


def test_kimi_checkpoint_int4_g32_experts_bf16_rest():
    r = plan(KIMI)
    assert r.checkpoint_bytes == pytest.approx(594e9, rel=0.01)
    # int4 g32: 0.5 B + 2 B / 32 per expert weight
    assert r.checkpoint_bytes_by_group["experts"] == pytest.approx(r.params["experts"] * 0.5625, rel=1e-9)
    assert r.weights_bytes_per_device > r.checkpoint_bytes / 8  # replicated parts


def test_glm5_fp8_vs_int4_bytes_by_hand():
    """Stored bytes of the routed experts from GLM-5's dimensions (78 layers, the first 3 dense:
    75 MoE layers x 256 experts x 3 matrices of 6144 x 2048, both dims multiples of 128):
    - fp8:block128: 1 B a weight + one float32 scale per 128 x 128 block (48 x 16 blocks);
    - int4:g128: 0.5 B a weight + one bf16 scale per 128 weights along K;
    the other matmul weights stay bf16 (2 B) with int4 experts, and the embedding and head are
    bf16 in both plans."""
    experts = 75 * 256 * 3 * 6144 * 2048
    fp8 = plan(GLM5, weights="fp8")
    int4 = plan(GLM5, experts_format="int4:g128")  # rest bf16 as shipped
    assert fp8.params["experts"] == int4.params["experts"] == experts
    assert fp8.checkpoint_bytes_by_group["experts"] == experts + 75 * 256 * 3 * (48 * 16) * 4
    assert int4.checkpoint_bytes_by_group["experts"] == experts // 2 + experts // 128 * 2
    for group in ("attention", "mlp"):
        assert int4.checkpoint_bytes_by_group[group] == 2 * int4.params[group]
    assert fp8.checkpoint_bytes_by_group["embed"] == int4.checkpoint_bytes_by_group["embed"] == 2 * 2 * 154880 * 6144
    assert int4.weights_bytes_per_device < fp8.weights_bytes_per_device
    assert int4.kv_tokens > 2 * fp8.kv_tokens


def test_glm5_preset_is_the_config_docs_planner_cites():
    """docs/PLANNER.md section 2 cites zai-org/GLM-5's config.json field by field; the preset must
    hold exactly those values (a preset edit that drifts from the cited config fails here)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "PLANNER.md").read_text()
    section = text[text.index("`glm-5` is the text model of"):text.index("Devices: `h200`")]

    def shown(name):
        v = GLM5[name]
        if name == "rope_parameters":
            return f"{v['rope_type']}, theta {v['rope_theta']:,}"
        return str(v).lower() if isinstance(v, bool) else f"{v:,}"

    cited = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        for name_cell, value_cell in zip(cells[::3], cells[1::3]):
            names = re.findall(r"`(\w+)`", name_cell)
            values = [v.strip() for v in value_cell.split(" / ")] if len(names) > 1 else [value_cell]
            cited.update(zip(names, values))
    assert len(cited) == 26
    assert {k: shown(k) for k in cited} == cited


# ---------------------------------------------------------------- parameter counts


def test_kimi_k2_param_count_by_hand():
    """Kimi K2's published config.json dimensions (DeepSeek-V3 layout), counted by hand:
    hidden 7168, 61 layers (layer 0 dense, 60 MoE), vocab 163840, 64 heads, q_lora 1536,
    kv_lora 512, qk_nope 128 + qk_rope 64, v 128, dense intermediate 18432, 384 routed experts
    + 1 shared of intermediate 2048, no attention biases, untied head."""
    h, layers, vocab, heads = 7168, 61, 163840, 64
    attention = (h * 1536  # q_a_proj
                 + 1536 * heads * (128 + 64)  # q_b_proj
                 + h * (512 + 64)  # kv_a_proj_with_mqa: latent + shared rope key
                 + 512 * heads * (128 + 128)  # kv_b_proj: per-head nope key + value
                 + heads * 128 * h)  # o_proj
    norms = layers * (2 * h + 1536 + 512) + h  # input/post-attention, q_a/kv_a layernorms; final norm
    experts = 60 * 384 * 3 * h * 2048  # gate, up, down per routed expert
    mlp = 3 * h * 18432 + 60 * 3 * h * 2048  # layer 0's dense MLP; the shared expert of each MoE layer
    router = 60 * (384 * h + 384)  # gate weight + e_score_correction_bias
    embed = 2 * vocab * h  # embed_tokens + lm_head
    p = count_params(KIMI)
    assert p["experts"] == experts == 1_014_686_023_680
    assert p["attention"] == layers * attention
    assert p["embed"] == embed
    assert p["total"] == layers * attention + norms + experts + mlp + router + embed == 1_026_408_232_448
    assert p["total"] == sum(v for k, v in p.items() if k != "total")


def test_glm46_param_count_by_hand():
    """GLM-4.6's config.json dimensions (as GLM-4.5), counted by hand: hidden 5120, 92 layers
    (the first 3 dense), vocab 151552, 96 query heads and 8 KV heads of 128, q/k/v biases,
    q/k RMS norms over the head dim, dense intermediate 12288, 160 routed experts + 1 shared of
    intermediate 1536, untied head; the multi-token-prediction layer is not counted."""
    h, layers, vocab, d = 5120, 92, 151552, 128
    attention = (h * 96 * d + 96 * d  # q_proj + bias
                 + 2 * (h * 8 * d + 8 * d)  # k_proj, v_proj + biases
                 + 96 * d * h)  # o_proj
    norms = layers * (2 * h + 2 * d) + h  # layer norms, q_norm / k_norm; final norm
    experts = 89 * 160 * 3 * h * 1536
    mlp = 3 * 3 * h * 12288 + 89 * 3 * h * 1536
    router = 89 * (160 * h + 160)
    p = count_params(GLM46)
    assert p["experts"] == experts and p["attention"] == layers * attention and p["embed"] == 2 * vocab * h
    assert p["total"] == layers * attention + norms + experts + mlp + router + 2 * vocab * h == 352_797_829_024


def _tiny(cfg, **kw):
    d = {k: v for k, v in cfg.items() if k != "quantization_config"}
    d.update(num_hidden_layers=5, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
             vocab_size=300, n_routed_experts=8)
    if "q_lora_rank" in d:
        d.update(q_lora_rank=48, kv_lora_rank=32, num_attention_heads=4, num_key_value_heads=4)
    else:
        d.update(num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    return d | kw


@pytest.mark.slow
@pytest.mark.parametrize("cfg,kw", [
    (KIMI, {}), (KIMI, dict(q_lora_rank=None, attention_bias=True, tie_word_embeddings=True, n_shared_experts=2)),
    (GLM46, {}), (GLM46, dict(use_qk_norm=False, attention_bias=False)),
    (GLM5, dict(index_topk_freq=2, index_n_heads=4, index_head_dim=16)),
    (GLM5, dict(attention_bias=True, index_n_heads=4, index_head_dim=16)),
    (KIMI, "full"), (GLM46, "full"), (GLM5, "full")])
def test_param_counts_equal_transformers(cfg, kw):
    """Every parameter transformers builds (plus the e_score_correction_bias buffer), exactly."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    d = dict(cfg) if kw == "full" else _tiny(cfg, **kw)
    arch = d["architectures"][0]
    hf = {k: v for k, v in d.items() if k not in ("model_type", "architectures", "quantization_config")}
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**hf)
    with torch.device("meta"):
        model = getattr(transformers, arch)(config)
    n = sum(p.numel() for p in model.parameters())
    n += sum(b.numel() for name, b in model.named_buffers() if "e_score_correction_bias" in name)
    assert count_params(d)["total"] == n


def test_mtp_layers_optional():
    assert count_params(GLM46, include_mtp=True)["total"] > count_params(GLM46)["total"]
    assert count_params(KIMI, include_mtp=True) == count_params(KIMI)  # Kimi ships none


# ---------------------------------------------------------------- KV layouts and sharding


def test_gqa_kv_split_by_heads():
    full = 92 * 2 * 8 * 128 * 2  # layers x (K, V) x kv_heads x head_dim x bf16
    r8 = plan(GLM46, devices=8)
    assert r8.kv_bytes_per_token == full and r8.kv_bytes_per_token_per_device == full // 8
    r16 = plan(GLM46, devices=16)  # tp 16 > 8 KV heads: each device still holds one head
    assert r16.kv_bytes_per_token_per_device == full // 8
    r4 = plan(GLM46, devices=8, tp=4)  # 2 heads per device, 2 replicas
    assert r4.kv_bytes_per_token_per_device == full // 4 and r4.dp == 2
    assert r4.kv_tokens == 2 * r4.kv_tokens_per_device
    fp8 = plan(GLM46, devices=8, kv_format="fp8")  # one float32 scale per token per head (K and V)
    assert fp8.kv_bytes_per_token_per_device == full // 16 + 92 * 2 * 1 * 4


def test_mla_kv_replicated_and_dp():
    r = plan(KIMI, devices=8, tp=4)
    assert r.dp == 2 and r.kv_bytes_per_token_per_device == r.kv_bytes_per_token
    assert r.kv_tokens == 2 * r.kv_tokens_per_device
    assert r.concurrent_sequences == 2 * (r.kv_tokens_per_device // r.context_len)


def test_glm5_kv_counts_indexer_key():
    lay = kv_layout(GLM5)
    assert lay.kind == "mla" and lay.values == 78 * (512 + 64 + 128)


def test_weights_that_do_not_fit():
    r = plan(KIMI, devices=8, device="h100", weights="bf16")
    assert not r.fits and r.kv_tokens == 0 and r.concurrent_sequences == 0


# ---------------------------------------------------------------- formats and errors


def test_weight_formats():
    assert parse_weight_format("int4:g32").nbytes(128, 256) == 128 * 128 + 2 * 128 * 8
    assert parse_weight_format("fp8").nbytes(256, 256) == 256 * 256 + 4 * 4
    assert parse_weight_format("fp8:channel").nbytes(256, 256) == 256 * 256 + 4 * 256
    assert parse_weight_format("bf16").nbytes(3, 5) == 30
    with pytest.raises(ValueError, match="weight format"):
        parse_weight_format("int3")
    with pytest.raises(ValueError, match="KV format"):
        plan(KIMI, kv_format="int2")
    with pytest.raises(ValueError, match="divide"):
        plan(KIMI, devices=8, tp=3)
    assert parse_size("11GB") == 11 * 10**9 and parse_size("1GiB") == 2**30


def test_unknown_architecture(capsys, tmp_path):
    cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
    with pytest.raises(UnsupportedArchitecture, match="MixtralForCausalLM"):
        plan(cfg)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert main(["--model", str(path)]) == 2
    assert "MixtralForCausalLM" in capsys.readouterr().err


def test_multimodal_wrapper_uses_text_config():
    wrapped = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": KIMI}
    assert count_params(wrapped) == count_params(KIMI)


# ---------------------------------------------------------------- CLI


def test_config_json_path(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(KIMI))
    for spec in (str(tmp_path / "config.json"), str(tmp_path)):
        assert load_model_config(spec)[1] == KIMI
        assert main(["--model", spec, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["kv_tokens"] == plan(KIMI).kv_tokens


def test_cli_json_keys(capsys):
    assert main(["--model", "kimi-k2.6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("weights_bytes_per_device", "kv_bytes_per_token", "kv_tokens", "checkpoint_bytes", "params",
                "concurrent_sequences", "assumptions", "formats", "usable_fraction", "reserve_bytes"):
        assert key in out
    assert out["params"]["total"] == count_params(KIMI)["total"]


def test_cli_compare_and_table(capsys):
    assert main(["--model", "kimi-k2.6", "--compare", "kv", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans["fp8 KV"]["kv_tokens"] > 1.95 * plans["bf16 KV"]["kv_tokens"]
    assert main(["--model", "glm-5", "--compare", "weights", "--reserve", "10GiB"]) == 0
    text = capsys.readouterr().out
    assert "705 GB" in text and "int4 g128 + fp8" in text and "assumptions:" in text
    assert main(["--experts-format", "int4:g32", "--rest-format", "bf16", "--kv-format", "fp8"]) == 0
    r = plan(KIMI, experts_format="int4:g32", attention_format="bf16", mlp_format="bf16", kv_format="fp8")
    assert f"{r.kv_tokens:,}" in capsys.readouterr().out  # the CLI prints the plan's figure
    # ... which is the KV budget over the bytes a token takes (hand-checked in test_kimi_kv_bytes_per_token)
    assert r.kv_tokens == r.dp * (r.kv_budget_bytes_per_device // (35_136 + 488))


def test_register_adds_plan_subcommand(capsys):
    import argparse

    from jaxserve.planner.cli import register
    parser = argparse.ArgumentParser(prog="jaxserve")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", "--model", "glm-4.6", "--kv-format", "fp8", "--json"])
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["kv_bytes_per_token_per_device"] == 92 * 2 * (128 + 4)
