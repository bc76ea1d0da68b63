"""Model configuration read from a Hugging Face ``config.json``.

Both forms seen in the wild are accepted:
- the form real checkpoints ship (``rope_theta`` + ``rope_scaling: {type: yarn, ...}``,
  ``torch_dtype``, ``"model_type": "kimi_k2"``);
- the form new ``transformers`` writes (``rope_parameters: {rope_type, rope_theta, ...}``,
  ``dtype``).

Unknown architectures and missing required fields are errors that name them: a model
must never be built from guessed shapes. The architecture registry
(``jaxserve.models.config_from_dict``) turns a config dict into a ``ModelConfig``; this module
holds the shared parsing and imports no model code.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any


class ConfigError(ValueError):
    """The config.json cannot describe a model jaxserve can build."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, normalised from either config form."""

    theta: float
    kind: str = "default"  # "default" | "yarn" | "llama3"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    # llama3 scaling
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    def __post_init__(self):
        if self.kind not in ("default", "yarn", "llama3"):
            raise ConfigError(f"unsupported rope scaling type {self.kind!r} (supported: default, yarn, llama3)")
        if self.theta <= 0:
            raise ConfigError(f"rope_theta must be positive, got {self.theta}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and hyper-parameters of one model. Fields unused by an architecture are None."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    head_dim: int | None = None
    attention_bias: bool = False
    # MLA (DeepSeek-V3 / Kimi K2)
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    rope_interleave: bool = True
    # MoE
    n_routed_experts: int | None = None
    n_shared_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    first_k_dense_replace: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # GQA extras (GLM-4.5)
    use_qk_norm: bool = False
    partial_rotary_factor: float = 1.0
    num_nextn_predict_layers: int = 0
    # DeepSeek sparse attention (GLM-5): the lightning indexer, and per layer "full" (runs its
    # own indexer) or "shared" (reuses the previous full layer's top-k selection)
    index_topk: int | None = None
    index_head_dim: int | None = None
    index_n_heads: int | None = None
    indexer_types: tuple[str, ...] = ()
    # Not from config.json: the embedding rows / LM-head columns the model is built with, the
    # vocabulary rounded up to split evenly over devices (the loader sets it under a mesh,
    # ``jaxserve.sharding.padded_vocab_size``). None: vocab_size. Padded ids are never produced:
    # the model cuts their logits off.
    padded_vocab_size: int | None = None
    # Not from config.json: the checkpoint's multi-token-prediction layers the model builds (0 or 1;
    # the loader sets it for ``--speculative mtp``, ``jaxserve.loader.load_model(mtp=True)``).
    mtp_layers: int = 0

    def __post_init__(self):
        if self.padded_vocab_size is not None and self.padded_vocab_size < self.vocab_size:
            raise ConfigError(f"padded_vocab_size {self.padded_vocab_size} < vocab_size {self.vocab_size}")

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding table (= columns of the LM head), padding included."""
        return self.padded_vocab_size or self.vocab_size

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts is not None

    @property
    def qk_head_dim(self) -> int:
        assert self.is_mla
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def attn_head_dim(self) -> int:
        """Head dim of q/k for GQA models."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def softmax_scale(self) -> float:
        """Attention logit scale; DeepSeek yarn multiplies in mscale(factor, mscale_all_dim)**2."""
        d = self.qk_head_dim if self.is_mla else self.attn_head_dim
        scale = d**-0.5
        r = self.rope
        if self.is_mla and r.kind == "yarn" and r.mscale_all_dim:
            m = yarn_mscale(r.factor, r.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.first_k_dense_replace


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def require(raw: dict[str, Any], key: str, arch: str):
    if key not in raw or raw[key] is None:
        raise ConfigError(f"config.json for {arch} is missing required field {key!r}")
    return raw[key]


def parse_rope(raw: dict[str, Any], arch: str) -> RopeConfig:
    """Normalise ``rope_parameters`` (new) or ``rope_theta`` + ``rope_scaling`` (legacy)."""
    params = dict(raw.get("rope_parameters") or {})
    legacy = raw.get("rope_scaling") or {}
    if params and not isinstance(params, dict):
        raise ConfigError(f"rope_parameters must be an object, got {type(params).__name__}")
    if "full_attention" in params and isinstance(params["full_attention"], dict):
        params = dict(params["full_attention"])  # per-layer-type form: one global entry
    merged = {**legacy, **params}
    theta = merged.get("rope_theta", raw.get("rope_theta"))
    if theta is None:
        raise ConfigError(f"config.json for {arch} is missing required field 'rope_theta' (or rope_parameters.rope_theta)")
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if kind == "default":
        return RopeConfig(theta=float(theta))
    if kind == "yarn":
        factor = merged.get("factor")
        omax = merged.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
        if omax is None:
            omax = raw.get("max_position_embeddings")
        if factor is None:
            if omax is None:
                raise ConfigError(f"yarn rope scaling for {arch} needs 'factor' or 'original_max_position_embeddings'")
            factor = raw["max_position_embeddings"] / omax
        return RopeConfig(
            theta=float(theta),
            kind="yarn",
            factor=float(factor),
            original_max_position_embeddings=int(omax),
            beta_fast=float(merged.get("beta_fast") or 32),
            beta_slow=float(merged.get("beta_slow") or 1),
            mscale=merged.get("mscale"),
            mscale_all_dim=merged.get("mscale_all_dim"),
            attention_factor=merged.get("attention_factor"),
            truncate=bool(merged.get("truncate", True)),
        )
    if kind == "llama3":
        return RopeConfig(
            theta=float(theta),
            kind="llama3",
            factor=float(require(merged, "factor", arch)),
            original_max_position_embeddings=int(require(merged, "original_max_position_embeddings", arch)),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        )
    raise ConfigError(f"unsupported rope scaling type {kind!r} for {arch} (supported: default, yarn, llama3)")


def parse_common(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """Fields every architecture shares."""
    eos = raw.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    heads = int(require(raw, "num_attention_heads", arch))
    return dict(
        architecture=arch,
        model_type=str(raw.get("model_type", "")),
        vocab_size=int(require(raw, "vocab_size", arch)),
        hidden_size=int(require(raw, "hidden_size", arch)),
        num_hidden_layers=int(require(raw, "num_hidden_layers", arch)),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        intermediate_size=int(require(raw, "intermediate_size", arch)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(require(raw, "max_position_embeddings", arch)),
        rope=parse_rope(raw, arch),
        hidden_act=str(raw.get("hidden_act", "silu")),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=eos_ids,
        head_dim=raw.get("head_dim"),
        attention_bias=bool(raw.get("attention_bias", False)),
    )
