"""gRPC's later additions: multi-turn messages (the parametrized cases of test_generate run
the "multi_turn" conversation too), per-token log-probs with top-k alternatives (SamplingParams
field 9) checked against an independent prefill over the whole sequence, and n choices."""
import grpc
import numpy as np
import pytest

from jaxserve.client import build_request, finish_reason
from jaxserve.v1 import jaxserve_pb2 as pb

from .conftest import CONVERSATION, mock_cases


def check_logprobs(entries, want, reference, k: int):
    """TokenLogprob messages vs the engine's completion and the prefill reference [T, V]."""
    assert [e.token_id for e in entries] == list(want)
    for t, e in enumerate(entries):
        assert e.logprob == pytest.approx(want.logprobs[t][0], abs=1e-6)
        assert e.logprob == pytest.approx(reference[t, e.token_id], abs=2e-4)
        top_ref = np.argsort(-reference[t], kind="stable")[:k]
        assert [a.token_id for a in e.top] == list(top_ref)
        np.testing.assert_allclose([a.logprob for a in e.top], reference[t, top_ref], atol=2e-4)


def test_logprobs_unary_and_stream_match_the_reference(served, cases, logprobs_reference):
    prompt, kw, want = cases["logprobs"]
    r = served.client.generate(prompt, **kw)
    assert list(r.token_ids) == list(want)
    check_logprobs(r.logprobs, want, logprobs_reference, kw["logprobs"])
    streamed = [lp for ev in served.client.generate_stream(prompt, **kw) if ev.HasField("delta")
                for lp in ev.delta.logprobs]
    check_logprobs(streamed, want, logprobs_reference, kw["logprobs"])
    plain = served.client.generate(prompt, **{k: v for k, v in kw.items() if k != "logprobs"})
    assert list(plain.token_ids) == list(want) and not plain.logprobs  # unset: none sent


def test_n_choices_are_seeded_deterministic_and_streamed_by_index(mock_served):
    cases = mock_cases()
    prompt, kw, want = cases["sampled"]  # temperature 0.8, seed 9: the mock steps by 1 + seed % 7
    r = mock_served.client.generate(prompt, n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert list(r.choices[0].token_ids) == list(r.token_ids) == list(want)  # choice 0 keeps the seed
    others = [list(c.token_ids) for c in r.choices[1:]]
    assert all(o != list(want) for o in others) and others[0] != others[1]  # derived seeds differ
    assert r.usage.completion_tokens == sum(c.completion_tokens for c in r.choices) == 3 * len(want)
    again = mock_served.client.generate(prompt, n=3, **kw)
    assert [list(c.token_ids) for c in again.choices] == [list(c.token_ids) for c in r.choices]
    by_index, ends = {0: [], 1: [], 2: []}, {}
    for ev in mock_served.client.generate_stream(prompt, n=3, **kw):
        if ev.HasField("delta"):
            by_index[ev.delta.index] += ev.delta.token_ids
        elif ev.HasField("end"):
            ends[ev.end.index] = finish_reason(ev.end)
    assert [by_index[i] for i in range(3)] == [list(c.token_ids) for c in r.choices]
    assert ends == {i: "length" for i in range(3)}
    assert mock_served.eventually_idle()


@pytest.mark.parametrize("bad, message", [
    (dict(n=9), "n must be in [1, 8]"),
    (dict(logprobs=21), "logprobs"),
])
def test_bad_n_and_logprobs_are_invalid(mock_served, bad, message):
    with pytest.raises(grpc.RpcError) as e:
        mock_served.client.generate([5, 6], max_tokens=2, **bad)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details()


def test_messages_with_a_prompt_or_without_roles_are_invalid(mock_served):
    both = build_request(CONVERSATION)
    both.text = "and a text"
    no_role = pb.GenerateRequest(messages=[pb.ChatMessage(role="", content="hi")])
    for req, message in ((both, "not both"), (no_role, "role")):
        with pytest.raises(grpc.RpcError) as e:
            mock_served.client.stub.Generate(req, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details()


def test_the_single_turn_request_of_earlier_clients_still_works(mock_served):
    """A GenerateRequest as encoded before messages / n / logprobs existed (only fields 1-7)."""
    cases = mock_cases()
    prompt, kw, want = cases["chat_template"]
    old = pb.GenerateRequest(text=prompt, apply_chat_template=True)
    old.stop.max_tokens = kw["max_tokens"]
    r = mock_served.client.stub.Generate(pb.GenerateRequest.FromString(old.SerializeToString()), timeout=60)
    assert list(r.token_ids) == list(want) and not r.choices and not r.logprobs
