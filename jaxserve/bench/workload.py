"""Fixed-seed synthetic workloads: random prompt token ids and output lengths, arrival times.

Host-side only (numpy). The same seed gives the same requests on every machine.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    prompt_ids: list[int]
    max_tokens: int  # output length (exact when EOS is ignored)
    arrival: float  # seconds after the start of the run


def token_id_range(vocab_size: int) -> tuple[int, int]:
    """[lo, vocab_size): skips the lowest ids, where checkpoints keep their special tokens."""
    return min(max(2, vocab_size // 64), vocab_size - 1), vocab_size


def make_workload(
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
    request_rate: float = float("inf"),
) -> list[BenchRequest]:
    """num_requests requests; prompt and output lengths uniform in the inclusive ranges;
    arrivals all at 0 (request_rate=inf) or a Poisson process of request_rate per second
    (the first request at 0)."""
    for name, (lo, hi) in (("prompt_len", prompt_len), ("output_len", output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} range must satisfy 1 <= min <= max, got {lo}..{hi}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (inf = all at once), got {request_rate}")
    rng = np.random.default_rng(seed)
    lo_id, hi_id = token_id_range(vocab_size)
    p_lens = rng.integers(prompt_len[0], prompt_len[1] + 1, num_requests)
    o_lens = rng.integers(output_len[0], output_len[1] + 1, num_requests)
    if np.isinf(request_rate):
        arrivals = np.zeros(num_requests)
    else:
        gaps = rng.exponential(1.0 / request_rate, num_requests)
        arrivals = np.concatenate([[0.0], np.cumsum(gaps[1:])])
    return [
        BenchRequest([int(x) for x in rng.integers(lo_id, hi_id, int(p))], int(o), float(a))
        for p, o, a in zip(p_lens, o_lens, arrivals)
    ]


def warmup_workload(workload: list[BenchRequest], num_requests: int, vocab_size: int, seed: int) -> list[BenchRequest]:
    """A short pass that visits every decode batch size from num_requests down to 1 (request i
    asks for i + 1 tokens, at most the workload's longest output), with prompts spanning the
    workload's lengths, all arriving at once; its token ids come from another seed so it
    leaves nothing in the prefix cache for the run."""
    rng = np.random.default_rng(seed + 1_000_003)
    lo_id, hi_id = token_id_range(vocab_size)
    lens = sorted(len(r.prompt_ids) for r in workload)
    cap = max(r.max_tokens for r in workload)
    picks = np.linspace(0, len(lens) - 1, num_requests).round().astype(int)
    return [
        BenchRequest([int(x) for x in rng.integers(lo_id, hi_id, lens[j])], min(i + 1, cap), 0.0)
        for i, j in enumerate(picks)
    ]
