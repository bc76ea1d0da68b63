"""The embedded default model (real SmolLM2-135M-Instruct weights) through jaxserve:
greedy output against transformers on the same dequantized weights, text in and out, the CLI."""
import pytest
import torch

from jaxserve import LLM
from jaxserve.checkpoint.gguf import default_model_dir

QUESTIONS = ["Write a short story about a robot who paints.", "Explain why the sky is blue."]


@pytest.fixture(scope="module")
def model_dir():
    return default_model_dir(progress=False)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", kv_format="float32", num_pages=64, page_size=16)


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def test_greedy_equals_transformers_for_32_tokens(llm, reference):
    prompts = [llm.tokenizer.encode(llm.apply_chat_template(q)) for q in QUESTIONS]
    ours = llm.generate(prompts, max_tokens=32, ignore_eos=True)
    for p, got in zip(prompts, ours):
        with torch.no_grad():
            want = reference.generate(torch.tensor([p]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        want = want[0, len(p):].tolist()
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
        print(f"greedy match vs transformers: {same}/32 tokens: {got.text!r}")
        assert list(got) == want


def test_text_in_text_out(llm):
    q = llm.apply_chat_template("What is the capital of France?")
    out = llm.generate(q, max_tokens=24)[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop" and out[-1] in llm.eos_token_ids
    assert out.text == llm.tokenizer.decode(list(out))
    assert out.prompt_token_ids == llm.tokenizer.encode(q)
    again = llm.generate([out.prompt_token_ids], max_tokens=24)[0]  # ids in: the same completion
    assert list(again) == list(out) and again.text == out.text


def test_bad_requests_are_clear_errors(llm):
    with pytest.raises(ValueError, match="temperature"):
        llm.generate(["hi"], temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        llm.generate(["hi"], temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[49152]])
    with pytest.raises(ValueError, match="list of prompts"):
        llm.generate([1, 2, 3])
    with pytest.raises(ValueError, match="exceeds the maximum context"):
        llm.generate([[1] * 10], max_tokens=llm.cfg.max_position_embeddings)


def test_sampling_is_seeded(llm):
    q = llm.apply_chat_template("Name a colour.")
    a = llm.generate([q], max_tokens=8, temperature=1.0, top_p=0.9, top_k=50, seed=7)[0]
    b = llm.generate([q], max_tokens=8, temperature=1.0, top_p=0.9, top_k=50, seed=7)[0]
    assert list(a) == list(b)


def test_cli_answers_with_text(capsys, model_dir, llm):
    import re

    from jaxserve.cli import main

    question = "What is the capital of France?"
    assert main(["generate", question, "--max-tokens", "16", "--kv-format", "float32"]) == 0
    out = capsys.readouterr()
    assert "Paris" in out.out
    assert "decode" in out.err and "tok/s" in out.err
    # The timed run prefills the whole prompt, as the untimed one did (the prefix cache is
    # reset between them: a hit would time other work, in a chunk bucket not yet compiled).
    prompt_len = len(llm.tokenizer.encode(llm.apply_chat_template(question)))
    assert re.search(r"prefill (\d+) tok", out.err).group(1) == str(prompt_len)


def test_cli_bad_input_exits_2(capsys):
    from jaxserve.cli import main

    assert main(["generate", "--model", "checkpoints/tiny-kimi-k2", "hello"]) == 2
    assert "no tokenizer" in capsys.readouterr().err


def test_cli_weight_formats_and_matmul_path(capsys):
    from jaxserve.cli import main

    args = ["generate", "--model", "checkpoints/tiny-kimi-k2", "--prompt-ids", "5,6,7,8", "--max-tokens", "3",
            "--no-warmup", "--prefill-weights", "bf16", "--decode-weights", "int8", "--matmul-backend", "cpu"]
    assert main(args) == 0
    err = capsys.readouterr().err
    from jaxserve.quant.linear import path_for  # cpu:bf16-dot, or its native kernel where that runs

    assert f"[prefill matmuls] bf16 -> {path_for('bf16', 'cpu').name}" in err
    assert f"[decode matmuls] int8 -> {path_for('int8', 'cpu').name}" in err
    args = ["generate", "--model", "checkpoints/tiny-kimi-k2", "--prompt-ids", "5,6", "--max-tokens", "2", "--no-warmup",
            "--decode-weights", "int4:g32", "--prefill-from-decode-weights", "--kv-cache-memory", "1MiB"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert f"[prefill matmuls] int4:g32 -> {path_for('int4:g32', 'cpu').name}" in err and "[memory]" in err
    assert main(["generate", "--model", "checkpoints/tiny-kimi-k2", "--prompt-ids", "5", "--decode-weights", "int3"]) == 2
    assert "unknown weight format" in capsys.readouterr().err
