"""``KvHandoff``: the part of ``LLMEngine`` that a KV handoff needs, a component the engine
holds and calls (not a mixin). It checks a handed-off request against this engine's pool and
role, writes its pages at admission (digest checked on device), exports a finished prefill's
pages, and answers what a peer engine or the KvHandoff service compares or needs: the layout
signature, the fingerprint, the payload specs and page axes of a format, the format a target
layout names. See ``jaxserve.kv.handoff`` for the device functions and layouts."""
from __future__ import annotations

import hashlib
import json
import time

import numpy as np

from jaxserve.disagg.handoff_request import KvHandoffError, KvImport
from jaxserve.disagg.role import WorkerRole
from jaxserve.kv import handoff


class KvHandoff:
    """runner: the engine's ModelRunner (its pools and handoff programs); config: its
    EngineConfig; vocab_size, architecture: the model's; bm, scheduler, outputs, constraints:
    the engine's block manager, scheduler, output processor and grammar constraints;
    finish(seq, reason, error=None): the engine's way to end a request."""

    def __init__(self, runner, config, vocab_size: int, architecture: str, bm, scheduler, outputs, constraints,
                 finish):
        self.runner, self.config, self.vocab_size, self.architecture = runner, config, vocab_size, architecture
        self.bm, self.scheduler, self.outputs, self.constraints, self.finish = bm, scheduler, outputs, constraints, finish
        self.role = WorkerRole(config.role)
        self.programs = runner.handoff  # the export / import programs (jaxserve.disagg.programs)

    # ------------------------------------------------------------------ facts
    @property
    def kv_format(self) -> str:
        """The pool's KV format name (what an import must arrive in)."""
        return self.runner.fmt.name

    def layout(self, fmt: str | None = None) -> str:
        """This engine's KV layout signature (in ``fmt``; default its pool's format); ValueError
        for an unknown format."""
        return self.programs.layout(fmt)

    def format_for_layout(self, layout: str) -> str | None:
        """The KV format whose layout signature is ``layout`` ('' = the pool's own); None if none."""
        return self.programs.format_for_layout(layout)

    def payload_specs(self, fmt: str, num_pages: int):
        """The payload of ``num_pages`` pages in ``fmt``, bucketed: one ShapeDtypeStruct per pool."""
        return self.programs.specs(fmt, num_pages)

    def leaf_axes(self, fmt: str | None = None) -> list[int]:
        """The page axis of every payload leaf in ``fmt`` (default the pool's own)."""
        return self.programs.leaf_axes(fmt)

    def fingerprint(self) -> str:
        """sha256 over the weights as loaded and every phase's declared format: equal on a
        prefill and a decode worker of one deployment ('' for a "both" engine, which does
        not hash its weights)."""
        if not self.runner.source_digest:
            return ""
        c = self.config
        ident = dict(weights=self.runner.source_digest, architecture=self.architecture,
                     dtype=np.dtype(self.runner.dtype).name,
                     prefill_weights=c.prefill_weights, decode_weights=c.decode_weights,
                     quantize_tied_head=c.quantize_tied_head, prefill_from_decode_weights=c.prefill_from_decode_weights,
                     **({"tied_head_weights": c.tied_head_weights} if c.tied_head_weights else {}))
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()

    # ------------------------------------------------------------------ requests
    def check_request(self, export_kv: str | None) -> None:
        """ValueError for a request this engine cannot run: the role's rule, an unknown export format."""
        self.role.check_request(export_kv)
        if export_kv is not None:
            self.layout(export_kv)  # ValueError for an unknown format

    def check_import(self, imp: KvImport, ids: list[int]) -> None:
        """ValueError for an import this engine cannot map: its role does not decode, the pages
        do not fit the prompt in this pool's format and page size, or they hold other ids."""
        if not self.role.decodes:
            raise ValueError("a prefill worker does not decode handed-off requests")
        p, page_size = imp.payload, self.config.page_size
        if imp.token_ids is not None and list(imp.token_ids) != list(ids):
            raise ValueError(f"the handed-off KV holds another prompt ({len(imp.token_ids)} tokens) than this "
                             f"worker's rendering of the request ({len(ids)} tokens)")
        if p.fmt != self.kv_format or p.num_pages != -(-len(ids) // page_size):
            raise ValueError(f"the handed-off KV ({p.num_pages} {p.fmt} pages) does not fit a {len(ids)}-token "
                             f"prompt in {self.kv_format} pages of {page_size}")
        if not 0 <= imp.first_token < self.vocab_size:
            raise ValueError(f"first token {imp.first_token} outside the vocabulary")

    def export(self, seq, reason: str) -> None:
        """A prefill for a handoff that ended well: the prompt's pages (its KV is complete: the
        first token was sampled from it), gathered before the pages are released."""
        if seq.export_kv is None or reason not in ("stop", "length") or not seq.output_ids:
            return
        seq.kv_export = self.runner.export_pages(seq.pages[: self.bm.pages_for(len(seq.prompt_ids))], seq.export_kv)
        seq.kv_export.token_ids = list(seq.prompt_ids)

    def map_imported(self, seq, events) -> None:
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
                self.finish(seq, "abort", KvHandoffError(seq.request_id, "digest_mismatch",
                                                         f"expected {imp.digest}, the pages hold {got}"))
            return
        seq.kv_import = None  # mapped: a later preemption recomputes from the tokens
        self.bm.commit_full_pages(seq.request_id, seq.prompt_ids)
        events.setdefault(seq.request_id, []).append(imp.first_token)
        reason = self.outputs.append(seq, imp.first_token, 0.0, None, time.perf_counter())
        if seq.grammar is not None:  # the decode worker owns the grammar: it starts with the first token
            reason = reason or self.constraints.advance(seq, imp.first_token)
        if reason is not None:
            self.finish(seq, reason)
