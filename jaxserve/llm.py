"""The batch Python API: ``LLM(model=PATH).generate(prompts, max_tokens=..., temperature=...)``."""
from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kv.formats import get_kv_format
from jaxserve.loader import load_model
from jaxserve.runner import ModelRunner, pad_batch
from jaxserve.sharding import make_mesh

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class LLM:
    """A model loaded from a checkpoint directory with its paged KV cache.

    model: a Hugging Face-format directory (config.json + safetensors).
    dtype: "float32" | "bfloat16" for weights and activations.
    kv_format: "bf16" | "fp8_e4m3" (| "float32", the exact reference format).
    num_devices: shard over this many devices (tensor/expert parallel).
    num_pages / page_size: the KV page pool (page 0 is reserved as the null page).
    """

    def __init__(
        self,
        model: str,
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
        self.fmt = get_kv_format(kv_format)
        self.mesh = make_mesh(num_devices) if num_devices > 1 else None
        self.cfg, model_obj = load_model(model, _DTYPES[dtype], self.mesh)
        self.runner = ModelRunner(model_obj, self.fmt, num_pages, page_size, self.mesh)
        self.page_size = page_size
        self.num_pages = num_pages

    # ------------------------------------------------------------------ helpers
    def _check_prompt(self, ids: Sequence[int], max_tokens: int) -> list[int]:
        ids = [int(x) for x in ids]
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
        return ids

    def _pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)

    # ------------------------------------------------------------------ API
    def logprobs(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 [T, vocab]: row t is log p(next token | token_ids[: t + 1]), via paged prefill."""
        ids = self._check_prompt(token_ids, 0)
        pages = list(range(1, self._pages_for(len(ids)) + 1))
        tokens, cached, new, table = pad_batch([(ids, 0, pages)])
        logits = self.runner.run(tokens, cached, new, table, all_logits=True)
        return np.asarray(jax.nn.log_softmax(logits[0, : len(ids)], axis=-1), np.float32)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int = 16,
        temperature: float = 0.0,
        seed: int = 0,
        ignore_eos: bool = False,
    ) -> list[list[int]]:
        """Generate up to `max_tokens` ids per prompt (stopping at EOS unless ignore_eos)."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if not temperature >= 0 or not math.isfinite(temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
        prompts = [self._check_prompt(p, max_tokens) for p in prompts]
        outputs: list[list[int]] = [[] for _ in prompts]
        # Waves of prompts whose pages fit the pool together (page 0 is the null page).
        wave: list[int] = []
        used = 0
        for i, p in enumerate(prompts):
            need = self._pages_for(len(p) + max_tokens)
            if used + need > self.num_pages - 1:
                self._run_wave(wave, prompts, outputs, max_tokens, temperature, seed, ignore_eos)
                wave, used = [], 0
            wave.append(i)
            used += need
        if wave:
            self._run_wave(wave, prompts, outputs, max_tokens, temperature, seed, ignore_eos)
        return outputs

    def _run_wave(self, wave, prompts, outputs, max_tokens, temperature, seed, ignore_eos):
        eos = set(self.cfg.eos_token_id) if not ignore_eos else set()
        pages, nxt = {}, 1
        for i in wave:
            n = self._pages_for(len(prompts[i]) + max_tokens)
            pages[i] = list(range(nxt, nxt + n))
            nxt += n
        key = jax.random.key(seed)
        rows = [(prompts[i], 0, pages[i]) for i in wave]
        logits = self.runner.run(*pad_batch(rows))
        lens = {i: len(prompts[i]) for i in wave}
        live = list(wave)
        for step in range(max_tokens):
            toks = self._sample(logits[: len(wave)], temperature, jax.random.fold_in(key, step))
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

    @staticmethod
    def _sample(logits, temperature: float, key) -> np.ndarray:
        if temperature == 0:
            return np.asarray(jnp.argmax(logits, axis=-1))
        return np.asarray(jax.random.categorical(key, logits / temperature, axis=-1))
