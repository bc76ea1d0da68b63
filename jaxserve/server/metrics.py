"""Prometheus metrics of one server (its own registry, so several servers can live in one
process, e.g. in tests), served by prometheus-client's HTTP server.

Writers: the event loop (requests by outcome, queue depth, sessions) and the engine
thread (tokens, latencies, KV pages, integrity); prometheus-client metrics are thread-safe.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

from jaxserve.server.agent_metrics import AgentMetrics

# Latency buckets from sub-millisecond decode steps on a GPU to multi-second CPU prefills.
_MATMUL_WEIGHTS = ("Stored weights per phase by the matmul path that runs them (refused=1: the format's kernel "
                   "refused them, the path is its fallback)")
_PATH_LABELS = ("phase", "path", "refused")
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "jaxserve_requests", "Finished generation requests by RPC and outcome (finish reason or status code)",
            ["rpc", "outcome"], registry=r,
        )
        self.prompt_tokens = Counter("jaxserve_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter("jaxserve_completion_tokens", "Generated tokens", registry=r)
        self.cached_tokens = Counter("jaxserve_cached_tokens", "Prompt tokens served from the prefix cache", registry=r)
        self.ttft = Histogram("jaxserve_time_to_first_token_seconds", "Arrival at the server to first token",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("jaxserve_inter_token_latency_seconds", "Time between consecutive token deltas",
                             buckets=_LATENCY, registry=r)
        self.e2e = Histogram("jaxserve_request_duration_seconds", "Arrival to finish", buckets=_LATENCY, registry=r)
        self.queue_depth = Gauge("jaxserve_queue_depth", "Accepted requests not yet admitted by the scheduler",
                                 registry=r)
        self.running = Gauge("jaxserve_running_requests", "Requests holding KV pages", registry=r)
        self.active_sessions = Gauge("jaxserve_active_sessions", "Distinct session ids with requests in flight",
                                     registry=r)
        self.session_requests = Counter("jaxserve_session_requests", "Requests that carried a session id",
                                        registry=r)
        self.kv_used = Gauge("jaxserve_kv_pages_used", "KV pages owned by requests", registry=r)
        self.kv_free = Gauge("jaxserve_kv_pages_free", "KV pages free or evictable (prefix cache)", registry=r)
        self.kv_total = Gauge("jaxserve_kv_pages_total", "Usable KV pages (null page excluded)", registry=r)
        self.integrity_checks = Counter("jaxserve_integrity_checks", "Page tracker checks run (one per program)",
                                        registry=r)
        self.integrity_rows = Counter("jaxserve_integrity_rows_checked", "Request rows checked", registry=r)
        self.integrity_mismatches = Counter("jaxserve_integrity_mismatches", "Rows that failed the check, by cause",
                                            ["cause"], registry=r)
        self.engine_errors = Counter("jaxserve_engine_step_errors", "Unexpected exceptions in engine.step()",
                                     registry=r)
        self.compiles_after_warmup = Gauge("jaxserve_compiles_after_warmup",
                                           "Serving programs compiled after warm-up (should stay 0)", registry=r)
        self.warmup_done = Gauge("jaxserve_warmup_programs_ready", "Serving programs built (loaded or compiled)",
                                 registry=r)
        self.warmup_total = Gauge("jaxserve_warmup_programs_total", "Serving programs warm-up builds", registry=r)
        self.programs_compiled = Gauge("jaxserve_programs_compiled", "Serving programs XLA compiled at start-up",
                                       registry=r)
        self.programs_loaded = Gauge("jaxserve_programs_loaded", "Serving programs loaded from the program cache",
                                     registry=r)
        self.serving = Gauge("jaxserve_serving", "1 when warmed up and accepting requests", registry=r)
        self._model_metrics(r)
        self._handoff_metrics(r)
        self.agents = AgentMetrics(r)  # structured outputs and tool calls
        self._speculative_metrics(r)
        for cause in ("stale_generation", "out_of_range_page", "page_not_owned"):
            self.integrity_mismatches.labels(cause)  # export zeros, so rate() works from the start
        self._seen_mismatches: dict[str, int] = {}
        self._seen_checks = self._seen_rows = 0

    def _handoff_metrics(self, r) -> None:
        """The KV handoff (prefill and decode workers, jaxserve.disagg.service)."""
        self.handoff_offers = Counter("jaxserve_kv_handoff_offers", "KV offers made (prefill worker)", registry=r)
        self.handoff_open = Gauge("jaxserve_kv_handoff_open_offers", "KV offers awaiting a pull or release", registry=r)
        self.handoff_expired = Counter("jaxserve_kv_handoff_expired", "KV offers drained unpulled at expiry",
                                       registry=r)
        self.handoff_pulls = Counter("jaxserve_kv_handoff_pulls", "KV payloads pulled (decode worker)", ["transport"],
                                     registry=r)
        self.handoff_bytes = Counter("jaxserve_kv_handoff_pull_bytes", "Bytes of the KV payloads pulled",
                                     ["transport"], registry=r)
        self.handoff_seconds = Histogram("jaxserve_kv_handoff_pull_seconds", "One KV pull, request to payload",
                                         buckets=_LATENCY, registry=r)
        self.handoff_failures = Counter("jaxserve_kv_handoff_failures", "KV handoffs refused or failed, by cause",
                                        ["cause"], registry=r)

    def _speculative_metrics(self, r) -> None:
        """Speculative decoding (--speculative): acceptance rate = accepted / draft tokens; mean
        accepted length = 1 + accepted / verify steps."""
        self.spec_draft = Counter("jaxserve_spec_draft_tokens", "Speculative draft tokens verified", registry=r)
        self.spec_accepted = Counter("jaxserve_spec_accepted_tokens", "Speculative draft tokens accepted", registry=r)
        self.spec_steps = Counter("jaxserve_spec_verify_steps", "Requests' verify steps with draft tokens", registry=r)
        self._seen_spec = (0, 0, 0)

    def _model_metrics(self, r) -> None:
        """What the server says about its model: formats (info) and the weights per matmul path."""
        self.info = Info("jaxserve_model", "The served model and its formats", registry=r)
        self.matmul_weights = Gauge("jaxserve_matmul_path_weights", _MATMUL_WEIGHTS, _PATH_LABELS, registry=r)

    def set_matmul_paths(self, rows_by_phase: dict) -> None:
        """From ``ModelRunner.weight_path_rows()``: weights per (phase, path, refused)."""
        for phase, rows in rows_by_phase.items():
            counts: dict = {}
            for row in rows:
                key = (row.path, "1" if row.refused else "0")
                counts[key] = counts.get(key, 0) + 1
            for (path, refused), n in counts.items():
                self.matmul_weights.labels(phase, path, refused).set(n)

    def sync_engine(self, snap) -> None:
        """Engine thread, after each step, from ``LLMEngine.snapshot()``: KV gauges and the
        integrity and compile counters (as deltas)."""
        self.kv_used.set(snap.kv_pages_used)
        self.kv_free.set(snap.kv_pages_free)
        self.kv_total.set(snap.kv_pages_total)
        self.running.set(snap.running)
        self.compiles_after_warmup.set(snap.compiles_after_warmup)
        self.programs_compiled.set(snap.programs_compiled)
        self.programs_loaded.set(snap.programs_loaded)
        if snap.integrity_checks != self._seen_checks:
            self.integrity_checks.inc(snap.integrity_checks - self._seen_checks)
            self.integrity_rows.inc(snap.integrity_rows - self._seen_rows)
            self._seen_checks, self._seen_rows = snap.integrity_checks, snap.integrity_rows
        self.agents.sync(snap.constraints)
        spec = (snap.spec_draft_tokens, snap.spec_accepted_tokens, snap.spec_verify_steps)
        if spec != self._seen_spec:
            for counter, n, seen in zip((self.spec_draft, self.spec_accepted, self.spec_steps), spec, self._seen_spec):
                counter.inc(n - seen)
            self._seen_spec = spec
        for cause, n in snap.integrity_mismatches.items():
            seen = self._seen_mismatches.get(cause, 0)
            if n != seen:
                self.integrity_mismatches.labels(cause).inc(n - seen)
                self._seen_mismatches[cause] = n

    def serve_http(self, port: int, host: str = "127.0.0.1"):
        """Start the /metrics HTTP server (port 0 = ephemeral) -> (server, thread, bound port)."""
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        return server, thread, server.server_address[1]
