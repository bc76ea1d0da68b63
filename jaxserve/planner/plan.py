"""Capacity planning: weight formats, checkpoint bytes, weights per device and KV tokens.

Tensors and the KV layout come from ``inventory`` (counted from a config dict; no jax).
Units: bytes; "GB" in outputs means 1e9 bytes.

Sharding model (one mesh of ``devices`` = ``dp`` x ``tp``; experts over ``ep`` | devices):
- routed experts are split over ``ep`` devices (whole experts per device);
- attention heads, dense/shared MLP intermediate, and the vocabulary of the embedding and
  lm_head are split over ``tp``;
- GQA k/v projections are split by KV head; with tp > kv_heads each device holds one head;
- MLA down-projections (q_a, kv_a_with_mqa), the DSA indexer, norms and the router are
  replicated on every device.
KV: the MLA latent is replicated on every device of a TP group; GQA KV is split by KV
head. Aggregate tokens = tokens per device x dp.
"""
from __future__ import annotations

import dataclasses
import math

from jaxserve.quant.sizes import matrix_bytes

from .inventory import (GROUP_LABELS, GROUPS, UnsupportedArchitecture, kv_layout, model_tensors,
                        resolve_architecture)
from .presets import DeviceSpec, get_device

__all__ = ["GROUP_LABELS", "GROUPS", "PlanResult", "UnsupportedArchitecture", "WeightFormat", "parse_kv_format",
           "parse_weight_format", "plan", "shipped_formats"]

GB = 10**9
FORMAT_GROUPS = ("experts", "attention", "mlp", "embed")  # "norms" is never quantized

# Defaults; see docs/PLANNER.md for how they were derived from the article's 48.2 GB/GPU.
DEFAULT_USABLE_FRACTION = 0.90   # of reported device memory (vLLM's default utilisation)
DEFAULT_RESERVE_BYTES = 11 * GB  # activations, MoE dispatch buffers, CUDA graphs
DEFAULT_KV_SCALE_BYTES = 4       # one float32 scale per cached vector per token (fp8 KV)


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """How a [rows, cols] (out, in) weight matrix is stored; its bytes come from the engine's
    ``jaxserve.quant.sizes.matrix_bytes``.

    bf16: 2 B/weight. fp8: 1 B/weight + float32 scales, one per output channel
    (group=0) or per group x group block. int8: 1 B/weight + one float32 scale per output
    channel. int4: 0.5 B/weight + one scale per ``group`` consecutive input weights of a row
    (symmetric, no zero points), bf16 as compressed-tensors pack-quantized ships them
    (``scale_bytes`` 4 for the float32 scales the engine makes when it quantizes at load).
    """

    kind: str  # "bf16" | "fp8" | "int8" | "int4"
    group: int = 0
    scale_bytes: int = 0  # 0: the kind's default (int4 2, fp8/int8 4)

    @property
    def name(self) -> str:
        if self.kind == "fp8":
            return f"fp8:block{self.group}" if self.group else "fp8:channel"
        return f"int4:g{self.group}" if self.kind == "int4" else self.kind

    def nbytes(self, rows: int, cols: int) -> int:
        scale = self.scale_bytes or (2 if self.kind == "int4" else 4)
        return matrix_bytes(self.kind, cols, rows, self.group, scale)


def parse_weight_format(spec: str | WeightFormat) -> WeightFormat:
    """'bf16' | 'fp8' (= fp8:block128) | 'fp8:channel' | 'fp8:block<N>' | 'int4' (= g128) | 'int4:g<N>'."""
    if isinstance(spec, WeightFormat):
        return spec
    s = spec.lower().replace("fp8_e4m3", "fp8").replace("bfloat16", "bf16")
    kind, _, opt = s.partition(":")
    try:
        if (kind, opt) in (("bf16", ""), ("int8", ""), ("int8", "channel")):
            return WeightFormat(kind)
        if kind == "fp8":
            if opt == "channel":
                return WeightFormat("fp8", 0)
            return WeightFormat("fp8", int(opt.removeprefix("block") or 128))
        if kind == "int4":
            g = int(opt.removeprefix("g") or 128)
            if g > 0:
                return WeightFormat("int4", g)
    except ValueError:
        pass
    raise ValueError(f"unknown weight format {spec!r} (bf16, fp8, fp8:channel, fp8:block128, int8, int4:g32, "
                     "int4:g128)")


