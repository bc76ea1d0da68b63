"""Glm4MoeForCausalLM (GLM-4.5 / 4.6 / 4.7): GQA with qkv bias, per-head q/k norm and
partial rotary, plus the DeepSeek-style sigmoid-routed MoE. The checkpoint's extra MTP
layer (model.layers.<num_hidden_layers>.*) is skipped."""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig, parse_common, require
from jaxserve.models.base import CausalLM, DecoderLayer, WeightSpec, block_weights, skip_mtp_layers
from jaxserve.models.gqa import GQAttention, gqa_weights, rotary_dim

ARCH = "Glm4MoeForCausalLM"
MODEL_TYPES = ("glm4_moe",)


class Glm4Moe(CausalLM):
    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs or nnx.Rngs(0)
        layers = [DecoderLayer(cfg, i, GQAttention(cfg, dtype, rngs), dtype, rngs) for i in range(cfg.num_hidden_layers)]
        super().__init__(cfg, layers, rotary_dim(cfg), dtype, rngs)


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    common = parse_common(raw, ARCH)
    rope_params = raw.get("rope_parameters") or {}
    partial = rope_params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.5))
    n_group = raw.get("n_group") or 1
    return ModelConfig(
        **common,
        n_routed_experts=int(require(raw, "n_routed_experts", ARCH)),
        n_shared_experts=int(raw.get("n_shared_experts") or 0),
        num_experts_per_tok=int(require(raw, "num_experts_per_tok", ARCH)),
        moe_intermediate_size=int(require(raw, "moe_intermediate_size", ARCH)),
        first_k_dense_replace=int(raw.get("first_k_dense_replace", 1)),
        n_group=int(n_group),
        topk_group=int(raw.get("topk_group") or n_group),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        use_qk_norm=bool(raw.get("use_qk_norm", False)),
        partial_rotary_factor=float(partial),
        num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
    )


def weight_map(cfg: ModelConfig) -> list[WeightSpec]:
    specs = CausalLM.common_weights(cfg)
    for i in range(cfg.num_hidden_layers):
        specs += gqa_weights(cfg, i) + block_weights(cfg, i)
    return specs


skip_tensor = skip_mtp_layers
