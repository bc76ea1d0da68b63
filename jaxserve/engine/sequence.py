"""A request as the engine tracks it, from arrival to finish."""
from __future__ import annotations

import dataclasses
import enum
import time

from jaxserve.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # no pages (new, or preempted and to be recomputed)
    RUNNING = "running"  # has pages; prefilling until num_computed reaches the prompt, then decoding
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # the sampling seed actually used (params.seed or one drawn by the engine)
    client: str = ""  # who sent it (a hashed API key or a connection): the unit of fair share
    arrival_time: float = dataclasses.field(default_factory=time.perf_counter)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # leading tokens whose KV is in this sequence's pages
    pages: list[int] = dataclasses.field(default_factory=list)  # page table (copy held by the request)
    expected: list[int] = dataclasses.field(default_factory=list)  # generation expected per page
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    admitted: bool = False
    num_preemptions: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: Exception | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    logprobs: list = dataclasses.field(default_factory=list)  # per output token: (logprob, {id: logprob})
    text: str = ""  # detokenized output (stop strings cut off)
    emitted_text: int = 0  # characters of `text` already streamed
    stopped_by_string: bool = False  # a stop string cut `text` (nothing more to flush)
    started: bool = False  # the output that reports its admission has been emitted
    detok: object = None  # IncrementalDetokenizer when the model has a tokenizer
    export_kv: str | None = None  # KV handoff, sending side: the format to export the prompt's pages in
    kv_export: object = None  # ... the exported KvPayload, once the first token is sampled
    kv_import: object = None  # KV handoff, receiving side: a jaxserve.disagg.handoff_request.KvImport
    grammar: object = None  # jaxserve.structured.constraints.GrammarState of a constrained request
    draft_ids: list[int] = dataclasses.field(default_factory=list)  # speculative tokens to verify this step
    spec: object = None  # jaxserve.engine.speculative.decoder.SpecStats when speculation is on

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        """Still computing the KV of its known tokens (prompt, or prompt + output after preemption)."""
        return self.num_computed < self.total_len - (1 if self.output_ids else 0)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


def check_prompt(prompt_ids, max_tokens: int, vocab_size: int, max_model_len: int, pool_tokens: int) -> list[int]:
    """The prompt as a list of ints, or ValueError naming what is wrong: empty, a token id
    outside the vocabulary, or prompt + max_tokens past the context or the whole KV pool."""
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise ValueError("empty prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    total = len(ids) + max_tokens
    if total > max_model_len:
        raise ValueError(
            f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) = {total} exceeds the "
            f"maximum context of {max_model_len} tokens"
        )
    if total > pool_tokens:
        raise ValueError(f"prompt + max_tokens = {total} tokens exceeds the whole KV pool ({pool_tokens})")
    return ids
