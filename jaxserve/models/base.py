"""What every causal LM here shares: embedding, the layer loop over paged KV, logits.

An architecture subclasses ``CausalLM`` and provides its decoder layers (each with
``__call__(x, rope, step, kv, fmt, page_size) -> (x, kv)`` and ``init_kv``) and its rotary
dimension. The model is a pure function of (params, kv, step) once split with NNX; the
runner jits it with the KV pools donated.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.kv.formats import KVFormat
from jaxserve.models.layers import RMSNorm, param, rope_cos_sin, rope_inv_freq
from jaxserve.models.step import StepInput, last_token_index


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """One parameter of ours built from Hugging Face tensors.

    target: our parameter path ("layers/3/attn/q_b"); sources: HF tensor names;
    build: numpy arrays (in `sources` order) -> our array.
    """

    target: str
    sources: tuple[str, ...]
    build: Callable[..., np.ndarray]


def t(a):  # HF Linear weights are [out, in]; ours are [in, out]
    return a.T


def keep(a):
    return a


class CausalLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, layers: list[nnx.Module], rope_dim: int, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dtype = dtype
        self.rope_dim = rope_dim
        self.embed = param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)
        self.layers = nnx.List(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, rngs)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dtype)
        )

    def __call__(self, step: StepInput, kv: tuple, fmt: KVFormat, page_size: int, all_logits: bool = False):
        """-> (logits f32 [B, T, V] if all_logits else [B, V] at each row's last new token, kv)."""
        x = jnp.take(self.embed[...], step.tokens, axis=0)
        inv_freq, scale = rope_inv_freq(self.cfg.rope, self.rope_dim)
        rope = rope_cos_sin(step.positions, inv_freq, scale)
        new_kv = []
        for layer, layer_kv in zip(self.layers, kv):
            x, layer_kv = layer(x, rope, step, layer_kv, fmt, page_size)
            new_kv.append(layer_kv)
        if not all_logits:
            x = x[jnp.arange(x.shape[0]), last_token_index(step.new_lens)]  # [B, D]
        x = self.norm(x)
        head = self.embed[...].T if self.lm_head is None else self.lm_head[...]
        logits = jnp.dot(x, head, preferred_element_type=jnp.float32)
        return logits, tuple(new_kv)

    def init_kv(self, num_pages: int, page_size: int, fmt: KVFormat) -> tuple:
        """Zeroed KV pools, one dict of arrays per layer."""
        return tuple(layer.init_kv(num_pages, page_size, fmt) for layer in self.layers)

    @staticmethod
    def common_weights(cfg: ModelConfig) -> list[WeightSpec]:
        specs = [
            WeightSpec("embed", ("model.embed_tokens.weight",), keep),
            WeightSpec("norm/scale", ("model.norm.weight",), keep),
        ]
        if not cfg.tie_word_embeddings:
            specs.append(WeightSpec("lm_head", ("lm_head.weight",), t))
        return specs


def layer_block_weights(prefix: str, target: str, names=("gate", "up", "down")) -> list[WeightSpec]:
    """A gated MLP: HF gate_proj/up_proj/down_proj -> ours gate/up/down."""
    return [
        WeightSpec(f"{target}/{n}", (f"{prefix}.{n}_proj.weight",), t) for n in names
    ]
