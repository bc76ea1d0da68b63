"""Instrumented engine runs for the capacity and weight experiments: a batch of requests
stepped to completion with every step timed and attributed to the programs it ran
(decode-only, prefill-only or mixed), random prompts, and median / range summaries.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np


@dataclasses.dataclass
class RunMeasure:
    """One batch of requests driven through ``engine.step()`` to completion."""

    requests: int
    wall_s: float = 0.0
    steps: int = 0
    output_tokens: int = 0
    decode_only_steps: int = 0
    decode_only_s: float = 0.0
    decode_only_tokens: int = 0
    prefill_only_steps: int = 0
    prefill_only_s: float = 0.0
    prefill_only_tokens: int = 0
    mixed_steps: int = 0
    prefill_tokens: int = 0  # all prefill-program tokens (recompute after preemption included)
    max_running: int = 0  # most sequences in scheduler.running during any step
    mean_running_decode: float = 0.0  # mean decode batch over decode steps
    preemptions: int = 0
    compiles: int = 0  # serving-program compilations during the run (should be 0 when timed)
    decode_step_rates: list = dataclasses.field(default_factory=list)  # tokens/s of each decode-only step

    @property
    def decode_tok_s(self) -> float:
        return self.decode_only_tokens / self.decode_only_s if self.decode_only_s > 0 else float("nan")

    @property
    def decode_tok_s_median_step(self) -> float:
        """Median over decode-only steps of (tokens / step time): robust to a few steps slowed
        by other work on a shared machine."""
        return float(np.median(self.decode_step_rates)) if self.decode_step_rates else float("nan")

    @property
    def prefill_tok_s(self) -> float:
        return self.prefill_only_tokens / self.prefill_only_s if self.prefill_only_s > 0 else float("nan")

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(decode_tok_s=self.decode_tok_s, decode_tok_s_median_step=self.decode_tok_s_median_step,
                 prefill_tok_s=self.prefill_tok_s, output_tok_s=self.output_tok_s)
        return d


def run_requests(llm, prompts: list[list[int]], params) -> RunMeasure:
    """Submit every prompt at once and step the engine until all finish, timing each step and
    attributing it by the programs it ran (seen through a step observer): decode-only,
    prefill-only or mixed."""
    engine = llm.engine
    if engine.has_unfinished():
        raise RuntimeError("the engine has requests in flight")
    calls = []  # this step's StepRecords
    m = RunMeasure(requests=len(prompts))
    before = engine.snapshot()
    decode_rows = []
    remove = engine.add_step_observer(calls.append)
    try:
        rids = {engine.add_request(p, params) for p in prompts}
        t0 = time.perf_counter()
        while engine.has_unfinished():
            calls.clear()
            ts = time.perf_counter()
            outs = engine.step()
            _attribute(m, calls, time.perf_counter() - ts, decode_rows)
            m.output_tokens += sum(len(o.new_token_ids) for o in outs if o.request_id in rids)
        m.wall_s = time.perf_counter() - t0
    finally:
        remove()
    after = engine.snapshot()
    m.preemptions = after.preemptions - before.preemptions
    m.mean_running_decode = float(np.mean(decode_rows)) if decode_rows else 0.0
    m.compiles = after.compiles_after_warmup - before.compiles_after_warmup
    return m


def _attribute(m: RunMeasure, calls, dt: float, decode_rows: list) -> None:
    """Count one engine step by the programs it ran."""
    m.steps += 1
    phases = {c.phase for c in calls}
    dec = sum(c.rows for c in calls if c.phase == "decode")
    pre = sum(c.new_tokens for c in calls if c.phase == "prefill")
    m.prefill_tokens += pre
    if "decode" in phases:
        decode_rows.append(dec)
    if phases == {"decode"}:
        m.decode_only_steps += 1
        m.decode_only_s += dt
        m.decode_only_tokens += dec
        m.decode_step_rates.append(dec / dt)
    elif phases == {"prefill"}:
        m.prefill_only_steps += 1
        m.prefill_only_s += dt
        m.prefill_only_tokens += pre
    elif phases:
        m.mixed_steps += 1
    m.max_running = max([m.max_running] + [c.running for c in calls])


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """n prompts of `length` token ids drawn uniformly (away from the low special ids)."""
    rng = np.random.default_rng(seed)
    lo = min(16, vocab // 4)
    return [rng.integers(lo, vocab, length).tolist() for _ in range(n)]


def median_range(xs: list[float]) -> tuple[float, float, float]:
    a = np.asarray([x for x in xs if x is not None and np.isfinite(x)], np.float64)
    if not len(a):
        return float("nan"), float("nan"), float("nan")
    return float(np.median(a)), float(a.min()), float(a.max())
