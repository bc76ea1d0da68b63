"""Prometheus metrics of the router (its own registry): requests as a worker counts them, plus
per worker (up, in flight, calls by outcome, failed health checks), routing decisions, retries,
and per KV handoff (count by outcome, latency by stage, offered bytes, failures by cause)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
HANDOFF_CAUSES = ("prefill_unavailable", "prefill_aborted", "prefill_resource_exhausted", "prefill_worker_lost",
                  "no_prefill_worker", "pull_aborted", "failed_precondition", "decode_unavailable",
                  "decode_resource_exhausted", "decode_worker_lost", "fingerprint_mismatch", "offer_mismatch")


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        # The same name and labels as a worker's, so dashboards read a router like a worker.
        self.requests = Counter("jaxserve_requests", "Finished generation requests by RPC and outcome",
                                ["rpc", "outcome"], registry=r)
        self.cached_tokens = Counter("jaxserve_cached_tokens", "Prompt tokens served from a worker's prefix cache",
                                     registry=r)
        self.serving = Gauge("jaxserve_serving", "1 when some worker can take generations", registry=r)
        self.worker_up = Gauge("jaxserve_router_worker_up", "1 while the worker's health check answers SERVING",
                               ["worker", "role"], registry=r)
        self.worker_in_flight = Gauge("jaxserve_router_worker_in_flight", "Router calls in flight on the worker",
                                      ["worker", "role"], registry=r)
        self.worker_calls = Counter("jaxserve_router_worker_calls", "Generation calls to a worker by outcome "
                                    "(ok, or the status / worker_lost)", ["worker", "role", "outcome"], registry=r)
        self.health_failures = Counter("jaxserve_router_health_check_failures", "Failed health checks",
                                       ["worker"], registry=r)
        self.routed = Counter("jaxserve_router_routed", "Routing decisions by reason (session, prefix, load)",
                              ["role", "reason"], registry=r)
        self.retries = Counter("jaxserve_router_retries", "Requests moved to another worker before any token, "
                               "by cause", ["cause"], registry=r)
        self.handoffs = Counter("jaxserve_router_handoffs", "Disaggregated requests by handoff outcome "
                                "(ok, retried, no_offer, failed)", ["outcome"], registry=r)
        self.handoff_failures = Counter("jaxserve_router_handoff_failures", "Failed handoff steps by cause",
                                        ["cause"], registry=r)
        self.handoff_seconds = Histogram("jaxserve_router_handoff_seconds", "Prefill call (stage=prefill), and "
                                         "Decode call to its first event (stage=decode)", ["stage"],
                                         buckets=_LATENCY, registry=r)
        self.handoff_bytes = Counter("jaxserve_router_handoff_bytes", "KV bytes offered by prefill workers",
                                     registry=r)
        for cause in HANDOFF_CAUSES:
            self.handoff_failures.labels(cause)  # export zeros, so rate() works from the start

    def serve_http(self, port: int, host: str = "127.0.0.1"):
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        return server, thread, server.server_address[1]
