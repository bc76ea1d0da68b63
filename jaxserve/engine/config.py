"""EngineConfig: everything that shapes a serving engine, frozen and validated at construction."""
from __future__ import annotations

import dataclasses
import os

from jaxserve.disagg.role import WorkerRole
from jaxserve.engine.scheduler import SchedulerConfig
from jaxserve.engine.speculative.gate import POLICIES as SPECULATIVE_POLICIES
from jaxserve.kv import memory as kv_memory


def _field(default, help: str, flag: str | None = None, cli: bool = True, factory=None, **kw):
    """A config field with what its command-line flag needs: help, and a spelling other than
    --field-name (``flag``); cli=False keeps it out of the command lines."""
    meta = dict(help=help, flag=flag, cli=cli, **kw)
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes a serving engine; frozen and validated. The single source of the
    engine flags of every command line (jaxserve.cli_args builds them from these fields)."""

    num_pages: int = _field(256, "KV pages (page 0 is the reserved null page); or size the pool with "
                                 "--kv-cache-memory / --memory-fraction")
    page_size: int = _field(16, "tokens per KV page (a power of two)")
    max_model_len: int | None = _field(None, "longest prompt + output (default: the model's context)", type=int)
    max_num_seqs: int = _field(16, "decode batch: running requests at most")
    max_num_batched_tokens: int = _field(256, "prefill tokens per step")
    max_prefill_seqs: int = _field(4, "prefill rows per step")
    prefill_chunk: int = _field(128, "new tokens of one request in one prefill step (chunked prefill)")
    client_scheduling: str = _field("fair", "which waiting request is admitted first: fair (the client with the fewest "
                                            "running requests; a client is an API key, else a connection) | fifo "
                                            "(arrival order)", choices=("fair", "fifo"))
    max_slots_per_client: int | None = _field(
        None, "running requests one client may hold while another client is present (fair scheduling: past it, "
              "it is not admitted more and its newest gives way to a waiting client when the batch is full); a lone "
              "client may use every slot; 0 = no bound "
              "(default: half the decode batch, max_num_seqs, rounded up)", type=int)
    enable_prefix_caching: bool = _field(True, "turn the prefix cache off", flag="--no-prefix-caching")
    integrity_check: bool = _field(True, "turn the KV page integrity check off", flag="--no-integrity-check")
    seed: int = _field(0, "seeds requests that give none", cli=False)
    # Prefill is compute-bound: bf16 or fp8 (int8 on CPU, where int8 dots are the fastest);
    # decode is memory-bound: int4 (group 32/64/128), int8, fp8 or bf16.
    prefill_weights: str | None = _field(None, "prefill weight format: bf16 | int8 | fp8_e4m3 | fp8:block128 "
                                               "(default: as loaded)", type=str)
    decode_weights: str | None = _field(None, "decode weight format: bf16 | int8 | fp8_e4m3 | fp8:block128 | "
                                              "int4:g32|g64|g128 (default: as loaded)", type=str)
    attention_backend: str | None = _field(
        None, "attention over the paged cache, prefill and decode (default: pallas on a GPU, native on a CPU "
              "where jaxserve's native kernels load, else xla; native: its kernel for decode and verify steps "
              "of GQA models, xla for the rest; pallas_interpret: the kernels interpreted on CPU, for tests)",
        type=str, choices=("xla", "native", "pallas", "pallas_interpret"))
    matmul_backend: str = _field("auto", "quantized matmul formulations (auto: gpu on a GPU host, else cpu; "
                                         "interpret: the GPU ones with Pallas interpreted)",
                                 choices=("auto", "cpu", "gpu", "interpret"))
    quantize_tied_head: bool = _field(False, "store a tied embedding's head in each phase's format too (fewer "
                                             "bytes per step, more error in the logits)")
    tied_head_weights: str | None = _field(
        None, "a tied embedding's head (and its lookup table) stored once in this format for every phase: bf16 | "
              "int8 | fp8_e4m3 | int4:g32|g64|g128 (default: as loaded, or each phase's format with "
              "--quantize-tied-head)", type=str)
    prefill_from_decode_weights: bool = _field(False, "prefill reads the decode copy (e.g. int4): one resident "
                                                      "weight copy instead of two")
    kv_cache_memory: int | str | None = _field(None, "KV pool size in bytes (48GiB, 512MiB, ...): decides the page "
                                                     "count for the KV format", type=str)
    memory_fraction: float | None = _field(None, "KV pool = this fraction of the memory free after loading (GPU: "
                                                 "device; CPU: available RAM)", type=float)
    batch_invariant: bool = _field(False, "batch-invariant numerics: a request's log-probs are bitwise the same "
                                          "whatever else is batched with it, at some speed cost (matmuls and "
                                          "attention run over fixed row tiles)")
    speculative: str | None = _field(None, "speculative decoding: ngram (prompt lookup: draft the tokens that "
                                           "followed the latest earlier match of the last n tokens; lossless) | mtp "
                                           "(the checkpoint's multi-token-prediction layer drafts, chained for k > 1: "
                                           "DeepSeek-V3 / Kimi K2 / GLM-5 checkpoints with "
                                           "num_nextn_predict_layers > 0; lossless) (default: off)", type=str,
                                     choices=("ngram", "mtp"))
    num_speculative_tokens: int = _field(4, "draft tokens per request per verify step (--speculative)")
    ngram_max: int = _field(3, "longest suffix n-gram the ngram proposer matches")
    ngram_min: int = _field(1, "shortest suffix n-gram the ngram proposer matches")
    speculative_min_acceptance: float = _field(
        0.3, "a request's speculation pauses (for a doubling number of tokens) while its acceptance rate over "
             "its last 16 draft tokens stays below this")
    speculative_policy: str = _field(
        "auto", "when a decode batch runs as a verify call: auto (when the tokens it is expected to emit over all "
                "its rows, from each request's recent acceptance, reach the verify call's measured cost in decode "
                "calls at that batch size; otherwise it decodes plainly) | always (every batch with a draft; no "
                "pauses)", choices=SPECULATIVE_POLICIES)
    role: str = _field("both", "both | prefill (prefill and KV export only) | decode (decode weights only; "
                               "handed-off KV imported)", cli=False)
    kv_handoff_format: str | None = _field(None, "KV format a prefill worker's exports are compiled for at warm-up "
                                                 "(the decode workers' pool format; default fp8_e4m3)", type=str, cli=False)
    keep_finished: int = _field(1024, "finished requests the engine keeps answering completion(id) for (a server "
                                      "needs none: each request's last output carries its completion)", cli=False)
    max_grammar_bytes: int = _field(65536, "largest structured-output grammar (JSON schema, regex, Lark) a "
                                           "request may give, in bytes")
    grammar_compile_ms: int = _field(2000, "bound on one grammar's compilation: the lexer work llguidance does in "
                                           "about this many milliseconds; past it the request is refused")
    program_cache: str | None = _field(
        None, "directory of the compiled-program cache, so a restart with the same configuration compiles "
              "nothing ('off': none; default: none from Python, <cache>/programs from the command line)", type=str)
    compile_workers: int = _field(0, "programs compiled at once during warm-up (0: one per CPU core)")
    strict_compiles: bool = _field(
        None, "a serving program compiled after warm-up raises (default: logged and counted; "
              "$JAXSERVE_STRICT_COMPILES=1 turns it on)",
        factory=lambda: os.environ.get("JAXSERVE_STRICT_COMPILES", "") == "1")

    def __post_init__(self):
        WorkerRole(self.role)  # ValueError for an unknown role
        if self.kv_handoff_format is not None:
            from jaxserve.kv.formats import get_kv_format

            get_kv_format(self.kv_handoff_format)
        if self.speculative not in (None, "ngram", "mtp"):
            raise ValueError(f"speculative must be ngram or mtp, got {self.speculative!r}")
        if self.speculative_policy not in SPECULATIVE_POLICIES:
            raise ValueError(f"speculative_policy must be one of {SPECULATIVE_POLICIES}, "
                             f"got {self.speculative_policy!r}")
        if self.num_speculative_tokens < 1 or not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("num_speculative_tokens must be >= 1 and 1 <= ngram_min <= ngram_max")
        if not 0 <= self.speculative_min_acceptance <= 1:
            raise ValueError(f"speculative_min_acceptance must be in [0, 1], got {self.speculative_min_acceptance}")
        if self.compile_workers < 0:
            raise ValueError(f"compile_workers must be >= 0, got {self.compile_workers}")
        if self.max_grammar_bytes < 1 or self.grammar_compile_ms < 1:
            raise ValueError("max_grammar_bytes and grammar_compile_ms must be >= 1")
        if self.keep_finished < 0:
            raise ValueError("keep_finished must be >= 0")
        if self.num_pages < 2:
            raise ValueError("num_pages must be >= 2 (page 0 is the reserved null page)")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        self.scheduler_config()  # a clear error for a bad batch size, policy or bound
        from jaxserve.quant.formats import get_weight_format

        for phase, spec, allowed in (
            ("prefill", self.prefill_weights, ("bf16", "fp8_e4m3", "fp8:block128", "int8")),
            ("decode", self.decode_weights,
             ("bf16", "fp8_e4m3", "fp8:block128", "int8", "int4:g32", "int4:g64", "int4:g128")),
        ):
            if spec is not None and get_weight_format(spec).name not in allowed:
                raise ValueError(f"{phase}_weights={spec!r} is not a {phase} format; choose one of {allowed}")
        if self.tied_head_weights is not None:
            if self.quantize_tied_head:
                raise ValueError("tied_head_weights stores the head in one format; quantize_tied_head in each "
                                 "phase's: set one of them")
            get_weight_format(self.tied_head_weights)  # a clear error for an unknown format
        if self.kv_cache_memory is not None:
            kv_memory.parse_size(self.kv_cache_memory)  # a clear error for a bad size
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.prefill_from_decode_weights and self.prefill_weights is not None:
            raise ValueError("prefill_from_decode_weights reads the decode copy: leave prefill_weights unset")
        from jaxserve.quant.linear import resolve_backend

        resolve_backend(self.matmul_backend)  # a clear error for an unknown name

    def scheduler_config(self) -> SchedulerConfig:
        slots = self.max_slots_per_client if self.max_slots_per_client is not None else -(-self.max_num_seqs // 2)
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.max_prefill_seqs, self.prefill_chunk,
                               self.client_scheduling, slots)
