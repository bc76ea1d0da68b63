"""What a model is made of, counted from its Hugging Face config dict: every weight tensor
(shape, copies, group, how it shards) and the per-token KV-cache layout.

Counts match the parameters transformers builds for each architecture exactly (see
tests/test_planner.py), plus the router's e_score_correction_bias buffer, which checkpoints
ship. An architecture is one entry in ``ARCHITECTURES``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

GROUPS = ("experts", "attention", "mlp", "embed", "norms")
GROUP_LABELS = {"experts": "routed experts", "attention": "attention", "mlp": "dense+shared MLP",
                "embed": "embeddings+head", "norms": "norms+router"}


class UnsupportedArchitecture(ValueError):
    """The config names an architecture the planner cannot count."""


@dataclasses.dataclass(frozen=True)
class Tensor:
    """``count`` copies of a [rows, cols] tensor (vectors have cols=1)."""

    name: str
    rows: int
    cols: int
    count: int
    group: str
    shard: str  # "ep" | "tp" | "kv" | "rep"
    keep: int = 0  # bytes/element when never quantized (norms, router, biases); 0 = use group format

    @property
    def params(self) -> int:
        return self.rows * self.cols * self.count

    def nbytes(self, formats: dict[str, Any]) -> int:
        """Stored bytes; ``formats`` maps group -> a format with ``nbytes(rows, cols)``."""
        if self.keep:
            return self.params * self.keep
        return formats[self.group].nbytes(self.rows, self.cols) * self.count


MODEL_TYPES = {"deepseek_v3": "DeepseekV3ForCausalLM", "kimi_k2": "DeepseekV3ForCausalLM",
               "glm4_moe": "Glm4MoeForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}


def _req(c: dict, key: str) -> Any:
    if c.get(key) is None:
        raise ValueError(f"config.json is missing required field {key!r}")
    return c[key]


def resolve_architecture(config: dict) -> tuple[str, dict]:
    """-> (architecture, text config). A multimodal wrapper is read through its text_config."""
    archs = config.get("architectures") or []
    name = archs[0] if archs else None
    if name not in ARCHITECTURES:
        name = MODEL_TYPES.get(config.get("model_type"), name)
    if name in ARCHITECTURES:
        return name, config
    if isinstance(config.get("text_config"), dict):  # its own tie_word_embeddings ties its LM head
        tie = {k: config[k] for k in ("tie_word_embeddings",) if k in config}
        return resolve_architecture({**config["text_config"], **tie})
    raise UnsupportedArchitecture(
        f"unsupported architecture {name!r} (model_type {config.get('model_type')!r}); "
        f"supported: {', '.join(ARCHITECTURES)}")


def _layer_counts(c: dict, mtp: int) -> tuple[int, int]:
    """-> (dense-MLP layers, MoE layers), MTP layers counted as MoE layers."""
    n = _req(c, "num_hidden_layers")
    types = c.get("mlp_layer_types")
    if types:
        moe = sum(t == "sparse" for t in types)
    else:
        k, freq = c.get("first_k_dense_replace", 0), c.get("moe_layer_freq", 1) or 1
        moe = sum(i >= k and i % freq == 0 for i in range(n))
    return n - moe, moe + mtp


def _indexer_layers(c: dict, mtp: int) -> int:
    """DSA layers that run (and hold weights for) their own indexer, as transformers decides."""
    types = c.get("indexer_types")
    pattern = c.get("index_topk_pattern")
    if not types and pattern is not None:
        types = [{"F": "full", "S": "shared"}[x] for x in pattern] if isinstance(pattern, str) else pattern
    if not types:
        freq, off = max(c.get("index_topk_freq", 1), 1), c.get("index_skip_topk_offset", 2)
        types = ["full" if max(i - off + 1, 0) % freq == 0 else "shared" for i in range(c["num_hidden_layers"])]
    return sum(t == "full" for t in types) + mtp


def _common(c: dict, n_dense: int, n_moe: int, mtp: int) -> list[Tensor]:
    h, v = _req(c, "hidden_size"), _req(c, "vocab_size")
    n_layers = c["num_hidden_layers"] + mtp
    out = [Tensor("embed_tokens", v, h, 1, "embed", "tp"),
           Tensor("norm", h, 1, 1, "norms", "rep", keep=2),
           Tensor("input+post_attention_layernorm", h, 1, 2 * n_layers, "norms", "rep", keep=2)]
    if not c.get("tie_word_embeddings", False):
        out.append(Tensor("lm_head", v, h, 1, "embed", "tp"))
    if n_dense:
        inter = _req(c, "intermediate_size")
        out += [Tensor("mlp.gate_proj+up_proj", inter, h, 2 * n_dense, "mlp", "tp"),
                Tensor("mlp.down_proj", h, inter, n_dense, "mlp", "tp")]
    if n_moe:
        e, mi = _req(c, "n_routed_experts"), _req(c, "moe_intermediate_size")
        si = mi * c.get("n_shared_experts", 0)
        out += [Tensor("experts.gate_proj+up_proj", mi, h, 2 * e * n_moe, "experts", "ep"),
                Tensor("experts.down_proj", h, mi, e * n_moe, "experts", "ep"),
                Tensor("gate.weight", e, h, n_moe, "norms", "rep", keep=4),
                Tensor("gate.e_score_correction_bias", e, 1, n_moe, "norms", "rep", keep=4)]
        if si:
            out += [Tensor("shared_experts.gate_proj+up_proj", si, h, 2 * n_moe, "mlp", "tp"),
                    Tensor("shared_experts.down_proj", h, si, n_moe, "mlp", "tp")]
    if mtp:  # DeepSeek/GLM MTP extras; embeddings and head assumed shared with the main model
        out += [Tensor("mtp.eh_proj", h, 2 * h, mtp, "mlp", "rep"),
                Tensor("mtp.enorm+hnorm+shared_head.norm", h, 1, 3 * mtp, "norms", "rep", keep=2)]
    return out


def _mla_tensors(c: dict, mtp: int, dsa: bool) -> list[Tensor]:
    h, nh = c["hidden_size"], _req(c, "num_attention_heads")
    kvr, rope = _req(c, "kv_lora_rank"), _req(c, "qk_rope_head_dim")
    nope, vd, qr = _req(c, "qk_nope_head_dim"), _req(c, "v_head_dim"), c.get("q_lora_rank")
    n = c["num_hidden_layers"] + mtp
    A = "attention"
    out = [Tensor("self_attn.kv_a_proj_with_mqa", kvr + rope, h, n, A, "rep"),
           Tensor("self_attn.kv_a_layernorm", kvr, 1, n, "norms", "rep", keep=2),
           Tensor("self_attn.kv_b_proj", nh * (nope + vd), kvr, n, A, "tp"),
           Tensor("self_attn.o_proj", h, nh * vd, n, A, "tp")]
    if qr:
        out += [Tensor("self_attn.q_a_proj", qr, h, n, A, "rep"),
                Tensor("self_attn.q_a_layernorm", qr, 1, n, "norms", "rep", keep=2),
                Tensor("self_attn.q_b_proj", nh * (nope + rope), qr, n, A, "tp")]
    else:
        out.append(Tensor("self_attn.q_proj", nh * (nope + rope), h, n, A, "tp"))
    if c.get("attention_bias"):
        out += [Tensor("self_attn.{q_a,kv_a,o}.bias", (qr or 0) + kvr + rope + h, 1, n, A, "rep", keep=2)]
    if dsa:
        ih, idim, ni = _req(c, "index_n_heads"), _req(c, "index_head_dim"), _indexer_layers(c, mtp)
        out += [Tensor("indexer.wq_b", ih * idim, _req(c, "q_lora_rank"), ni, A, "rep"),
                Tensor("indexer.wk", idim, h, ni, A, "rep"),
                Tensor("indexer.weights_proj", ih, h, ni, A, "rep", keep=2),
                Tensor("indexer.k_norm(weight+bias)", 2 * idim, 1, ni, "norms", "rep", keep=2)]
    return out + _common(c, *_layer_counts(c, mtp), mtp)


def _gqa_tensors(c: dict, mtp: int) -> list[Tensor]:
    h, nh, kvh = c["hidden_size"], _req(c, "num_attention_heads"), _req(c, "num_key_value_heads")
    hd = c.get("head_dim") or h // nh
    n = c["num_hidden_layers"] + mtp
    A = "attention"
    out = [Tensor("self_attn.q_proj", nh * hd, h, n, A, "tp"),
           Tensor("self_attn.k_proj+v_proj", kvh * hd, h, 2 * n, A, "kv"),
           Tensor("self_attn.o_proj", h, nh * hd, n, A, "tp")]
    if c.get("attention_bias"):
        out += [Tensor("self_attn.q_proj.bias", nh * hd, 1, n, A, "tp", keep=2),
                Tensor("self_attn.k_proj+v_proj.bias", kvh * hd, 1, 2 * n, A, "kv", keep=2)]
    if c.get("use_qk_norm"):
        out.append(Tensor("self_attn.q_norm+k_norm", hd, 1, 2 * n, "norms", "rep", keep=2))
    return out + _common(c, *_layer_counts(c, mtp), mtp)


ARCHITECTURES = {
    "DeepseekV3ForCausalLM": lambda c, mtp: _mla_tensors(c, mtp, dsa=False),
    "GlmMoeDsaForCausalLM": lambda c, mtp: _mla_tensors(c, mtp, dsa=True),
    "Glm4MoeForCausalLM": _gqa_tensors,
}


def model_tensors(config: dict, include_mtp: bool = False) -> list[Tensor]:
    arch, c = resolve_architecture(config)
    mtp = int(c.get("num_nextn_predict_layers") or 0) if include_mtp else 0
    return ARCHITECTURES[arch](c, mtp)


def count_params(config: dict, include_mtp: bool = False) -> dict[str, int]:
    """Parameters by group (GROUPS) plus "total"."""
    out = dict.fromkeys(GROUPS, 0)
    for t in model_tensors(config, include_mtp):
        out[t.group] += t.params
    out["total"] = sum(out.values())
    return out


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Per-token cache of the whole model (one copy). ``vectors`` = separately scaled rows."""

    kind: str  # "mla" | "gqa"
    values: int
    vectors: int
    kv_heads: int = 0  # gqa only

    def per_device(self, tp: int) -> tuple[int, int]:
        """(values, vectors) one device holds per token: MLA replicated, GQA split by head."""
        if self.kind == "mla":
            return self.values, self.vectors
        frac = max(1, math.ceil(self.kv_heads / tp)) / self.kv_heads
        return round(self.values * frac), round(self.vectors * frac)


