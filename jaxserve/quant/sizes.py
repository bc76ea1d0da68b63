"""Bytes a weight matrix takes in each stored format: one function for the engine and the planner.

``matrix_bytes(kind, k, n, group, scale_bytes)`` is what a ``[K, N]`` (input x output) weight
occupies: the engine's formats (jaxserve.quant.formats) allocate exactly this (a test checks
every registered format against the arrays it builds), and the capacity planner
(jaxserve.planner) sums it over a config's tensors, so a plan and an engine agree.

- bf16: 2 B per weight.
- fp8: 1 B per weight + one scale per output channel (``group`` 0) or per
  ``group`` x ``group`` block (a partial block has a scale of its own).
- int8: 1 B per weight + one scale per output channel.
- int4: K padded up to a multiple of ``group``; 0.5 B per (padded) weight + one scale per
  group of ``group`` input weights of each output channel.

``scale_bytes``: 4 for the float32 scales the engine makes when it quantizes at load; a
pre-quantized checkpoint's scales keep their shipped dtype (compressed-tensors int4 ships
bf16 scales: 2).
"""
from __future__ import annotations

import math

KINDS = ("bf16", "fp8", "int8", "int4")


def matrix_bytes(kind: str, k: int, n: int, group: int = 0, scale_bytes: int = 4) -> int:
    """Stored bytes of one [k, n] weight in ``kind`` (see the module docstring)."""
    if kind == "bf16":
        return 2 * k * n
    if kind == "fp8":
        scales = n if not group else math.ceil(k / group) * math.ceil(n / group)
        return k * n + scale_bytes * scales
    if kind == "int8":
        return k * n + scale_bytes * n
    if kind == "int4":
        if group < 1:
            raise ValueError("int4 needs a group size")
        groups = math.ceil(k / group)
        return groups * group // 2 * n + scale_bytes * groups * n
    raise ValueError(f"unknown weight kind {kind!r} (one of {', '.join(KINDS)})")
