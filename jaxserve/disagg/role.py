"""A worker's role in disaggregated serving, checked here and nowhere else: "both" (an ordinary
engine), "prefill" (prefills for KV handoffs and exports the prompt's pages; holds the prefill
weights alone, no decode program) or "decode" (imports handed-off pages and decodes; prefill
reads the decode weights)."""
from __future__ import annotations

import dataclasses

ROLES = ("both", "prefill", "decode")
DEFAULT_HANDOFF_FORMAT = "fp8_e4m3"  # what a prefill worker exports to unless told


@dataclasses.dataclass(frozen=True)
class WorkerRole:
    name: str = "both"

    def __post_init__(self):
        if self.name not in ROLES:
            raise ValueError(f"role must be both, prefill or decode, got {self.name!r}")

    @property
    def hands_off(self) -> bool:
        """A prefill or decode worker: its weights are hashed (the handoff fingerprint), it
        serves the KvHandoff service and warms its handoff programs."""
        return self.name != "both"

    @property
    def exports(self) -> bool:
        return self.name == "prefill"

    @property
    def imports(self) -> bool:
        return self.name == "decode"

    @property
    def decodes(self) -> bool:
        """Whether it holds a decode program (a prefill worker does not)."""
        return self.name != "prefill"

    def check_request(self, export_kv: str | None) -> None:
        """ValueError for a request this role does not run: a prefill worker only prefills for
        a handoff (``export_kv``)."""
        if self.name == "prefill" and export_kv is None:
            raise ValueError("a prefill worker only prefills for a KV handoff (export_kv)")

    def export_formats(self, pool_format: str, handoff_format: str | None) -> list[str]:
        """The KV formats warm-up builds export programs for: the pool's own and the handoff
        format, on a prefill worker; none elsewhere."""
        return sorted({pool_format, handoff_format or DEFAULT_HANDOFF_FORMAT}) if self.exports else []

    def refuses_call(self, call: str) -> str | None:
        """Why this worker refuses the KvHandoff ``call`` ("Prefill" | "Decode"), or None."""
        if call == "Prefill" and self.name == "decode":
            return "a decode worker does not prefill for handoffs"
        if call == "Decode" and self.name == "prefill":
            return "a prefill worker does not decode"
        return None
