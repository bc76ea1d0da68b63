"""The n-gram (prompt-lookup) proposer: match the sequence's last n tokens against its earlier
tokens (prompt and output so far) and propose the tokens that followed the latest match.

Deterministic: the proposal is a function of the token history alone, so the draft
distribution is a point mass (what the acceptance rule in ``verify`` assumes)."""
from __future__ import annotations

import numpy as np


class NgramProposer:
    on_device = False  # drafts from propose() itself, on the host

    def __init__(self, k: int, n_max: int = 3, n_min: int = 1):
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
        if not 1 <= n_min <= n_max:
            raise ValueError(f"the n-gram sizes need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.k, self.n_max, self.n_min = k, n_max, n_min

    def propose(self, tokens, limit: int) -> list[int]:
        """Up to min(k, limit) draft tokens following the longest (n_max down to n_min) suffix
        n-gram of ``tokens`` that occurred earlier; [] when none did."""
        limit = min(self.k, limit)
        if limit <= 0 or len(tokens) < self.n_min + 1:
            return []
        t = np.asarray(tokens, np.int64)
        # ends[j]: the positions e <= len - 2 whose earlier tokens match the last j + 1 tokens
        # (t[e - i] == t[-1 - i] for i <= j), found by one pass over the history for the last
        # token and then narrowing those few candidates
        ends = [np.flatnonzero(t[:-1] == t[-1])]
        for j in range(1, self.n_max):
            e = ends[-1]
            e = e[e >= j]
            e = e[t[e - j] == t[-1 - j]]
            if not len(e):
                break
            ends.append(e)
        for n in range(len(ends), self.n_min - 1, -1):
            if len(ends[n - 1]):
                start = int(ends[n - 1][-1]) + 1  # after the latest earlier occurrence
                return t[start : start + limit].tolist()
        return []
