"""GlmMoeDsaForCausalLM (GLM-5): DeepSeek-V3's MLA (q_lora / kv_lora, absorbed form over the
paged latent + rope pools) and sigmoid-routed MoE, with DeepSeek sparse attention: each layer
attends only to the ``index_topk`` cached tokens a lightning indexer (``dsa.Indexer``) picks per
query. A "full" layer runs its own indexer (and caches its index keys in a third pool,
``index_k``); a "shared" layer reuses the selection of the last full layer before it.

When the page table holds no more than ``index_topk`` slots, every visible token is selected
whatever the scores, so the layers attend densely (the indexer still caches its keys); past
that, each backend attends over the chosen positions (``mla_sparse``: the XLA path's gather or
mask, the Pallas path's sparse kernel).
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ConfigError, ModelConfig, require
from jaxserve.kv.formats import KVFormat
from jaxserve.models.attention_backends import XLA
from jaxserve.models.base import CausalLM, DecoderLayer, WeightSpec, block_weights, keep, t
from jaxserve.models.deepseek_v3 import MLAttention, mla_weights, parse_mla_moe
from jaxserve.models.mtp import MTPBlock, mtp_weights
from jaxserve.models.mtp import skip_tensor as mtp_skip_tensor
from jaxserve.models.dsa import Indexer

ARCH = "GlmMoeDsaForCausalLM"
MODEL_TYPES = ("glm_moe_dsa",)
BUILDS_MTP = True


class DsaAttention(MLAttention):
    def __init__(self, cfg: ModelConfig, index: int, dtype, rngs: nnx.Rngs):
        super().__init__(cfg, dtype, rngs)
        # The MTP layer (index num_hidden_layers) runs its own: no full layer precedes it in its stack.
        self.full = index >= len(cfg.indexer_types) or cfg.indexer_types[index] == "full"
        self.indexer = Indexer(cfg, dtype, rngs) if self.full else None

    def __call__(self, x, rope, step, kv, fmt: KVFormat, page_size: int, backend=XLA, select=None):
        """-> (output, kv, select): ``select`` in is the last full layer's choice (used by a
        shared layer), out is this layer's (None: dense, every visible token)."""
        q_resid, q_nope, q_rope = self.queries(x, rope)
        if self.full:
            kv, select = self.indexer(x, q_resid, rope, step, kv, fmt, page_size)
        if step.page_table.shape[1] * page_size <= self.cfg.index_topk:
            select = None  # no query can see more than index_topk tokens: dense
        out, kv = self.attend(x, q_nope, q_rope, rope, step, kv, fmt, page_size, backend, select)
        return out, kv, select

    def init_kv(self, num_pages: int, page_size: int, fmt: KVFormat) -> dict:
        pools = super().init_kv(num_pages, page_size, fmt)
        if self.full:
            pools.update(self.indexer.init_kv(num_pages, page_size, fmt))
        return pools


class DsaDecoderLayer(DecoderLayer):
    def __call__(self, x, rope, step, kv, fmt, page_size, backend=XLA, select=None):
        a, kv, select = self.attn(self.input_norm(x), rope, step, kv, fmt, page_size, backend, select)
        x = x + a
        return x + self.mlp(self.post_attn_norm(x)), kv, select


class GlmMoeDsa(CausalLM):
    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs or nnx.Rngs(0)
        layers = [
            DsaDecoderLayer(cfg, i, DsaAttention(cfg, i, dtype, rngs), dtype, rngs)
            for i in range(cfg.num_hidden_layers)
        ]
        mtp = None
        if cfg.mtp_layers:  # the checkpoint's MTP block (speculative decoding's drafts)
            n = cfg.num_hidden_layers
            mtp = MTPBlock(cfg, DsaDecoderLayer(cfg, n, DsaAttention(cfg, n, dtype, rngs), dtype, rngs), dtype, rngs)
        super().__init__(cfg, layers, cfg.qk_rope_head_dim, dtype, rngs, mtp)

    def run_layers(self, x, rope, step, kv, fmt, page_size, backend):
        """The layers in order, each shared layer given the last full layer's selection."""
        new_kv, select = [], None
        for layer, layer_kv in zip(self.layers, kv):
            x, layer_kv, select = layer(x, rope, step, layer_kv, fmt, page_size, backend, select)
            new_kv.append(layer_kv)
        return x, new_kv