KV_FORMATS = {"bf16": 2, "fp16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}


def parse_kv_format(spec: str) -> str:
    s = {"fp8": "fp8_e4m3", "bfloat16": "bf16"}.get(spec.lower(), spec.lower())
    if s not in KV_FORMATS:
        raise ValueError(f"unknown KV format {spec!r} (one of {', '.join(KV_FORMATS)}, fp8)")
    return s


def kv_bytes(values: int, vectors: int, kv_format: str, scale_bytes: int) -> int:
    """Bytes for ``values`` cached values; 1-byte formats add ``scale_bytes`` per vector."""
    from jaxserve.kv.memory import kv_token_bytes  # the engine's function: a plan equals an allocation

    b = KV_FORMATS[kv_format]
    return kv_token_bytes(b, b == 1, values, vectors, scale_bytes)


def shipped_formats(config: dict) -> dict[str, WeightFormat]:
    """Formats the checkpoint ships in, read from quantization_config (bf16 when absent).

    compressed-tensors 4-bit is taken to cover the routed experts only (as Kimi K2 ships,
    with attention, dense/shared MLP and lm_head in its ignore list); fp8 covers every
    linear layer except embeddings/lm_head (as DeepSeek and GLM FP8 checkpoints ship).
    """
    bf16 = WeightFormat("bf16")
    out = dict.fromkeys(FORMAT_GROUPS, bf16)
    _, c = resolve_architecture(config)
    qc = config.get("quantization_config") or c.get("quantization_config") or {}
    if qc.get("quant_method") == "fp8":
        block = (qc.get("weight_block_size") or [0])[0]
        out.update(experts=WeightFormat("fp8", block), attention=WeightFormat("fp8", block),
                   mlp=WeightFormat("fp8", block))
    elif qc.get("quant_method") == "compressed-tensors":
        for grp in (qc.get("config_groups") or {}).values():
            w = grp.get("weights") or {}
            if w.get("num_bits") == 4 and w.get("type", "int") == "int":
                out["experts"] = WeightFormat("int4", int(w.get("group_size") or 128))
    return out


@dataclasses.dataclass(frozen=True)
class PlanResult:
    """One capacity plan. Bytes are per device unless the name says otherwise."""

    model: str
    architecture: str
    attention: str  # "mla" | "gqa"
    device: str
    device_memory_bytes: int
    devices: int
    tp: int
    ep: int
    dp: int
    formats: dict  # group -> weight format name
    params: dict  # group -> parameters, plus "total"
    checkpoint_bytes: int  # one full copy of the weights
    checkpoint_bytes_by_group: dict
    weights_bytes_per_device: int
    kv_format: str
    kv_scale_bytes: int  # per cached vector per token (fp8 only)
    kv_bytes_per_token: int  # whole model, one copy, scales included
    kv_scale_bytes_per_token: int  # the part of kv_bytes_per_token that is scales
    kv_bytes_per_token_per_device: int
    usable_fraction: float
    reserve_bytes: int
    usable_bytes_per_device: int  # memory x usable_fraction - reserve
    kv_budget_bytes_per_device: int  # usable - weights (0 if the weights do not fit)
    kv_tokens_per_device: int
    kv_tokens: int  # aggregate over the dp replicas
    context_len: int
    concurrent_sequences: int  # full context_len sequences, aggregate
    fits: bool
    assumptions: dict

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _formats(config: dict, weights: str | None, **groups: str | None) -> dict:
    """Each group's weight format: as shipped, then ``weights`` for experts, attention and MLP,
    then the per-group overrides (experts, attention, mlp, embed)."""
    fmts = shipped_formats(config)
    if weights:
        fmts.update(dict.fromkeys(("experts", "attention", "mlp"), parse_weight_format(weights)))
    for g, f in groups.items():
        if f:
            fmts[g] = parse_weight_format(f)
    return fmts


def _weight_bytes(tensors, fmts: dict, c: dict, tp: int, ep: int) -> tuple[dict, dict, int]:
    """(parameters per group and total, checkpoint bytes per group, weight bytes per device)."""
    n_exp = c.get("n_routed_experts") or 1
    kvh = c.get("num_key_value_heads") or 1
    frac = {"ep": math.ceil(n_exp / ep) / n_exp, "tp": 1 / tp, "rep": 1.0,
            "kv": max(1, math.ceil(kvh / tp)) / kvh}
    params = dict.fromkeys(GROUPS, 0)
    by_group = dict.fromkeys(GROUPS, 0)
    per_device = 0.0
    for t in tensors:
        b = t.nbytes(fmts)
        params[t.group] += t.params
        by_group[t.group] += b
        per_device += b * frac[t.shard]
    params["total"] = sum(params.values())
    return params, by_group, math.ceil(per_device)


def _assumptions(dev, arch: str, c: dict, layout, tp: int, ep: int, usable_fraction: float, reserve_bytes: int,
                 kv_scale_bytes: int, include_mtp: bool) -> dict:
    """What the plan assumes, in words (``PlanResult.assumptions``)."""
    vectors = {"mla": "latent and rope per layer", "gqa": "K and V per KV head per layer"}[layout.kind]
    if arch == "GlmMoeDsaForCausalLM":
        vectors += ", DSA indexer key per indexer layer"
    return {
        "device_memory": f"{dev.note or dev.name}: {dev.memory_bytes:,} B",
        "usable_fraction": f"{usable_fraction} of device memory for weights + KV",
        "reserve": f"{reserve_bytes:,} B per device for activations, workspace, MoE buffers, CUDA graphs",
        "sharding": (f"experts over ep={ep}; attention heads, dense/shared MLP and vocab over tp={tp}; "
                     "GQA k/v by KV head; MLA q_a/kv_a, indexer, norms, router replicated"),
        "kv": ("MLA latent + rope key (+ DSA indexer key) replicated on each device of a TP group"
               if layout.kind == "mla" else "GQA K and V split by KV head (one head per device if tp > kv_heads)"),
        "kv_scales": (f"fp8 only: {kv_scale_bytes} B per cached vector per token ({layout.vectors} vectors/token: "
                      f"{vectors}); the article's figure ignores scales (kv_scale_bytes=0)"),
        "kept_dtypes": ("norms bf16; router weight and e_score_correction_bias float32 (routing runs in float32); "
                        "never quantized"),
        "int4": "symmetric, one bf16 scale per group of input weights (compressed-tensors pack-quantized)",
        "fp8": "e4m3, float32 scales per output channel or per 128x128 block",
        "mtp": ("MTP layers counted (embeddings/head shared; on MLA families their KV too: latent, rope, "
                "indexer key on GLM-5, and the hidden state --speculative mtp caches)" if include_mtp else
                f"MTP layers not counted ({c.get('num_nextn_predict_layers') or 0} in config)"),
        "units": "bytes; GB = 1e9 bytes",
    }


def plan(config: dict, *, devices: int = 8, device: str | DeviceSpec = "h200",
         weights: str | None = None, experts_format: str | None = None,
         attention_format: str | None = None, mlp_format: str | None = None,
         embed_format: str | None = None, kv_format: str = "bf16",
         kv_scale_bytes: int = DEFAULT_KV_SCALE_BYTES, tp: int | None = None, ep: int | None = None,
         context_len: int | None = None, usable_fraction: float = DEFAULT_USABLE_FRACTION,
         reserve_bytes: int = DEFAULT_RESERVE_BYTES, include_mtp: bool = False,
         name: str | None = None) -> PlanResult:
    """Plan one deployment of ``config`` on ``devices`` x ``device``.

    Formats: start from what the checkpoint ships (``shipped_formats``); ``weights`` sets
    experts, attention and MLP; the per-group arguments override that. Embeddings/lm_head
    stay as shipped (bf16) unless ``embed_format`` is given.
    """
    dev = get_device(device)
    tp, ep = tp or devices, ep or devices
    if devices < 1 or devices % tp or devices % ep:
        raise ValueError(f"tp ({tp}) and ep ({ep}) must divide devices ({devices})")
    if not 0 < usable_fraction <= 1 or reserve_bytes < 0 or kv_scale_bytes < 0:
        raise ValueError("need 0 < usable_fraction <= 1, reserve_bytes >= 0, kv_scale_bytes >= 0")
    arch, c = resolve_architecture(config)
    kv_format = parse_kv_format(kv_format)
    fmts = _formats(config, weights, experts=experts_format, attention=attention_format, mlp=mlp_format,
                    embed=embed_format)
    params, by_group, weights_dev = _weight_bytes(model_tensors(config, include_mtp), fmts, c, tp, ep)

    layout = kv_layout(config, include_mtp)
    kv_tok = kv_bytes(layout.values, layout.vectors, kv_format, kv_scale_bytes)
    kv_tok_dev = kv_bytes(*layout.per_device(tp), kv_format, kv_scale_bytes)
    usable = int(dev.memory_bytes * usable_fraction) - reserve_bytes
    budget = max(0, usable - weights_dev)
    tokens_dev = budget // kv_tok_dev
    dp = devices // tp
    ctx = context_len or c.get("max_position_embeddings") or 4096
    if ctx < 1:
        raise ValueError(f"context_len must be positive, got {ctx}")
    assumptions = _assumptions(dev, arch, c, layout, tp, ep, usable_fraction, reserve_bytes, kv_scale_bytes,
                               include_mtp)
    return PlanResult(
        model=name or c.get("model_type") or arch, architecture=arch, attention=layout.kind,
        device=dev.name, device_memory_bytes=dev.memory_bytes, devices=devices, tp=tp, ep=ep, dp=dp,
        formats={g: fmts[g].name for g in FORMAT_GROUPS} | {"norms": "bf16/float32"},
        params=params, checkpoint_bytes=sum(by_group.values()), checkpoint_bytes_by_group=by_group,
        weights_bytes_per_device=weights_dev, kv_format=kv_format, kv_scale_bytes=kv_scale_bytes,
        kv_bytes_per_token=kv_tok, kv_scale_bytes_per_token=kv_tok - kv_bytes(layout.values, 0, kv_format, 0),
        kv_bytes_per_token_per_device=kv_tok_dev, usable_fraction=usable_fraction,
        reserve_bytes=reserve_bytes, usable_bytes_per_device=usable, kv_budget_bytes_per_device=budget,
        kv_tokens_per_device=tokens_dev, kv_tokens=tokens_dev * dp, context_len=ctx,
        concurrent_sequences=(tokens_dev // ctx) * dp, fits=usable > weights_dev, assumptions=assumptions)
