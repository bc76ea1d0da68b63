"""What a request constrains its output to (pure data: no llguidance, no tokenizer)."""
from __future__ import annotations

import dataclasses
import json

KINDS = ("json_schema", "json_object", "regex", "grammar")


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """``kind``: "json_schema" (``source``: the schema as JSON text), "json_object" (any JSON
    object; ``source`` unused), "regex" (a Rust-regex the whole output must match) or "grammar"
    (a Lark grammar, llguidance's dialect: ``start`` is the start rule).

    ``after``: the constraint starts only once the output text contains this marker (the end
    of a reasoning block, "</think>"): the thinking is free, the answer after it constrained."""

    kind: str
    source: str = ""
    after: str | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.source, str):
            raise ValueError("structured output source must be a string")
        if self.kind != "json_object" and not self.source:
            raise ValueError(f"a {self.kind} constraint needs its {self.kind.replace('json_', '')} text")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.source)
            except ValueError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("json_schema must be a JSON object (a schema)")

    @classmethod
    def json_schema(cls, schema, after: str | None = None) -> "StructuredOutput":
        """From a schema given as a dict (or its JSON text)."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema), after)

    @property
    def size(self) -> int:
        """Bytes of the grammar's source (bounded by --max-grammar-bytes)."""
        return len(self.source.encode("utf-8"))
