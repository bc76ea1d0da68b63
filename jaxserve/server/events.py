"""The events the engine thread hands each request's stream (engine loop -> the fronts), one
dataclass per kind; every stream ends with exactly one terminal event (``Ended`` or ``Failed``)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Started:
    """Once, when the scheduler admits the request."""

    prompt_tokens: int
    cached_tokens: int


@dataclasses.dataclass(frozen=True)
class Delta:
    """New tokens (and/or text)."""

    token_ids: list[int]
    text: str
    logprobs: list | None  # one (logprob, {id: logprob}) per token, or None


@dataclasses.dataclass(frozen=True)
class Ended:
    finish_reason: str
    usage: object  # jaxserve.engine.outputs.Usage
    ttft_s: float | None
    total_s: float
    error: Exception | None = None  # IntegrityError | KvHandoffError | RequestFailed | None
    kv_export: object = None  # the prompt's KvPayload for a request submitted with export_kv


@dataclasses.dataclass(frozen=True)
class Failed:
    """Rejected by add_request, or step() failed, or the server is shutting down."""

    error: Exception


TERMINAL = (Ended, Failed)