def kv_layout(config: dict, include_mtp: bool = False) -> KVLayout:
    """MLA: latent (kv_lora_rank) + rope key per layer, plus the DSA indexer key on layers
    that run an indexer; GQA: K and V, kv_heads x head_dim each, per layer.

    include_mtp (MLA families, as ``--speculative mtp`` allocates them): each MTP layer adds its
    own latent + rope key (+ an indexer key on GLM-5, whose MTP layer is a full DSA layer) and
    the ``hidden`` slot, the main model's final hidden state of every cached token (one more
    vector of hidden_size values). jaxserve has no MTP block for the GQA family, so there the
    MTP layers hold no KV."""
    arch, c = resolve_architecture(config)
    n = c["num_hidden_layers"]
    if arch == "Glm4MoeForCausalLM":
        kvh = c["num_key_value_heads"]
        hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return KVLayout("gqa", n * 2 * kvh * hd, n * 2 * kvh, kvh)
    mtp = int(c.get("num_nextn_predict_layers") or 0) if include_mtp else 0
    values, vectors = (n + mtp) * (c["kv_lora_rank"] + c["qk_rope_head_dim"]), 2 * (n + mtp)
    values, vectors = values + mtp * c["hidden_size"], vectors + mtp
    if arch == "GlmMoeDsaForCausalLM":
        ni = _indexer_layers(c, mtp)
        values, vectors = values + ni * c["index_head_dim"], vectors + ni
    return KVLayout("mla", values, vectors)
