"""Per-request sampling and stopping parameters (validated on construction).

The sampler uses the float parameters as float32, so each is checked both as given and as the
float32 it becomes: 1e300 is a finite float64 but an infinite float32, and 1e-300 is a
positive float64 but a float32 zero.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

# Positive temperatures and repetition penalties divide (or multiply) float32 logits: within
# [1e-6, 1e6] the result stays finite for any logit below 1e32.
MIN_TEMPERATURE = 1e-6
PENALTY_RANGE = (1e-6, 1e6)
F32_MAX = float(np.finfo(np.float32).max)
INT32_MAX = 2**31 - 1  # the sampler keeps top_k (and seeds) as int32


def as_float32(x) -> float:
    """The float32 value the sampler will use (inf or 0 where float32 overflows/underflows)."""
    with np.errstate(over="ignore", under="ignore"):
        return float(np.float32(x))


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

        def check_float(name, lo, hi, want, open_lo=False, zero=False):
            """name's value, and its float32, in [lo, hi] ((lo, hi] if open_lo; or 0 if zero)."""
            x = getattr(self, name)

            def ok(v, lo, hi):
                return (zero and v == 0) or ((lo < v if open_lo else lo <= v) and v <= hi)

            if not is_num(x) or not ok(x, lo, hi):
                bad(name, want)
            x32 = as_float32(x)
            if not math.isfinite(x32) or not ok(x32, as_float32(lo), as_float32(hi)):
                raise ValueError(f"{name} must be {want} in float32 (the precision the sampler uses), "
                                 f"got {x!r}, which is {x32!r} as a float32")

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad("max_tokens", "an integer >= 1")
        check_float("temperature", MIN_TEMPERATURE, F32_MAX,
                    f"0 (greedy) or in [{MIN_TEMPERATURE:g}, {F32_MAX:.4g}] (finite in float32)", zero=True)
        check_float("top_p", 0.0, 1.0, "in (0, 1]", open_lo=True)
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not 0 <= self.top_k <= INT32_MAX:
            bad("top_k", f"an integer in [0, {INT32_MAX}] (0 = off)")
        check_float("min_p", 0.0, 1.0, "in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad("seed", "an integer or None")
        lo, hi = PENALTY_RANGE
        check_float("repetition_penalty", lo, hi, f"in [{lo:g}, {hi:g}] (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            check_float(name, -2.0, 2.0, "in [-2, 2]")
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