# ----------------------------------------------------------------------------- config


def indexer_types(raw: dict[str, Any], layers: int) -> tuple[str, ...]:
    """Per layer "full" or "shared", as transformers derives it: ``indexer_types``, else
    ``index_topk_pattern`` ("FSS..."), else every layer i with max(i - offset + 1, 0) % freq == 0
    full (``index_topk_freq``, default 1; ``index_skip_topk_offset``, default 2)."""
    types = raw.get("indexer_types")
    if types is None and raw.get("index_topk_pattern") is not None:
        pattern = raw["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    if types is None:
        freq, off = max(int(raw.get("index_topk_freq") or 1), 1), int(raw.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - off + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    types = tuple(types)
    if len(types) != layers or set(types) - {"full", "shared"}:
        raise ConfigError(f"{ARCH} indexer_types must be {layers} of 'full' / 'shared', got {list(types)}")
    if types[0] != "full":
        raise ConfigError(f"{ARCH} layer 0 must run its own indexer (indexer_types[0] == 'full')")
    return types


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    layers = int(require(raw, "num_hidden_layers", ARCH))
    cfg = parse_mla_moe(
        raw, ARCH,
        index_topk=int(require(raw, "index_topk", ARCH)),
        index_head_dim=int(require(raw, "index_head_dim", ARCH)),
        index_n_heads=int(require(raw, "index_n_heads", ARCH)),
        indexer_types=indexer_types(raw, layers),
    )
    if not cfg.q_lora_rank:
        raise ConfigError(f"{ARCH} needs q_lora_rank (the indexer's queries come from the query residual)")
    if not cfg.rope_interleave:
        raise ConfigError(f"{ARCH} rotates interleaved pairs; rope_interleave=false is not supported")
    if cfg.index_head_dim < cfg.qk_rope_head_dim or cfg.index_topk < 1:
        raise ConfigError(f"{ARCH} needs index_head_dim >= qk_rope_head_dim and index_topk >= 1")
    mlp_types = raw.get("mlp_layer_types")
    expected = ["dense"] * min(cfg.first_k_dense_replace, layers) + ["sparse"] * max(layers - cfg.first_k_dense_replace, 0)
    if mlp_types is not None and list(mlp_types) != expected:
        raise ConfigError(f"{ARCH} mlp_layer_types must be first_k_dense_replace dense layers then sparse ones, "
                          f"got {list(mlp_types)}")
    return cfg


# ----------------------------------------------------------------------------- weights


def weight_map(cfg: ModelConfig) -> list[WeightSpec]:
    """Every parameter of ours with the HF tensors it is built from (explicit, no guessing)."""
    specs = CausalLM.common_weights(cfg)
    for i in range(cfg.num_hidden_layers):
        specs += mla_weights(cfg, i) + block_weights(cfg, i)
        if cfg.indexer_types[i] == "full":
            specs += indexer_weights(cfg, i)
    if cfg.mtp_layers:  # the MTP layer: a full DSA layer (its own indexer)
        n = cfg.num_hidden_layers
        specs += mtp_weights(cfg, mla_weights(cfg, n) + block_weights(cfg, n) + indexer_weights(cfg, n))
    return specs


def indexer_weights(cfg: ModelConfig, i: int) -> list[WeightSpec]:
    """Layer i's lightning indexer."""
    ih = cfg.index_n_heads
    a, ua = f"model.layers.{i}.self_attn.indexer", f"layers/{i}/attn/indexer"
    return [
        WeightSpec(f"{ua}/wq_b", (f"{a}.wq_b.weight",), lambda w: w.T.reshape(w.shape[1], ih, -1)),
        WeightSpec(f"{ua}/wk", (f"{a}.wk.weight",), t),
        WeightSpec(f"{ua}/k_norm/scale", (f"{a}.k_norm.weight",), keep),
        WeightSpec(f"{ua}/k_norm/bias", (f"{a}.k_norm.bias",), keep),
        WeightSpec(f"{ua}/weights_proj", (f"{a}.weights_proj.weight",), lambda w: w.T.astype(np.float32)),
    ]


skip_tensor = mtp_skip_tensor  # the MTP layers past what cfg.mtp_layers builds
