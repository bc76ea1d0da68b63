"""The KV pool from a byte budget, the memory report, and the planner agreeing with the engine."""
import json

import numpy as np
import pytest

from tests.hf_models import build_glm4_moe
from jaxserve import LLM
from jaxserve.kv.memory import parse_size
from jaxserve.planner.plan import plan

KW = dict(page_size=8)


def test_parse_size():
    assert parse_size("48GiB") == 48 * 2**30 and parse_size("11GB") == 11 * 10**9
    assert parse_size("512 MiB") == 512 * 2**20 and parse_size(123) == 123 and parse_size("0") == 0
    with pytest.raises(ValueError, match="bad size"):
        parse_size("12 parsecs")


def test_fp8_admits_about_twice_the_tokens_of_bf16(tiny_ckpt):
    budget = 2 * 2**20
    reps = {f: LLM(tiny_ckpt, kv_format=f, kv_cache_memory=budget, **KW).memory_report() for f in ("bf16", "fp8_e4m3")}
    for f, r in reps.items():
        assert r["kv_bytes"] <= budget < r["kv_bytes"] + r["kv_bytes_per_page"]  # as many pages as fit
        assert r["kv_bytes"] == (r["kv_pages"] + 1) * r["kv_bytes_per_page"]  # what is really allocated
        assert r["max_cached_tokens"] == r["kv_pages"] * 8
    # MLA per layer and token: latent 32 + rope 16 values; fp8 adds a float32 scale to each.
    assert reps["bf16"]["kv_bytes_per_token"] == 2 * 2 * 48
    assert reps["fp8_e4m3"]["kv_bytes_per_token"] == 2 * (48 + 2 * 4)
    ratio = reps["fp8_e4m3"]["max_cached_tokens"] / reps["bf16"]["max_cached_tokens"]
    assert ratio == pytest.approx(96 / 56, rel=0.02)


def test_memory_fraction_reads_available_memory(tiny_ckpt):
    with open("/proc/meminfo") as f:
        avail = int(dict(line.split(":", 1) for line in f)["MemAvailable"].split()[0]) * 1024
    r = LLM(tiny_ckpt, memory_fraction=2e-4, **KW).memory_report()
    assert r["kv_bytes"] == pytest.approx(avail * 2e-4, rel=0.25)  # RAM moves a little between the reads


def test_bad_budgets_are_clear_errors(tiny_ckpt):
    with pytest.raises(ValueError, match="at least 2"):
        LLM(tiny_ckpt, kv_cache_memory="1KiB", **KW)
    with pytest.raises(ValueError, match="bad size"):
        LLM(tiny_ckpt, kv_cache_memory="lots", **KW)
    with pytest.raises(ValueError, match="memory_fraction"):
        LLM(tiny_ckpt, memory_fraction=1.5, **KW)


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_e4m3"])
def test_planner_equals_what_the_engine_allocates(tiny_ckpt, tmp_path, kv_format):
    """The same checkpoint through `jaxserve plan`'s function and through the engine: the same
    bytes per cached token (MLA and GQA)."""
    glm = tmp_path / "glm"
    build_glm4_moe(glm, num_hidden_layers=2)
    for path in (tiny_ckpt, str(glm)):
        with open(f"{path}/config.json") as f:
            config = json.load(f)
        planned = plan(config, devices=1, kv_format=kv_format).kv_bytes_per_token
        engine = LLM(path, kv_format=kv_format, num_pages=4, **KW).memory_report()["kv_bytes_per_token"]
        assert planned == engine, (path, planned, engine)


def test_report_counts_one_copy_when_shared(tiny_ckpt):
    r = LLM(tiny_ckpt, prefill_weights="int8", decode_weights="int8", num_pages=4, **KW).memory_report()
    w = r["weight_bytes"]
    assert w["resident"] == w["prefill"] == w["decode"] and np.isfinite(w["resident"])


def _plan_json(path, capsys) -> dict:
    from jaxserve.planner.cli import main as plan_main

    assert plan_main(["--model", str(path), "--devices", "1", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_weights_equal_what_the_engine_allocates(tmp_path, capsys):
    """`jaxserve plan` on a checkpoint gives the bytes the engine allocates when it serves it as
    shipped: bf16 (MLA and GQA), fp8 block-quantized, and compressed-tensors int4 experts (whose
    bf16 scales stay bf16)."""
    from tests.hf_models import build_deepseek_v3
    from tests.test_prequantized import make_prequantized

    build_deepseek_v3(tmp_path / "base", num_hidden_layers=2, intermediate_size=192, seed=3)
    build_glm4_moe(tmp_path / "glm", num_hidden_layers=2)
    ckpts = [tmp_path / "base", tmp_path / "glm"]
    ckpts += [make_prequantized(tmp_path / "base", tmp_path / k, k)[0] for k in ("fp8", "int4")]
    for path in ckpts:
        planned = _plan_json(path, capsys)
        w = LLM(str(path), dtype="bfloat16", num_pages=4, **KW).memory_report()["weight_bytes"]
        assert planned["checkpoint_bytes"] == planned["weights_bytes_per_device"] == w["resident"], path.name
        assert w["prefill"] == w["decode"] == w["resident"]  # one format: one copy


def test_engine_formats_allocate_what_the_shared_size_function_says():
    """Every registered format's arrays take exactly ``storage_bytes`` (the function the planner
    sums), odd shapes (partial blocks and groups) and stacked experts included."""
    from jaxserve.quant.formats import get_weight_format, weight_format_names

    rng = np.random.default_rng(0)
    for name in weight_format_names():
        fmt = get_weight_format(name)
        for shape in [(64, 48), (3, 200, 130), (40, 7)]:
            qw = fmt.quantize(rng.standard_normal(shape).astype(np.float32))
            assert qw.nbytes == fmt.storage_bytes(shape), (name, shape)
