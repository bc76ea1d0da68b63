"""The sampler's packed token mask: all ones changes nothing (bitwise), and otherwise no
disallowed token is ever drawn, greedy or sampled, with or without truncation."""
import numpy as np
import pytest

from jaxserve.engine.sampler import mask_words, sample_rows

V, B = 1000, 8
SETTINGS = [  # temperature, top_k, top_p, min_p
    (0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (1.3, 0, 0.9, 0.0), (0.8, 20, 0.8, 0.01),
]


def packed(allowed: np.ndarray) -> np.ndarray:
    """bool [B, V] -> int32 [B, ceil(V/32)] (bit t % 32 of word t // 32), built bit by bit."""
    out = np.zeros((allowed.shape[0], mask_words(allowed.shape[1])), np.uint32)
    for b, t in zip(*np.nonzero(allowed)):
        out[b, t // 32] |= np.uint32(1) << np.uint32(t % 32)
    return out.view(np.int32)


def run(logits, setting, mask, greedy=False, steps=0):
    temp, top_k, top_p, min_p = setting
    f = lambda v, dt: np.full(B, v, dt)  # noqa: E731
    out = sample_rows(logits, np.arange(B, dtype=np.int32), f(temp, np.float32), f(top_k, np.int32),
                      f(top_p, np.float32), f(min_p, np.float32), np.arange(B, dtype=np.int32) + 3,
                      f(steps, np.int32), mask, all_greedy=greedy, penalties=False, num_logprobs=2)
    return [np.asarray(x) for x in out]


@pytest.fixture(scope="module")
def logits():
    return (np.random.default_rng(0).standard_normal((B, V)) * 3).astype(np.float32)


@pytest.mark.parametrize("setting", SETTINGS)
def test_all_ones_mask_is_bitwise_no_mask(logits, setting):
    ones = np.full((B, mask_words(V)), -1, np.int32)
    for greedy in ((True, False) if setting[0] == 0 else (False,)):
        for a, b in zip(run(logits, setting, None, greedy), run(logits, setting, ones, greedy)):
            assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("setting", SETTINGS)
def test_disallowed_tokens_are_never_drawn(logits, setting):
    rng = np.random.default_rng(1)
    allowed = rng.random((B, V)) < 0.03
    allowed[:, V - 1] = True  # the last, partly filled word
    mask = packed(allowed)
    for step in range(6):
        tok = run(logits, setting, mask, steps=step)[0]
        assert allowed[np.arange(B), tok].all()
    if setting[0] == 0:  # greedy: the best allowed token
        want = np.where(allowed, logits, -np.inf).argmax(-1)
        assert (run(logits, setting, mask, greedy=True)[0] == want).all()


def test_a_single_allowed_token_is_forced(logits):
    allowed = np.zeros((B, V), bool)
    allowed[np.arange(B), np.arange(B) * 97] = True
    tok = run(logits, (1.0, 0, 0.9, 0.0), packed(allowed))[0]
    assert (tok == np.arange(B) * 97).all()
