"""The engine's side of warm-up: which buckets its configuration can use (``serving_buckets``:
decode rows up to ``max_num_seqs``, and no more rows than the pool has pages: each running
request holds one; prefill rows up to ``max_prefill_seqs`` (and ``max_num_seqs``) by the prefill
token buckets), the plan it hands the executor (``jaxserve.executor.warmup``: steps, updates,
samplers, a worker role's KV handoff programs; no decode bucket on a prefill worker), then
speculative decoding's acceptance. ``step_bucket`` is the engine's bucket choice while warming
(the server's engine loop runs ``LLMEngine.warmup`` on a thread of its own for
``serve --serve-while-warming``).
"""
from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from jaxserve.engine.sampler import SamplerPrograms
from jaxserve.executor.buckets import pow2_buckets, step_name
from jaxserve.executor.warmup import WarmupPlan, bucket_for, warm

log = logging.getLogger("jaxserve.engine")


def serving_buckets(config, token_buckets: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """-> (decode rows, [(prefill rows, tokens)]) the configuration can use."""
    usable = config.num_pages - 1
    decode = pow2_buckets(1, max(1, min(config.max_num_seqs, usable)))
    rows = pow2_buckets(1, max(1, min(config.max_prefill_seqs, config.max_num_seqs, usable)))
    return decode, [(b, t) for b in rows for t in token_buckets]


def warmup_plan(engine) -> WarmupPlan:
    """What ``engine`` (an LLMEngine) needs built: its buckets, and a worker role's KV handoff
    programs (export on a prefill worker, to its own format and the handoff format; import on a
    decode one)."""
    config, handoff = engine.config, engine.kv_handoff
    decode, prefill = serving_buckets(config, engine.prefill_token_buckets)
    exports = handoff.role.export_formats(handoff.kv_format, config.kv_handoff_format)
    return WarmupPlan(decode, prefill, engine.spec.verify_tokens if engine.spec is not None else 0,
                      tuple(exports), handoff.role.imports)


def warm_engine(engine, progress: Callable[[int, int], None] | None = None,
                on_serviceable: Callable[[], None] | None = None) -> None:
    """Build every serving program ``engine`` can use on its runner, then speculative
    decoding's acceptance for every verify bucket."""
    runner, plan = engine.runner, warmup_plan(engine)
    warm(runner, plan, SamplerPrograms(engine.cfg.vocab_size, engine.config.batch_invariant), progress,
         on_serviceable)
    if engine.spec is not None and "decode" in runner.phase_params:
        engine.spec.warm(lambda: _verify_logits(runner, plan.decode, plan.verify_tokens, engine.cfg.vocab_size))


def _verify_logits(runner, decode: list[int], t: int, vocab_size: int):
    """(rows, zero logits [rows, t, V] placed where the verify program leaves its logits) per
    decode bucket: what speculative decoding's acceptance is compiled for."""
    import jax

    for b in decode:
        built = runner.programs.get(step_name("verify", b, t)) if runner.programs is not None else None
        logits = np.zeros((b, t, vocab_size), np.float32)
        yield b, jax.device_put(logits, built.output_shardings[0]) if built is not None else logits


def step_bucket(engine, phase: str, b: int, t: int) -> tuple[int, int]:
    """(b, t), or while warm-up still builds programs, the smallest built bucket holding it."""
    if not engine.runner.warm or engine.runner.programs is None:
        return b, t
    decode, prefill = serving_buckets(engine.config, engine.prefill_token_buckets)
    spec = [(d, t) for d in decode]
    steps = {"decode": [(d, 1) for d in decode], "verify": spec, "draft": spec}.get(phase, prefill)
    return bucket_for(engine.runner.programs, phase, b, t, steps)
