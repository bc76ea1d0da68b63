"""LlamaForCausalLM (dense): GQA + gated MLP on the same paged machinery. Used for the real
small default model (SmolLM2-135M-Instruct)."""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ConfigError, ModelConfig, parse_common
from jaxserve.models.base import CausalLM, DecoderLayer, WeightSpec, block_weights
from jaxserve.models.gqa import GQAttention, gqa_weights, rotary_dim

ARCH = "LlamaForCausalLM"
MODEL_TYPES = ("llama",)


class Llama(CausalLM):
    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs or nnx.Rngs(0)
        o_bias = cfg.attention_bias  # Llama biases all four projections when attention_bias is set
        layers = [
            DecoderLayer(cfg, i, GQAttention(cfg, dtype, rngs, o_bias=o_bias), dtype, rngs)
            for i in range(cfg.num_hidden_layers)
        ]
        super().__init__(cfg, layers, rotary_dim(cfg), dtype, rngs)


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    if raw.get("mlp_bias"):
        raise ConfigError(f"{ARCH} with mlp_bias=true is not supported")
    return ModelConfig(**parse_common(raw, ARCH))


def weight_map(cfg: ModelConfig) -> list[WeightSpec]:
    specs = CausalLM.common_weights(cfg)
    for i in range(cfg.num_hidden_layers):
        specs += gqa_weights(cfg, i, o_bias=cfg.attention_bias) + block_weights(cfg, i)
    return specs


def skip_tensor(cfg: ModelConfig, name: str) -> bool:
    # Some exports carry the (unused, recomputed) rotary table.
    return name.endswith("rotary_emb.inv_freq")
