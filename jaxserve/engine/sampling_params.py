"""Per-request sampling and stopping parameters (validated on construction)."""
from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None  # same seed -> same tokens, whatever else is in the batch
    repetition_penalty: float = 1.0  # 1 = off; divides positive / multiplies negative logits of seen tokens
    presence_penalty: float = 0.0  # subtracted once from logits of generated tokens
    frequency_penalty: float = 0.0  # subtracted per occurrence in generated tokens
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings (not included in the returned text)
    ignore_eos: bool = False
    logprobs: int | None = None  # return the sampled token's logprob and the top-n alternatives

    MAX_LOGPROBS = 20

    def __post_init__(self):
        def bad(name, want):
            raise ValueError(f"{name} must be {want}, got {getattr(self, name)!r}")

        def is_num(x):
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad("max_tokens", "an integer >= 1")
        if not is_num(self.temperature) or self.temperature < 0:
            bad("temperature", "a finite number >= 0")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            bad("top_k", "an integer >= 0 (0 = off)")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad("seed", "an integer or None")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", "a finite number > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not is_num(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                bad(name, "in [-2, 2]")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "a list of non-empty strings")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= self.MAX_LOGPROBS
        ):
            bad("logprobs", f"None or an integer in [0, {self.MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
