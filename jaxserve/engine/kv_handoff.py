"""The KV handoff half of ``LLMEngine`` (a mixin, kept in its own file): checking a handed-off
request, writing its pages at admission, and the facts a peer engine compares (layout,
fingerprint). Exports happen in ``LLMEngine._finish``; see ``jaxserve.kv.handoff``."""
from __future__ import annotations

import hashlib
import json
import time

import numpy as np

from jaxserve.engine.sequence import KvHandoffError, KvImport, Sequence
from jaxserve.kv import handoff


class KvHandoffMixin:
    def _check_import(self, imp: KvImport, ids: list[int]) -> None:
        p = imp.payload
        if self.config.role == "prefill":
            raise ValueError("a prefill worker does not decode handed-off requests")
        if p.fmt != self.runner.fmt.name or p.num_pages != -(-len(ids) // self.config.page_size):
            raise ValueError(f"the handed-off KV ({p.num_pages} {p.fmt} pages) does not fit a {len(ids)}-token "
                             f"prompt in {self.runner.fmt.name} pages of {self.config.page_size}")
        if not 0 <= imp.first_token < self.cfg.vocab_size:
            raise ValueError(f"first token {imp.first_token} outside the vocabulary")

    def kv_layout(self, fmt: str | None = None) -> str:
        """This engine's KV layout signature (in ``fmt``; default its pool's format)."""
        return self.runner.handoff.layout(fmt)

    def handoff_fingerprint(self) -> str:
        """sha256 over the weights as loaded and every phase's declared format: equal on a
        prefill and a decode worker of one deployment ('' for a "both" engine, which does
        not hash its weights)."""
        if not self.runner.source_digest:
            return ""
        c = self.config
        ident = dict(weights=self.runner.source_digest, architecture=self.cfg.architecture,
                     dtype=np.dtype(self.runner.dtype).name,
                     prefill_weights=c.prefill_weights, decode_weights=c.decode_weights,
                     quantize_tied_head=c.quantize_tied_head, prefill_from_decode_weights=c.prefill_from_decode_weights)
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()

    def _map_imported(self, seq: Sequence, events) -> None:
        """Write a handed-off request's pages (digest checked on device first), register them
        in the prefix cache and append the first token; a mismatch writes nothing and fails
        the request, or queues it to prefill here (recompute_on_failure)."""
        imp = seq.kv_import
        n = imp.payload.num_pages
        ok, got = self.runner.import_pages(seq.pages[:n], imp.payload, handoff.parse_digest(imp.digest))
        if not ok:
            if imp.recompute_on_failure:
                self.scheduler.requeue(seq)
            else:
                self._finish(seq, "abort", KvHandoffError(seq.request_id, "digest_mismatch",
                                                          f"expected {imp.digest}, the pages hold {got}"))
            return
        seq.kv_import = None  # mapped: a later preemption recomputes from the tokens
        self.bm.commit_full_pages(seq.request_id, seq.prompt_ids)
        events.setdefault(seq.request_id, []).append(imp.first_token)
        reason = self.outputs.append(seq, imp.first_token, 0.0, None, time.perf_counter())
        if seq.grammar is not None:  # the decode worker owns the grammar: it starts with the first token
            reason = reason or self.constraints.advance(seq, imp.first_token)
        if reason is not None:
            self._finish(seq, reason)
