"""What a handed-off request carries into the receiving engine (``KvImport``) and the error
that ends it when its pages fail their digest check (``KvHandoffError``)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class KvImport:
    """A request whose prompt KV another engine computed (a KV handoff): its pages, their
    digest, the first token that engine sampled and the prompt tokens it served from its
    prefix cache. The engine maps the pages under its own page ids at admission."""

    payload: object  # jaxserve.kv.handoff.KvPayload in this engine's KV format
    digest: str  # 16 hex digits (jaxserve.kv.handoff.digest_hex)
    first_token: int
    cached_tokens: int = 0
    recompute_on_failure: bool = False  # a digest mismatch: prefill locally instead of failing
    # The prompt ids the pages hold, when the receiver computes the prompt itself (a chat
    # request it renders again for its own plan): they must be the ids it computed.
    token_ids: list[int] | None = None


class KvHandoffError(RuntimeError):
    """A handed-off request's pages failed their digest check; the request is aborted."""

    def __init__(self, request_id: str, cause: str, detail: str = ""):
        super().__init__(f"request {request_id!r}: KV handoff failed ({cause}){': ' + detail if detail else ''}")
        self.request_id = request_id
        self.cause = cause
        self.detail = detail

    def __reduce__(self):  # whole across a process boundary
        return (KvHandoffError, (self.request_id, self.cause, self.detail))
