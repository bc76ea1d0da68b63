"""Grouped-query attention over paged K/V (GLM-4.5 MoE and Llama).

Pages are laid out [KVH, P, S, D] so tensor parallelism splits whole KV heads. Optional
parts, all switched by the config: q/k/v bias (``attention_bias``; Llama also biases o),
per-head q/k RMSNorm (``use_qk_norm``, GLM), and partial rotary (``partial_rotary_factor``:
non-interleaved half rotation over the first fraction of each head, the rest passes through).
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.kv import paged
from jaxserve.kv.formats import KVFormat
from jaxserve.models.attention_backends import XLA
from jaxserve.models.base import WeightSpec, keep
from jaxserve.models.layers import RMSNorm, apply_rope, param
from jaxserve.quant.linear import linear


def rotary_dim(cfg: ModelConfig) -> int:
    return int(cfg.attn_head_dim * cfg.partial_rotary_factor)


class GQAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, o_bias: bool = False):
        d, h, k, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attn_head_dim
        if h % k:
            raise ValueError(f"num_attention_heads={h} is not a multiple of num_key_value_heads={k}")
        self.cfg = cfg
        self.q = param(rngs, (d, h, hd), ("embed", "heads", None), dtype)
        self.k = param(rngs, (d, k, hd), ("embed", "kv_heads", None), dtype)
        self.v = param(rngs, (d, k, hd), ("embed", "kv_heads", None), dtype)
        self.o = param(rngs, (h, hd, d), ("heads", None, "embed"), dtype)
        if cfg.attention_bias:
            self.q_bias = param(rngs, (h, hd), ("heads", None), dtype, "zeros")
            self.k_bias = param(rngs, (k, hd), ("kv_heads", None), dtype, "zeros")
            self.v_bias = param(rngs, (k, hd), ("kv_heads", None), dtype, "zeros")
        self.o_bias = param(rngs, (d,), (None,), dtype, "zeros") if o_bias else None
        if cfg.use_qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype, rngs)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype, rngs)

    def __call__(self, x, rope, step, kv, fmt: KVFormat, page_size: int, backend=XLA):
        cfg = self.cfg
        q, k, v = linear(x, self.q), linear(x, self.k), linear(x, self.v)  # [B, T, heads, hd]
        if cfg.attention_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if cfg.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        rot = rotary_dim(cfg)
        cos, sin = rope
        q = jnp.concatenate([apply_rope(q[..., :rot], cos, sin, False), q[..., rot:]], axis=-1)
        k = jnp.concatenate([apply_rope(k[..., :rot], cos, sin, False), k[..., rot:]], axis=-1)

        num_pages = kv["k"].shape[1]
        page, off = paged.token_slots(step.page_table, step.positions, step.valid, page_size, num_pages)
        kv = paged.store(fmt, kv, "k", k, page, off, headed=True)
        kv = paged.store(fmt, kv, "v", v, page, off, headed=True)
        stored = paged.as_stored(fmt, k, q.dtype), paged.as_stored(fmt, v, q.dtype)
        out = backend.gqa(q, kv, fmt, *stored, step, cfg.softmax_scale, page_size)
        y = linear(out, self.o, contract=2)
        return (y + self.o_bias[...] if self.o_bias is not None else y), kv

    def init_kv(self, num_pages: int, page_size: int, fmt: KVFormat) -> dict:
        shape = (self.cfg.num_key_value_heads, num_pages, page_size, self.cfg.attn_head_dim)
        return {**paged.new_pool(fmt, shape, "k"), **paged.new_pool(fmt, shape, "v")}


def gqa_weights(cfg: ModelConfig, i: int, o_bias: bool = False) -> list[WeightSpec]:
    h, k = cfg.num_attention_heads, cfg.num_key_value_heads
    a, ua = f"model.layers.{i}.self_attn", f"layers/{i}/attn"

    def heads(n):
        return lambda w: w.T.reshape(w.shape[1], n, -1)  # [out, in] -> [in, heads, hd]

    specs = [
        WeightSpec(f"{ua}/q", (f"{a}.q_proj.weight",), heads(h)),
        WeightSpec(f"{ua}/k", (f"{a}.k_proj.weight",), heads(k)),
        WeightSpec(f"{ua}/v", (f"{a}.v_proj.weight",), heads(k)),
        WeightSpec(f"{ua}/o", (f"{a}.o_proj.weight",), lambda w: w.T.reshape(h, -1, w.shape[0])),
    ]
    if cfg.attention_bias:
        specs += [
            WeightSpec(f"{ua}/q_bias", (f"{a}.q_proj.bias",), lambda b: b.reshape(h, -1)),
            WeightSpec(f"{ua}/k_bias", (f"{a}.k_proj.bias",), lambda b: b.reshape(k, -1)),
            WeightSpec(f"{ua}/v_bias", (f"{a}.v_proj.bias",), lambda b: b.reshape(k, -1)),
        ]
    if o_bias:
        specs.append(WeightSpec(f"{ua}/o_bias", (f"{a}.o_proj.bias",), keep))
    if cfg.use_qk_norm:
        specs += [
            WeightSpec(f"{ua}/q_norm/scale", (f"{a}.q_norm.weight",), keep),
            WeightSpec(f"{ua}/k_norm/scale", (f"{a}.k_norm.weight",), keep),
        ]
    return specs
