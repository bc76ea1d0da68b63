"""Paged decode attention over KV pages (GQA and absorbed MLA), bf16 or fp8 pages.

kernel.py (Pallas, Triton GPU backend) | reference.py (pure jnp, the spec) | validate.py
(input checks) | merge.py (log-sum-exp merge with other keys) | bench.py (timings) |
sparse.py (MLA over each query's chosen slots: DeepSeek sparse attention's top-k).
"""
from pallas_kernels.paged_attention.kernel import paged_attention_gqa, paged_attention_mla
from pallas_kernels.paged_attention.merge import merge_attention, merge_partials
from pallas_kernels.paged_attention.reference import (
    paged_attention_gqa_reference,
    paged_attention_mla_reference,
    safe_page_table,
    sparse_attention_mla_reference,
)
from pallas_kernels.paged_attention.sparse import physical_slots, sparse_attention_mla

__all__ = [
    "merge_attention",
    "merge_partials",
    "paged_attention_gqa",
    "paged_attention_gqa_reference",
    "paged_attention_mla",
    "paged_attention_mla_reference",
    "physical_slots",
    "safe_page_table",
    "sparse_attention_mla",
    "sparse_attention_mla_reference",
]
