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
        for n in range(min(self.n_max, len(t) - 1), self.n_min - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(t[:-1], n)  # every n-gram with a successor
            hits = np.flatnonzero((windows == t[-n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n  # the latest earlier occurrence
                return t[start : start + limit].tolist()
        return []
