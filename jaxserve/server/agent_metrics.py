"""Prometheus metrics of structured outputs and tool calls (part of ``ServerMetrics``)."""
from __future__ import annotations

from prometheus_client import Counter, Histogram


class AgentMetrics:
    def __init__(self, r):
        self.structured = {
            "requests": Counter("jaxserve_structured_requests", "Requests decoded under a grammar (JSON schema, "
                                "regex, Lark, a required tool call)", registry=r),
            "rejected": Counter("jaxserve_structured_rejected", "Grammars that did not compile (refused requests)",
                                registry=r),
            "mask_rows": Counter("jaxserve_grammar_masks", "Token masks computed (one per constrained row per step)",
                                 registry=r),
            "mask_seconds": Counter("jaxserve_grammar_mask_seconds", "Host time computing token masks (divide by "
                                    "jaxserve_grammar_mask_steps for the time per step)", registry=r),
            "mask_steps": Counter("jaxserve_grammar_mask_steps", "Sampling calls with a constrained row", registry=r),
            "mask_wait_seconds": Counter("jaxserve_grammar_mask_wait_seconds", "Host time the sampler waited for "
                                         "token masks (those computed while the device ran the step and not ready "
                                         "yet, or computed then)", registry=r),
            "invalid_outputs": Counter("jaxserve_structured_invalid_outputs", "Sampled tokens a grammar refused",
                                       registry=r),
        }
        self.grammar_compile = Histogram("jaxserve_grammar_compile_seconds", "One grammar's compilation",
                                         buckets=(0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10), registry=r)
        self.tool_calls = Counter("jaxserve_tool_calls", "Tool calls parsed from outputs, by parser", ["parser"],
                                  registry=r)
        self.tool_calls_invalid = Counter("jaxserve_tool_calls_invalid_arguments", "Parsed tool calls whose "
                                          "arguments are not a JSON object, by parser", ["parser"], registry=r)
        self._seen_structured: dict[str, float] = {}

    def sync(self, stats: dict) -> None:
        """From ``EngineSnapshot.constraints`` (engine thread): the counters' increments, new compile times."""
        for name, counter in self.structured.items():
            n, seen = stats.get(name, 0), self._seen_structured.get(name, 0)
            if n > seen:
                counter.inc(n - seen)
                self._seen_structured[name] = n
        count, times = stats.get("compile_seconds", (0, []))
        new = count - int(self._seen_structured.get("compiles", 0))
        for t in times[len(times) - min(new, len(times)):] if new > 0 else ():
            self.grammar_compile.observe(t)
        self._seen_structured["compiles"] = max(count, int(self._seen_structured.get("compiles", 0)))
