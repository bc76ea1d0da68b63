"""What the engine hands back: streaming deltas and finished completions; and what it tells
observers: a snapshot between steps, a record per program call."""
from __future__ import annotations

import dataclasses


class RequestFailed(RuntimeError):
    """One request's own processing raised (``stage``: "sample", "detokenize / stop check"):
    that request is aborted with this error (its pages freed); the step and the other
    requests go on."""

    def __init__(self, request_id: str, stage: str, cause: BaseException):
        super().__init__(f"request {request_id!r} failed in {stage}: {type(cause).__name__}: {cause}")
        self.request_id, self.stage, self.cause = request_id, stage, cause

    def __reduce__(self):  # across a process boundary the cause travels as its type's name and text
        cause = RuntimeError(f"{type(self.cause).__name__}: {self.cause}")
        return (_request_failed, (self.request_id, self.stage, cause, str(self)))


def _request_failed(request_id: str, stage: str, cause: BaseException, message: str) -> RequestFailed:
    error = RequestFailed(request_id, stage, cause)
    error.args = (message,)  # the message as raised, the cause's own type name included
    return error


@dataclasses.dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    # Speculative decoding: draft tokens verified for this request, and how many were accepted
    # (each accepted one is a completion token that cost no step of its own).
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0


@dataclasses.dataclass(frozen=True)
class Timing:
    time_to_first_token: float | None  # seconds from arrival; None if no token was produced
    total: float  # seconds from arrival to finish


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """One step's news for one request (a streaming delta); `finished` on the last one."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    error: Exception | None = None
    completion: "Completion | None" = None  # set when finished
    # The first output of a request (emitted when the scheduler admits it, tokens or not) has
    # started=True; prompt and prefix-cache figures are known from then on.
    started: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # With SamplingParams.logprobs set: one (logprob, {token_id: logprob} top-n) per new token.
    new_logprobs: list | None = None
    # A request added with export_kv: its prompt's pages (a jaxserve.kv.handoff.KvPayload) on
    # its last output, when it finished with its first token.
    kv_export: object = None


class Completion(list):
    """The generated token ids of one request (it *is* that list, so code written against
    the first API, which returned plain id lists, keeps working), plus text, finish reason,
    usage, timing and optional logprobs."""

    def __init__(self, token_ids, text, finish_reason, prompt_token_ids, usage=None, timing=None,
                 logprobs=None, request_id=None, error=None):
        super().__init__(token_ids)
        self.text: str | None = text  # None when the model has no tokenizer
        self.finish_reason: str = finish_reason  # "stop" | "length" | "abort" | "error"
        self.prompt_token_ids: list[int] = prompt_token_ids
        self.usage: Usage | None = usage
        self.timing: Timing | None = timing
        self.logprobs = logprobs  # per token: (logprob, {token_id: logprob} top-n), or None
        self.request_id = request_id
        self.error: Exception | None = error  # e.g. IntegrityError when finish_reason == "abort"

    @property
    def token_ids(self) -> list[int]:
        return list(self)

    def __repr__(self):
        return f"Completion({list(self)!r}, text={self.text!r}, finish_reason={self.finish_reason!r})"


@dataclasses.dataclass(frozen=True)
class EngineSnapshot:
    """The engine between steps: queue, KV pages, integrity checks and compilations."""

    waiting: int  # queued, not yet admitted
    running: int  # admitted (holding pages)
    kv_pages_total: int  # usable pages (the null page excluded)
    kv_pages_used: int
    kv_pages_free: int  # free or evictable (prefix cache)
    integrity_checks: int
    integrity_rows: int
    integrity_mismatches: dict  # cause -> rows
    compiles_after_warmup: int
    preemptions: int  # since start
    programs_compiled: int = 0  # serving programs XLA compiled for this engine (warm-up, or first use before it)
    programs_loaded: int = 0  # serving programs loaded from the program cache instead
    # Structured outputs: ConstraintStats' counters (requests, rejected, mask_rows, mask_seconds,
    # mask_steps, invalid_outputs, grammar_stops) and every grammar compilation's seconds.
    constraints: dict = dataclasses.field(default_factory=dict)
    spec_draft_tokens: int = 0  # speculative decoding, since start: draft tokens verified
    spec_accepted_tokens: int = 0  # ... accepted
    spec_verify_steps: int = 0  # (request, verify call) pairs with drafts: mean accepted length = 1 + accepted / this


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One program call, as a step observer sees it."""

    phase: str  # "prefill" | "decode" | "verify" | "draft"
    rows: int  # real rows (requests) in the call
    new_tokens: int  # real new tokens
    batch: int  # padded rows (the compiled bucket)
    tokens: int  # padded tokens per row
    running: int  # requests holding pages at the time
    seconds: float  # wall time of the call, results on the host
