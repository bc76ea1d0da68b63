"""What every causal LM here shares: embedding, the layer loop over paged KV, logits.

An architecture subclasses ``CausalLM`` and provides its decoder layers (each with
``__call__(x, rope, step, kv, fmt, page_size) -> (x, kv)`` and ``init_kv``) and its rotary
dimension. The model is a pure function of (params, kv, step) once split with NNX; the
runner jits it with the KV pools donated.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.kv.formats import KVFormat
from jaxserve.models.attention_backends import XLA
from jaxserve.models.layers import DenseMLP, MoE, RMSNorm, param, rope_cos_sin, rope_inv_freq
from jaxserve.models.step import StepInput, last_token_index
from jaxserve.quant.linear import embedding, linear, tied_head


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


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)); MoE from first_k_dense_replace on."""

    def __init__(self, cfg: ModelConfig, index: int, attn: nnx.Module, dtype, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, rngs)
        self.attn = attn
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, rngs)
        if cfg.is_moe_layer(index):
            self.mlp = MoE(cfg, dtype, rngs)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, dtype, rngs)

    def __call__(self, x, rope, step, kv, fmt, page_size, backend=XLA):
        a, kv = self.attn(self.input_norm(x), rope, step, kv, fmt, page_size, backend)
        x = x + a
        return x + self.mlp(self.post_attn_norm(x)), kv

    def init_kv(self, num_pages, page_size, fmt):
        return self.attn.init_kv(num_pages, page_size, fmt)


class CausalLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, layers: list[nnx.Module], rope_dim: int, dtype, rngs: nnx.Rngs,
                 mtp: nnx.Module | None = None):
        """mtp: the checkpoint's multi-token-prediction block (``models.mtp.MTPBlock``), built
        when ``cfg.mtp_layers``: its two KV slots follow the layers' (``init_kv``)."""
        self.cfg = cfg
        self.dtype = dtype
        self.rope_dim = rope_dim
        # cfg.vocab_rows: the vocabulary padded to split evenly over devices (cut off in __call__)
        self.embed = param(rngs, (cfg.vocab_rows, cfg.hidden_size), ("vocab", "embed"), dtype)
        self.layers = nnx.List(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, rngs)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else param(rngs, (cfg.hidden_size, cfg.vocab_rows), ("embed", "vocab"), dtype)
        )
        self.mtp = mtp

    def __call__(
        self, step: StepInput, kv: tuple, fmt: KVFormat, page_size: int, all_logits: bool = False, backend=XLA
    ):
        """-> (logits f32 [B, T, V] if all_logits else [B, V] at each row's last new token, kv).

        backend: the attention backend (``attention_backends.get_backend``; default pure jnp).
        """
        x = self.embed_ids(step.tokens)
        x, new_kv = self.run_layers(x, self.rope_at(step.positions), step, kv, fmt, page_size, backend)
        if self.mtp is not None:  # the block's KV one position behind, from the final hidden states
            n = len(self.layers)
            new_kv += self.mtp.behind(self.norm(x), step, kv[n : n + 2], self.embed_ids, self.rope_at, fmt, page_size,
                                      backend)
        if not all_logits:
            x = x[jnp.arange(x.shape[0]), last_token_index(step.new_lens)]  # [B, D]
        x = self.norm(x)
        if self.lm_head is None:  # tied: the embedding table [V, D] read as the head
            logits = tied_head(x, self.embed)
        else:
            logits = linear(x, self.lm_head, out_dtype=jnp.float32)
        if self.cfg.vocab_rows != self.cfg.vocab_size:  # padded ids: never sampled, never in log-probs
            logits = logits[..., : self.cfg.vocab_size]
        return logits, tuple(new_kv)

    def draft(self, step: StepInput, kv: tuple, fmt: KVFormat, page_size: int, k: int, backend=XLA):
        """The MTP block's k draft tokens per row (``MTPBlock.draft``) -> (int32 [B, k], kv)."""
        n = len(self.layers)
        drafts, mtp_kv = self.mtp.draft(step, kv[n : n + 2], self.embed_ids, self.rope_at, fmt, page_size, backend, k)
        return drafts, tuple(kv[:n]) + tuple(mtp_kv)

    def embed_ids(self, tokens):
        """int32 [...] -> the embedding rows [..., D] in the model's dtype."""
        return embedding(tokens, self.embed).astype(self.dtype)

    def rope_at(self, positions):
        """int32 [B, T] -> the rotary (cos, sin) at those positions."""
        inv_freq, scale = rope_inv_freq(self.cfg.rope, self.rope_dim)
        return rope_cos_sin(positions, inv_freq, scale)

    def run_layers(self, x, rope, step: StepInput, kv: tuple, fmt: KVFormat, page_size: int, backend):
        """The decoder layers in order -> (x, [each layer's updated KV pools])."""
        new_kv = []
        for layer, layer_kv in zip(self.layers, kv):
            x, layer_kv = layer(x, rope, step, layer_kv, fmt, page_size, backend)
            new_kv.append(layer_kv)
        return x, new_kv

    def init_kv(self, num_pages: int, page_size: int, fmt: KVFormat) -> tuple:
        """Zeroed KV pools, one dict of arrays per layer (then the MTP block's two)."""
        pools = tuple(layer.init_kv(num_pages, page_size, fmt) for layer in self.layers)
        return pools + (self.mtp.init_kv(num_pages, page_size, fmt) if self.mtp is not None else ())

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


def moe_weights(cfg: ModelConfig, hf: str, us: str) -> list[WeightSpec]:
    """Router + per-expert tensors stacked into [E, in, out] + shared experts."""
    e = cfg.n_routed_experts

    def stack(*ws):
        return np.stack([w.T for w in ws])

    specs = [
        WeightSpec(f"{us}/router", (f"{hf}.gate.weight",), lambda w: w.T.astype(np.float32)),
        WeightSpec(f"{us}/router_bias", (f"{hf}.gate.e_score_correction_bias",), lambda b: b.astype(np.float32)),
    ]
    for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
        specs.append(WeightSpec(f"{us}/{ours}", tuple(f"{hf}.experts.{j}.{theirs}.weight" for j in range(e)), stack))
    if cfg.n_shared_experts:
        specs += layer_block_weights(f"{hf}.shared_experts", f"{us}/shared")
    return specs


def skip_mtp_layers(cfg: ModelConfig, name: str) -> bool:
    """Tensors present in real checkpoints that this model deliberately does not use."""
    # Multi-token-prediction layers come after the last decoder layer (model.layers.61.* in Kimi K2);
    # a family that builds the MTP block reads them with ``models.mtp.skip_tensor``.
    if name.startswith("model.layers."):
        idx = int(name.split(".")[2])
        return idx >= cfg.num_hidden_layers
    return False


def block_weights(cfg: ModelConfig, i: int) -> list[WeightSpec]:
    """The parts of decoder layer i shared by every family: the two norms and the MLP or MoE."""
    hf, us = f"model.layers.{i}", f"layers/{i}"
    specs = [
        WeightSpec(f"{us}/input_norm/scale", (f"{hf}.input_layernorm.weight",), keep),
        WeightSpec(f"{us}/post_attn_norm/scale", (f"{hf}.post_attention_layernorm.weight",), keep),
    ]
    if cfg.is_moe_layer(i):
        return specs + moe_weights(cfg, f"{hf}.mlp", f"{us}/mlp")
    return specs + layer_block_weights(f"{hf}.mlp", f"{us}/mlp")
