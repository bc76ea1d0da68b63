"""A vocabulary that does not divide over the devices is padded, not refused.

A 320-token Llama on a mesh of 6 virtual devices: the embedding and the LM head are padded
to 324 rows (54 a device) at load; the padded ids' logits are cut off, so the greedy tokens
and the log-probs equal the 1-device run's (the reference: nothing padded there). Tied and
untied heads; the untied one also through an int8 decode copy of the padded head.
"""
import numpy as np
import pytest

from tests.hf_models import build_llama
from jaxserve import LLM
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.sharding import ShardingError, pad_vocab, padded_vocab_size

V, N = 320, 6
PROMPTS = [[int(x) for x in np.random.RandomState(7).randint(2, V, size=n)] for n in (11, 5)]
KW = dict(num_pages=16, page_size=8, max_num_seqs=2, max_model_len=48)
# 6 query heads and an MLP of 192 split evenly over 6 devices; 2 KV heads are replicated.
SHAPE = dict(vocab_size=V, hidden_size=96, intermediate_size=192, num_attention_heads=6,
             num_key_value_heads=2, head_dim=16, num_hidden_layers=2)


@pytest.fixture(scope="module", params=["tied", "untied"])
def runs(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"llama_v{V}_{request.param}")
    build_llama(path, seed=3, tie_word_embeddings=request.param == "tied", **SHAPE)
    extra = {"decode_weights": "int8"} if request.param == "untied" else {}
    one = LLM(str(path), num_devices=1, **KW, **extra)
    six = LLM(str(path), num_devices=N, **KW, **extra)
    return one, six


def test_padded_at_load(runs):
    one, six = runs
    assert one.cfg.vocab_rows == V and six.cfg.vocab_rows == 324
    assert six.cfg.vocab_size == V
    shapes = {tuple(x.shape) for x in six.runner.params}
    assert (324, 96) in shapes or (96, 324) in shapes  # the padded table / head, split 54 a device


def test_greedy_tokens_and_logprobs_match_one_device(runs):
    one, six = runs
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    ref = [o.token_ids for o in one.generate(PROMPTS, sp)]
    got = [o.token_ids for o in six.generate(PROMPTS, sp)]
    assert got == ref
    for p in PROMPTS:
        a, b = one.logprobs(p), six.logprobs(p)
        assert a.shape == b.shape == (len(p), V)
        np.testing.assert_allclose(b, a, atol=2e-5, rtol=0)


def test_padded_ids_never_sampled(runs):
    _, six = runs
    sp = SamplingParams(max_tokens=16, temperature=5.0, seed=11, ignore_eos=True)
    for out in six.generate(PROMPTS, sp):
        assert max(out.token_ids) < V


def test_pad_vocab_helpers():
    assert padded_vocab_size(320, None) == 320
    w = np.arange(6, dtype=np.float32).reshape(3, 2)
    got = pad_vocab(w, ("vocab", "embed"), (5, 2), "embed")
    np.testing.assert_array_equal(got, np.concatenate([w, np.zeros((2, 2), np.float32)]))
    with pytest.raises(ShardingError, match="cannot be padded"):
        pad_vocab(w, ("vocab", "embed"), (5, 3), "embed")  # only the vocab dim may grow
    with pytest.raises(ShardingError, match="cannot be padded"):
        pad_vocab(w, ("embed", "mlp"), (5, 2), "w")


def test_converted_checkpoint_padded_on_load(runs, tmp_path):
    """A jaxserve-converted checkpoint stores the unpadded vocabulary; restored on 6 devices
    it is padded the same way (the untied head is stored as int8 for decode: a quantized
    vocabulary weight cannot be padded, which is a clear error)."""
    from jaxserve.checkpoint.convert import convert
    from jaxserve.checkpoint.prequantized import CheckpointError

    one, _ = runs
    dst = tmp_path / "conv"
    convert(one.model_path, dst, decode_weights="int8", progress=False)
    if one.cfg.tie_word_embeddings:  # the tied table stays a plain array: padded on restore
        six = LLM(str(dst), num_devices=N, **KW)
        assert six.cfg.vocab_rows == 324
        np.testing.assert_allclose(six.logprobs(PROMPTS[0]), one.logprobs(PROMPTS[0]), atol=2e-5, rtol=0)
    else:
        with pytest.raises(CheckpointError, match="cannot be padded"):
            LLM(str(dst), num_devices=N, **KW)
