"""Per-phase weight formats: one model, a prefill representation and a decode representation,
each program reading its own."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve import LLM
from jaxserve.engine.llm_engine import EngineConfig
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.quant.phase import quantize_state, state_nbytes
from tests.quant_reference import dense_leaves

PROMPT = [5, 17, 99, 3, 250, 42, 7, 8, 9, 10, 11, 12, 13, 60, 61, 62, 63]
KW = dict(kv_format="float32", num_pages=32, page_size=8, max_num_seqs=4)


def leaf_dtypes(runner, phase):
    return {jnp.dtype(x.dtype).name for x in runner.phase_params[phase][0]}


def decode_logits(runner, phase_leaves=None):
    """Prefill PROMPT[:-1] with the prefill program, then one decode step; decode logits."""
    table = np.zeros((1, runner.max_pages_per_seq), np.int32)
    table[0, :3] = [1, 2, 3]
    runner.run(np.array([PROMPT[:-1]], np.int32), [0], [len(PROMPT) - 1], table[:, :4])
    if phase_leaves is not None:
        runner.phase_params["decode"] = phase_leaves
    fn = runner.step_programs.checked("decode")
    from jaxserve.step_batch import StepBatch

    batch = StepBatch(jnp.array([[PROMPT[-1]]], jnp.int32), jnp.array([len(PROMPT) - 1]), jnp.array([1]),
                      jnp.asarray(table), jnp.zeros_like(table), jnp.zeros((1,), jnp.int32), phase="decode")
    logits, runner.kv, ok, _ = fn(runner.phase_params["decode"][0], runner.kv, runner.generation, batch)
    return np.asarray(logits[0])


def test_each_phase_holds_its_own_representation(tiny_ckpt):
    llm = LLM(tiny_ckpt, prefill_weights="fp8:block128", decode_weights="int4:g32", **KW)
    assert "float8_e4m3fn" in leaf_dtypes(llm.runner, "prefill") and "uint8" not in leaf_dtypes(llm.runner, "prefill")
    assert "uint8" in leaf_dtypes(llm.runner, "decode") and "float8_e4m3fn" not in leaf_dtypes(llm.runner, "decode")
    sizes = {p: sum(x.nbytes for x in llm.runner.phase_params[p][0]) for p in ("prefill", "decode")}
    assert sizes["decode"] < sizes["prefill"]
    out = llm.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert len(out) == 6


def test_decode_program_computes_with_its_format(tiny_ckpt):
    """int4 decode logits are close to the logits of the same model with the int4 weights
    dequantized (the path's bf16 rounding: tests/models/test_quantized_programs.py bounds it
    per family), and differ from the unquantized model's far more (the format is really used)."""
    q = LLM(tiny_ckpt, decode_weights="int4:g32", **KW)
    plain = LLM(tiny_ckpt, **KW)
    got = decode_logits(q.runner)
    ref_plain = decode_logits(plain.runner)
    # The dequantized weights as plain arrays, run through the unquantized decode program.
    ref = decode_logits(LLM(tiny_ckpt, **KW).runner, dense_leaves(*q.runner.phase_params["decode"]))
    assert np.abs(got - ref).max() < 0.1
    assert np.abs(got - ref_plain).max() > 10 * np.abs(got - ref).max()
    # Prefill stayed unquantized: the prompt's logprobs match the plain model exactly.
    assert np.abs(q.logprobs(PROMPT) - plain.logprobs(PROMPT)).max() < 1e-5


def test_phase_formats_are_validated():
    with pytest.raises(ValueError, match="prefill_weights"):
        EngineConfig(prefill_weights="int4:g32")
    with pytest.raises(ValueError, match="unknown weight format"):
        EngineConfig(decode_weights="int3")
    EngineConfig(prefill_weights="fp8", decode_weights="int4:g128")


def test_article_preset(tiny_ckpt):
    llm = LLM(tiny_ckpt, preset="article", num_pages=32, page_size=8)
    assert llm.fmt.name == "fp8_e4m3"
    assert llm.runner.weight_formats == {"prefill": "fp8:block128", "decode": "int4:g32"}
    cpu = LLM(tiny_ckpt, preset="cpu", num_pages=32, page_size=8)
    assert cpu.runner.weight_formats == {"prefill": "bf16", "decode": "int8"}
    assert "w8a8" in cpu.runner.weight_paths()["decode"]  # cpu:w8a8, or its native kernel where that runs
    with pytest.raises(ValueError, match="unknown preset"):
        LLM(tiny_ckpt, preset="nope")


def test_preset_fills_what_is_not_given(tiny_ckpt):
    """Explicit arguments win over the preset; None (a CLI flag left unset) keeps the preset's value."""
    llm = LLM(tiny_ckpt, preset="article", kv_format="bf16", prefill_weights=None, decode_weights="int8",
              num_pages=8, page_size=8)
    assert llm.fmt.name == "bf16"
    assert llm.runner.weight_formats == {"prefill": "fp8:block128", "decode": "int8"}
    # The command lines leave --kv-format unset by default, so --preset article gets its fp8 KV.
    from jaxserve.cli import build_parser

    for cmd in (["generate", "x"], ["serve"], ["bench"]):
        args = build_parser().parse_args(cmd + ["--preset", "article"])
        assert args.kv_format is None and args.prefill_weights is None, cmd
    unset = LLM(tiny_ckpt, preset="article", kv_format=None, prefill_weights=None, num_pages=8, page_size=8)
    assert unset.fmt.name == "fp8_e4m3" and unset.runner.weight_formats["prefill"] == "fp8:block128"


def test_quantized_state_is_smaller():
    from jaxserve.loader import load_model

    _, model = load_model("checkpoints/tiny-kimi-k2")
    _, state = nnx.split(model)
    assert state_nbytes(quantize_state(state, "int4:g32")) < state_nbytes(state) / 3


def test_one_copy_when_one_suffices(tiny_ckpt):
    """One format for both phases, or prefill reading the decode copy: one resident copy."""
    same = LLM(tiny_ckpt, prefill_weights="int8", decode_weights="int8", **KW)
    b = same.runner.weight_bytes()
    assert b["resident"] == b["prefill"] == b["decode"]
    assert all(x is y for x, y in zip(same.runner.phase_params["prefill"][0], same.runner.phase_params["decode"][0]))
    two = LLM(tiny_ckpt, prefill_weights="fp8:block128", decode_weights="int4:g32", **KW)
    b2 = two.runner.weight_bytes()
    assert b2["prefill"] + b2["decode"] > b2["resident"] > max(b2["prefill"], b2["decode"])  # norms shared
    one = LLM(tiny_ckpt, decode_weights="int4:g32", prefill_from_decode_weights=True, **KW)
    b1 = one.runner.weight_bytes()
    assert b1["resident"] == b1["decode"] < b2["resident"]
    assert one.runner.weight_paths()["prefill"].startswith("int4:g32 -> ")
    # The prefill program computes in int4: its logprobs are not the unquantized model's.
    plain = LLM(tiny_ckpt, **KW)
    assert np.abs(one.logprobs(PROMPT) - plain.logprobs(PROMPT)).max() > 1e-3
    assert len(one.generate([PROMPT], SamplingParams(max_tokens=4, ignore_eos=True))[0]) == 4
    with pytest.raises(ValueError, match="prefill_from_decode_weights"):
        EngineConfig(prefill_weights="bf16", decode_weights="int4:g32", prefill_from_decode_weights=True)
