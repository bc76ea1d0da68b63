"""DeepseekV3ForCausalLM: the Kimi K2.x architecture (MLA attention + DeepSeek MoE).

MLA caches, per token, the normalised compressed latent [R = kv_lora_rank] and the rotated
shared rope key [Dr = qk_rope_head_dim] in two page pools. Attention runs in the absorbed
form: W_uk (the key half of kv_b_proj) is folded into the query and W_uv (the value half)
into the output, so keys and values are never decompressed.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ConfigError, ModelConfig, parse_common, require
from jaxserve.kv import paged
from jaxserve.kv.formats import KVFormat
from jaxserve.models.attention_backends import XLA
from jaxserve.models.base import CausalLM, DecoderLayer, WeightSpec, keep, block_weights, t
from jaxserve.models.layers import RMSNorm, apply_rope, param
from jaxserve.models.mtp import MTPBlock, mtp_weights
from jaxserve.models.mtp import skip_tensor as mtp_skip_tensor
from jaxserve.quant.linear import by_row_tiles, head_columns, linear


class MLAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        d, h = cfg.hidden_size, cfg.num_attention_heads
        r, dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.cfg = cfg
        if cfg.q_lora_rank:
            self.q_a = param(rngs, (d, cfg.q_lora_rank), ("embed", None), dtype)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, 1e-6, dtype, rngs)
            self.q_b = param(rngs, (cfg.q_lora_rank, h, cfg.qk_head_dim), (None, "heads", None), dtype)
        else:
            self.q_proj = param(rngs, (d, h, cfg.qk_head_dim), ("embed", "heads", None), dtype)
        self.kv_a = param(rngs, (d, r + dr), ("embed", None), dtype)
        self.kv_a_norm = RMSNorm(r, 1e-6, dtype, rngs)
        self.kv_b = param(rngs, (r, h, cfg.qk_nope_head_dim + cfg.v_head_dim), (None, "heads", None), dtype)
        self.o = param(rngs, (h, cfg.v_head_dim, d), ("heads", None, "embed"), dtype)

    def queries(self, x, rope):
        """-> (q_resid [B, T, q_lora_rank] or None, q_nope [B, T, H, nope], rotated q_rope [B, T, H, Dr])."""
        cfg = self.cfg
        cos, sin = rope
        nope = cfg.qk_nope_head_dim
        q_resid = None
        if cfg.q_lora_rank:
            q_resid = self.q_a_norm(linear(x, self.q_a))
            q = linear(q_resid, self.q_b)  # [B, T, H, qk_head_dim]
        else:
            q = linear(x, self.q_proj)
        return q_resid, q[..., :nope], apply_rope(q[..., nope:], cos, sin, cfg.rope_interleave)

    def __call__(self, x, rope, step, kv, fmt: KVFormat, page_size: int, backend=XLA):
        _, q_nope, q_rope = self.queries(x, rope)
        return self.attend(x, q_nope, q_rope, rope, step, kv, fmt, page_size, backend)

    def attend(self, x, q_nope, q_rope, rope, step, kv, fmt: KVFormat, page_size: int, backend=XLA, select=None):
        """Write the step's latent / rope key into their pages and attend over them.

        select: None (every visible token) or bool [B, T, M*S], the context slots each query
        may attend to besides causality (DeepSeek sparse attention's top-k choice).
        """
        cfg = self.cfg
        cos, sin = rope
        nope, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        ckv = linear(x, self.kv_a)  # [B, T, R + Dr]
        lat = self.kv_a_norm(ckv[..., :r])
        k_rope = apply_rope(ckv[..., r:], cos, sin, cfg.rope_interleave)

        # Write this step's tokens into their pages, then attend to the pages (its own tokens too).
        num_pages = kv["latent"].shape[0]
        page, off = paged.token_slots(step.page_table, step.positions, step.valid, page_size, num_pages)
        kv = paged.store(fmt, kv, "latent", lat, page, off)
        kv = paged.store(fmt, kv, "rope", k_rope, page, off)
        q_lat = self._absorb(q_nope, lambda q, w: jnp.einsum("mhn,rhn->mhr", q, w[..., :nope])).astype(x.dtype)
        stored = paged.as_stored(fmt, lat, q_lat.dtype), paged.as_stored(fmt, k_rope, q_lat.dtype)
        if select is None:
            out_lat = backend.mla(q_lat, q_rope, kv, fmt, *stored, step, cfg.softmax_scale, page_size)
        else:
            out_lat = backend.mla_sparse(q_lat, q_rope, kv, fmt, *stored, step, select, cfg.softmax_scale,
                                         page_size)
        out = self._absorb(out_lat, lambda o, w: jnp.einsum("mhr,rhv->mhv", o, w[..., nope:])).astype(x.dtype)
        return linear(out, self.o, contract=2), kv

    def _absorb(self, x, dot):
        """x [B, T, H, X] . kv_b's per-head W_uk or W_uv (``dot(x_rows [M, h, X], w [R, h, nope + v])``)
        -> [B, T, H, Y]; over fixed token tiles in batch-invariant mode, like every matmul."""
        b, t, h, _ = x.shape
        per_head = self.cfg.qk_nope_head_dim + self.cfg.v_head_dim  # kv_b [R, H, nope + v]
        rows = lambda xr: head_columns(self.kv_b, per_head, lambda w, h0, h1: dot(xr[:, h0:h1], w))  # noqa: E731
        y = by_row_tiles(rows, x.reshape(b * t, h, x.shape[-1]))
        return y.reshape(b, t, h, y.shape[-1])

    def init_kv(self, num_pages: int, page_size: int, fmt: KVFormat) -> dict:
        cfg = self.cfg
        pools = paged.new_pool(fmt, (num_pages, page_size, cfg.kv_lora_rank), "latent")
        pools.update(paged.new_pool(fmt, (num_pages, page_size, cfg.qk_rope_head_dim), "rope"))
        return pools


class DeepseekV3(CausalLM):
    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs or nnx.Rngs(0)
        layers = [DecoderLayer(cfg, i, MLAttention(cfg, dtype, rngs), dtype, rngs) for i in range(cfg.num_hidden_layers)]
        mtp = None
        if cfg.mtp_layers:  # the checkpoint's MTP block (speculative decoding's drafts)
            n = cfg.num_hidden_layers
            mtp = MTPBlock(cfg, DecoderLayer(cfg, n, MLAttention(cfg, dtype, rngs), dtype, rngs), dtype, rngs)
        super().__init__(cfg, layers, cfg.qk_rope_head_dim, dtype, rngs, mtp)


# ----------------------------------------------------------------------------- config


ARCH = "DeepseekV3ForCausalLM"
MODEL_TYPES = ("deepseek_v3", "kimi_k2")
BUILDS_MTP = True


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    return parse_mla_moe(raw, ARCH)


def parse_mla_moe(raw: dict[str, Any], arch: str, **extra) -> ModelConfig:
    """The MLA + DeepSeek-MoE fields (DeepSeek-V3, Kimi K2, GLM-5); ``extra`` adds fields."""
    common = parse_common(raw, arch)
    if raw.get("attention_bias"):
        raise ConfigError(f"{arch} with attention_bias=true is not supported")
    scoring = raw.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ConfigError(f"{arch} scoring_func={scoring!r} is not supported (only sigmoid, as DeepSeek-V3/Kimi K2)")
    topk_method = raw.get("topk_method", "noaux_tc")
    if topk_method != "noaux_tc":
        raise ConfigError(f"{arch} topk_method={topk_method!r} is not supported (only noaux_tc)")
    n_group = raw.get("n_group") or 1
    return ModelConfig(
        **common,
        q_lora_rank=raw.get("q_lora_rank"),
        kv_lora_rank=int(require(raw, "kv_lora_rank", arch)),
        qk_rope_head_dim=int(require(raw, "qk_rope_head_dim", arch)),
        qk_nope_head_dim=int(require(raw, "qk_nope_head_dim", arch)),
        v_head_dim=int(require(raw, "v_head_dim", arch)),
        rope_interleave=bool(raw.get("rope_interleave", True)),
        n_routed_experts=int(require(raw, "n_routed_experts", arch)),
        n_shared_experts=int(raw.get("n_shared_experts") or 0),
        num_experts_per_tok=int(require(raw, "num_experts_per_tok", arch)),
        moe_intermediate_size=int(require(raw, "moe_intermediate_size", arch)),
        first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
        n_group=int(n_group),
        topk_group=int(raw.get("topk_group") or n_group),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
        **extra,
    )


# ----------------------------------------------------------------------------- weights


def weight_map(cfg: ModelConfig) -> list[WeightSpec]:
    """Every parameter of ours with the HF tensors it is built from (explicit, no guessing)."""
    specs = CausalLM.common_weights(cfg)
    for i in range(cfg.num_hidden_layers):
        specs += mla_weights(cfg, i) + block_weights(cfg, i)
    if cfg.mtp_layers:
        n = cfg.num_hidden_layers
        specs += mtp_weights(cfg, mla_weights(cfg, n) + block_weights(cfg, n))
    return specs


def mla_weights(cfg: ModelConfig, i: int) -> list[WeightSpec]:
    """Layer i's MLA projections and norms."""
    h = cfg.num_attention_heads
    a, ua = f"model.layers.{i}.self_attn", f"layers/{i}/attn"
    specs = [
        WeightSpec(f"{ua}/kv_a", (f"{a}.kv_a_proj_with_mqa.weight",), t),
        WeightSpec(f"{ua}/kv_a_norm/scale", (f"{a}.kv_a_layernorm.weight",), keep),
        WeightSpec(f"{ua}/kv_b", (f"{a}.kv_b_proj.weight",), lambda w: w.T.reshape(w.shape[1], h, -1)),
        WeightSpec(f"{ua}/o", (f"{a}.o_proj.weight",), lambda w: w.T.reshape(h, -1, w.shape[0])),
    ]
    if cfg.q_lora_rank:
        specs += [
            WeightSpec(f"{ua}/q_a", (f"{a}.q_a_proj.weight",), t),
            WeightSpec(f"{ua}/q_a_norm/scale", (f"{a}.q_a_layernorm.weight",), keep),
            WeightSpec(f"{ua}/q_b", (f"{a}.q_b_proj.weight",), lambda w: w.T.reshape(w.shape[1], h, -1)),
        ]
    else:
        specs.append(WeightSpec(f"{ua}/q_proj", (f"{a}.q_proj.weight",), lambda w: w.T.reshape(w.shape[1], h, -1)))
    return specs


skip_tensor = mtp_skip_tensor  # the MTP layers past what cfg.mtp_layers builds
