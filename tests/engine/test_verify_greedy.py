"""The greedy acceptance rule of a verify call against a numpy reference: on the native greedy
kernel (where it loads, as the engine runs it) and on XLA's path (reached by asking for top
log-probs, which the kernel does not give)."""
from __future__ import annotations

import numpy as np
import pytest

from jaxserve.engine.speculative.verify import verify_rows


def _reference(logits, rows, drafts, num_drafts, allowed):
    """accepted [B], tokens [B, T] (the first argmax of each masked position), float64 raw logprobs."""
    x = logits[rows].astype(np.float64)
    masked = np.where(allowed, x, -np.inf)
    greedy = np.argmax(masked, axis=-1)
    lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    lp = np.take_along_axis(x, greedy[..., None], -1)[..., 0] - lse
    accepted = np.zeros(len(rows), np.int64)
    for b in range(len(rows)):
        while accepted[b] < num_drafts[b] and drafts[b, accepted[b]] == greedy[b, accepted[b]]:
            accepted[b] += 1
    return accepted, greedy, lp


def _pack(allowed):
    b, t, v = allowed.shape
    words = -(-v // 32)
    bits = np.zeros((b, t, words * 32), bool)
    bits[..., :v] = allowed
    w = (bits.reshape(b, t, words, 32) * (1 << np.arange(32, dtype=np.uint64))).sum(-1).astype(np.uint32)
    return w.view(np.int32)


@pytest.mark.parametrize("num_logprobs", [0, 1])  # 0: the native kernel where it loads; 1: XLA's path
@pytest.mark.parametrize("with_mask", [False, True])
def test_greedy_verify_matches_numpy(num_logprobs, with_mask):
    rng = np.random.default_rng(3)
    n, t, v = 7, 5, 1000
    logits = rng.standard_normal((n, t, v)).astype(np.float32)
    logits[2, 1, [17, 400]] = 9.0  # a tie: the first index wins
    rows = np.array([4, 2, 0, 6, 5], np.int32)
    b = len(rows)
    allowed = rng.random((b, t, v)) < 0.3 if with_mask else np.ones((b, t, v), bool)
    allowed[..., 17] |= with_mask  # keep the tie reachable
    ref_acc, ref_greedy, _ = _reference(logits, rows, np.zeros((b, t - 1), np.int32), np.zeros(b), allowed)
    # drafts: row 0 all right, row 1 right up to its tie then wrong, row 2 wrong at once, row 3 right
    # but only two drafts real, row 4 none real
    drafts = ref_greedy[:, :-1].copy()
    drafts[1, 2] = (drafts[1, 2] + 1) % v
    drafts[2, 0] = (drafts[2, 0] + 5) % v
    num_drafts = np.array([4, 4, 4, 2, 0], np.int32)
    acc, greedy, lp = _reference(logits, rows, drafts, num_drafts, allowed)
    assert list(acc) == [4, 2, 0, 2, 0]
    z, f = np.zeros(b, np.int32), np.zeros(b, np.float32)
    out = verify_rows(logits, rows, drafts, num_drafts, f, z, np.ones(b, np.float32), f, z, z,
                      masks=_pack(allowed) if with_mask else None, all_greedy=True, penalties=False,
                      num_logprobs=num_logprobs)
    accepted, tokens, logprob = (np.asarray(a) for a in out[:3])
    np.testing.assert_array_equal(accepted, acc)
    for j in range(b):
        used = slice(0, acc[j] + 1)
        np.testing.assert_array_equal(tokens[j, used], greedy[j, used])
        np.testing.assert_allclose(logprob[j, used], lp[j, used], rtol=1e-5, atol=1e-5)
    assert greedy[1, 1] == 17 and tokens[1, 1] == 17
