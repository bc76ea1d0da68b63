"""``jaxserve convert``: per-phase weight representations saved with orbax, restored bit-exact
(also sharded over the 8 virtual CPU devices), served by LLM without requantizing."""
import argparse
import json

import jax
import numpy as np
import pytest
from flax import nnx

from tests.hf_models import build_deepseek_v3
from jaxserve import LLM
from jaxserve.checkpoint import orbax_io
from jaxserve.checkpoint.convert import convert, register
from jaxserve.loader import load_model
from jaxserve.quant.phase import PhaseSet, quantize_state
from jaxserve.sharding import make_mesh

PROMPT = [5, 17, 99, 3, 250, 42, 7, 8, 9, 10, 11, 12, 13]
FORMATS = {"prefill": "fp8:block128", "decode": "int4:g128"}
KW = dict(num_pages=16, page_size=8, max_num_seqs=2)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("conv_src")
    # K = 128 or more, as real layers are: int4:g128 pays no padding (a K=32 layer pads 4x).
    build_deepseek_v3(path, num_hidden_layers=2, seed=7, hidden_size=128, intermediate_size=256,
                      moe_intermediate_size=128)
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1024}))
    return path


@pytest.fixture(scope="module")
def converted(src, tmp_path_factory):
    """Converted through the CLI entry point; -> (dst, printed report)."""
    import contextlib
    import io

    dst = tmp_path_factory.mktemp("conv") / "dst"
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["convert", str(src), str(dst), "--prefill-weights", "fp8:block128",
                              "--decode-weights", "int4:g128", "--kv-format", "fp8_e4m3"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert args.func(args) == 0
    return dst, out.getvalue()


def leaves(state):
    return jax.tree_util.tree_leaves_with_path(state)


def assert_bit_exact(a, b, shardings=False):
    la, lb = leaves(a), leaves(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
        assert np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)), jax.tree_util.keystr(path)
        if shardings:
            assert x.sharding.is_equivalent_to(y.sharding, x.ndim), jax.tree_util.keystr(path)
    return len(la)


def phase_states(path, mesh=None):
    _, model = load_model(path, mesh=mesh)
    _, state = nnx.split(model)
    return {ph: quantize_state(state, FORMATS[ph], mesh) for ph in FORMATS}


def test_layout_metadata_and_report(converted, src):
    dst, report = converted
    meta = orbax_io.read_metadata(dst)
    assert (meta["prefill_weights"], meta["decode_weights"], meta["kv_format"]) == (
        "fp8:block128", "int4:g128", "fp8_e4m3")
    assert (dst / "tokenizer_config.json").exists() and (dst / "generation_config.json").exists()
    assert "quantization_config" not in json.loads((dst / "config.json").read_text())
    p = meta["params"]
    assert p["layers/1/mlp/w_up"]["prefill"] == "fp8:block128" and p["layers/1/mlp/w_up"]["decode"] == "int4:g128"
    assert p["norm/scale"]["shared"] and p["embed"]["shared"] and not p["lm_head"]["shared"]
    sizes = meta["sizes"]
    assert sizes["decode_total"] < sizes["prefill_total"]  # int4 decode weights are smaller than fp8
    assert sizes["sections"]["decode"] < 0.6 * sizes["sections"]["prefill"]
    for line in ("prefill   fp8:block128", "decode    int4:g128", "shared    unquantized float32"):
        assert line in report, report
    print(report)


def test_restore_is_bit_exact(converted, src):
    dst, _ = converted
    want, got = phase_states(src), phase_states(dst)
    n = sum(assert_bit_exact(want[ph], got[ph]) for ph in FORMATS)
    print(f"{n} leaves bit-exact")
    # The phases use the restored arrays themselves: nothing is requantized at load.
    _, model = load_model(dst)
    _, state = nnx.split(model)
    stored = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)}["layers/1/mlp/w_up"]
    assert isinstance(stored, PhaseSet) and stored.labels == ("fp8:block128", "int4:g128")
    for i, ph in enumerate(FORMATS):
        used = {"/".join(map(str, p)): v.get_value()
                for p, v in nnx.to_flat_state(quantize_state(state, FORMATS[ph]))}["layers/1/mlp/w_up"]
        assert used.qw.values is stored.members[i].qw.values


def test_sharded_restore_keeps_shardings(converted, src):
    dst, _ = converted
    mesh = make_mesh(8)
    want, got = phase_states(src, mesh), phase_states(dst, mesh)
    for ph in FORMATS:
        assert_bit_exact(want[ph], got[ph], shardings=True)
    experts = [x for _, x in leaves(got["decode"]) if x.ndim == 3 and x.shape[0] == 16]
    assert experts and all(len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated for x in experts)


