"""EngineConfig: everything that shapes a serving engine, frozen and validated at construction."""
from __future__ import annotations

import dataclasses
import os

from jaxserve.engine.scheduler import SchedulerConfig
from jaxserve.kv import memory as kv_memory


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes a serving engine; frozen and validated."""

    num_pages: int = 256
    page_size: int = 16
    max_model_len: int | None = None  # default: the model's context, capped by the page pool
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    max_prefill_seqs: int = 4
    prefill_chunk: int = 128
    enable_prefix_caching: bool = True
    integrity_check: bool = True  # False = NoOpTracker
    seed: int = 0  # seeds requests that give none
    # Weight representation per phase (None = as loaded). Prefill is compute-bound: bf16 or
    # fp8 (int8 on CPU, where int8 dots are the fastest); decode is memory-bound: int4 (group
    # 32/64/128), int8, fp8 or bf16.
    prefill_weights: str | None = None
    decode_weights: str | None = None
    # Decode attention: "xla" (pure jnp), "pallas" (GPU kernels), "pallas_interpret" (the
    # kernels interpreted on CPU, for tests). None = "pallas" on GPU, "xla" elsewhere.
    attention_backend: str | None = None
    # Quantized matmuls (jaxserve.quant.paths): "auto" (gpu on a GPU host, else cpu), "cpu",
    # "gpu", "interpret" (the GPU formulations with Pallas interpreted on CPU, for tests).
    matmul_backend: str = "auto"
    # A tied model's embedding table stored as its head in each phase's format as well (fewer
    # bytes per step, more error in the logits); off: the table stays as loaded.
    quantize_tied_head: bool = False
    # One process, one weight copy: prefill reads the decode representation (e.g. int4) instead
    # of a copy of its own (prefill_weights must then be unset).
    prefill_from_decode_weights: bool = False
    # KV pool from a byte budget instead of num_pages: bytes ("48GiB" or an int), or a fraction
    # of the memory free after loading (GPU: device limit minus use; CPU: available RAM).
    kv_cache_memory: int | str | None = None
    memory_fraction: float | None = None
    # Finished requests the engine keeps answering `completion(id)` for (a server needs none:
    # each request's last output carries its completion).
    keep_finished: int = 1024
    # A serving program compiled after warm-up raises RecompilationError (True) or is logged
    # and counted (False: jaxserve_compiles_after_warmup). Default: $JAXSERVE_STRICT_COMPILES=1.
    strict_compiles: bool = dataclasses.field(
        default_factory=lambda: os.environ.get("JAXSERVE_STRICT_COMPILES", "") == "1")

    def __post_init__(self):
        if self.keep_finished < 0:
            raise ValueError("keep_finished must be >= 0")
        if self.num_pages < 2:
            raise ValueError("num_pages must be >= 2 (page 0 is the reserved null page)")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.max_prefill_seqs, self.prefill_chunk)
        from jaxserve.quant.formats import get_weight_format

        for phase, spec, allowed in (
            ("prefill", self.prefill_weights, ("bf16", "fp8_e4m3", "fp8:block128", "int8")),
            ("decode", self.decode_weights,
             ("bf16", "fp8_e4m3", "fp8:block128", "int8", "int4:g32", "int4:g64", "int4:g128")),
        ):
            if spec is not None and get_weight_format(spec).name not in allowed:
                raise ValueError(f"{phase}_weights={spec!r} is not a {phase} format; choose one of {allowed}")
        if self.kv_cache_memory is not None:
            kv_memory.parse_size(self.kv_cache_memory)  # a clear error for a bad size
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.prefill_from_decode_weights and self.prefill_weights is not None:
            raise ValueError("prefill_from_decode_weights reads the decode copy: leave prefill_weights unset")
        from jaxserve.quant.linear import resolve_backend

        resolve_backend(self.matmul_backend)  # a clear error for an unknown name

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.max_prefill_seqs, self.prefill_chunk)