def test_llm_generates_the_same_tokens(converted, src):
    dst, _ = converted
    fmts = dict(prefill_weights=FORMATS["prefill"], decode_weights=FORMATS["decode"], kv_format="fp8_e4m3")
    a = LLM(str(src), **fmts, **KW)
    b = LLM(str(dst), **fmts, **KW)
    assert b.runner.weight_formats == a.runner.weight_formats
    assert np.array_equal(a.logprobs(PROMPT), b.logprobs(PROMPT))
    out_a = a.generate([PROMPT], max_tokens=8, ignore_eos=True)
    assert out_a == b.generate([PROMPT], max_tokens=8, ignore_eos=True) and len(out_a[0]) == 8


def test_serving_a_converted_checkpoint_compiles_nothing_after_warmup(converted):
    """Restored parameters are committed to a device; so is the KV pool from the start, so the
    programs warm-up compiled are the ones serving calls (the strict guard raises otherwise)."""
    dst, _ = converted
    llm = LLM(str(dst), kv_format="fp8_e4m3", num_pages=32, page_size=8, max_num_seqs=2, max_prefill_seqs=2,
              prefill_chunk=16, max_num_batched_tokens=32, max_model_len=64)
    assert llm.engine.config.strict_compiles  # tests run strict (tests/conftest.py)
    llm.warmup()
    llm.generate([PROMPT, PROMPT[:5]], max_tokens=6, ignore_eos=True)
    llm.generate([PROMPT[:3]], max_tokens=3, ignore_eos=True)  # decode batch 1
    assert llm.engine.snapshot().compiles_after_warmup == 0


def test_disagreeing_formats_are_refused(converted):
    dst, _ = converted
    with pytest.raises(ValueError, match="converted"):
        LLM(str(dst), prefill_weights="fp8:block128", decode_weights="int4:g32", **KW)
    assert orbax_io.resolve_llm_formats(dst, None, None, None) == ("fp8_e4m3", "fp8:block128", "int4:g128")
    with pytest.raises(ValueError, match="decode weights int4:g128"):
        orbax_io.resolve_llm_formats(dst, None, None, "fp8")
    with pytest.raises(ValueError, match="kv_format"):
        orbax_io.resolve_llm_formats(dst, "bf16", None, None)


def test_bare_llm_takes_the_checkpoint_formats(converted):
    llm = LLM(str(converted[0]), **KW)
    assert llm.runner.weight_formats == FORMATS and llm.fmt.name == "fp8_e4m3"


def test_prequantized_source_and_reconversion(tmp_path):
    """An int4 (compressed-tensors) source keeps its experts as they are in both phases (stored
    once); re-converting a jaxserve checkpoint with its own formats is bit-exact."""
    from tests.test_prequantized import make_prequantized

    base = tmp_path / "base"
    build_deepseek_v3(base, num_hidden_layers=2, seed=9)
    qsrc, _ = make_prequantized(base, tmp_path / "ct", "int4")
    dst = tmp_path / "dst"
    sizes = convert(qsrc, dst, prefill_weights="bf16", decode_weights=None, progress=False)
    params = orbax_io.read_metadata(dst)["params"]
    assert params["layers/1/mlp/w_up"]["decode"] == "int4:g32"  # as loaded: the checkpoint's int4
    assert params["layers/1/mlp/w_up"]["prefill"] == "bf16"
    assert params["layers/1/attn/q_b"]["decode"] is None  # Kimi keeps attention unquantized
    assert "int4:g32" in sizes["by_format"]["decode"]
    again = tmp_path / "again"
    convert(dst, again, progress=False)  # formats come from the source checkpoint
    _, a = load_model(dst)
    _, b = load_model(again)
    for label in ("bf16", None):
        assert_bit_exact(quantize_state(nnx.split(a)[1], label), quantize_state(nnx.split(b)[1], label))
    w = dict((("/".join(map(str, p))), v.get_value()) for p, v in nnx.to_flat_state(nnx.split(b)[1]))
    assert isinstance(w["layers/1/mlp/w_up"], PhaseSet)
    third = tmp_path / "third"  # a format the source lacks: built from its largest member (bf16)
    convert(dst, third, decode_weights="int4:g128", progress=False)
    params = orbax_io.read_metadata(third)["params"]
    assert params["layers/1/mlp/w_up"]["decode"] == "int4:g128" and params["layers/1/mlp/w_up"]["prefill"] == "bf16"


def test_refusals(converted, src, tmp_path):
    with pytest.raises(ValueError, match="not empty"):
        convert(src, converted[0], decode_weights="int4", progress=False)
    with pytest.raises(ValueError, match="prefill_weights"):
        convert(src, tmp_path / "x", prefill_weights="int4:g32", progress=False)
    with pytest.raises(ValueError, match="unknown weight format"):
        convert(src, tmp_path / "y", decode_weights="int3", progress=False)
