"""Architecture registry: adding a model family is one entry here."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jaxserve.config import ConfigError, ModelConfig


@dataclasses.dataclass(frozen=True)
class Architecture:
    name: str  # the HF `architectures[0]` string
    model_types: tuple[str, ...]  # accepted `model_type` values
    parse_config: Callable[[dict[str, Any]], ModelConfig]
    build: Callable[..., Any]  # (cfg, dtype, rngs) -> CausalLM
    weight_map: Callable[[ModelConfig], list]
    skip_tensor: Callable[[ModelConfig, str], bool]
    mtp: bool = False  # builds the checkpoint's MTP block when ModelConfig.mtp_layers (speculative drafts)


_REGISTRY: dict[str, Architecture] = {}


def register(arch: Architecture) -> None:
    _REGISTRY[arch.name] = arch


def architectures() -> list[str]:
    return sorted(_REGISTRY)


def resolve_architecture(raw: dict[str, Any]) -> Architecture:
    """Pick the architecture from `architectures` (or, failing that, `model_type`)."""
    names = raw.get("architectures") or []
    model_type = raw.get("model_type")
    if names:
        if len(names) != 1:
            raise ConfigError(f"config.json lists several architectures {names}; expected one")
        if names[0] not in _REGISTRY:
            raise ConfigError(f"unknown architecture {names[0]!r}; supported: {', '.join(architectures())}")
        arch = _REGISTRY[names[0]]
        if model_type and model_type not in arch.model_types:
            raise ConfigError(
                f"architecture {arch.name} with model_type {model_type!r} is not supported "
                f"(expected one of {arch.model_types})"
            )
        return arch
    for arch in _REGISTRY.values():
        if model_type in arch.model_types:
            return arch
    raise ConfigError(
        f"config.json names no known architecture (architectures={names}, model_type={model_type!r}); "
        f"supported: {', '.join(architectures())}"
    )


def wrapper_name(raw: dict[str, Any]) -> str | None:
    """The wrapper's own architecture (or model_type) when `raw` is a multimodal wrapper around a
    text model (``text_config``) and names no architecture we register itself; else None."""
    if not isinstance(raw.get("text_config"), dict):
        return None
    names = raw.get("architectures") or []
    model_type = raw.get("model_type")
    if names[:1] and names[0] in _REGISTRY or any(model_type in a.model_types for a in _REGISTRY.values()):
        return None
    return names[0] if names else str(model_type)


def text_model_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The config dict of the text model jaxserve builds: `raw` itself, or for a multimodal
    wrapper (Kimi K2.5/K2.6 ``kimi_k25``: vision tower + projector + DeepSeek-V3 text model) its
    ``text_config``. The wrapper's ``quantization_config`` (it covers the text weights) carries
    over, and so does its ``tie_word_embeddings`` when it sets one: it decides whether the
    wrapper's LM head is tied, as transformers builds it. Its bos / eos ids fill the text
    config's when those are missing."""
    if wrapper_name(raw) is None:
        return raw
    text = dict(raw["text_config"])
    if raw.get("quantization_config") and not text.get("quantization_config"):
        text["quantization_config"] = raw["quantization_config"]
    if "tie_word_embeddings" in raw:
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    for key in ("bos_token_id", "eos_token_id"):  # stop ids the wrapper names and its text model does not
        if text.get(key) is None and raw.get(key) is not None:
            text[key] = raw[key]
    return text


def config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    """A HF ``config.json`` dict -> ModelConfig, parsed by the architecture it names (for a
    multimodal wrapper: by its text model's, ``text_model_config``)."""
    text = text_model_config(raw)
    return resolve_architecture(text).parse_config(text)


def get_architecture(cfg: ModelConfig) -> Architecture:
    return _REGISTRY[cfg.architecture]


def _register_builtin():
    from jaxserve.models import deepseek_v3, glm4_moe, glm_moe_dsa, llama

    for module, build in ((deepseek_v3, deepseek_v3.DeepseekV3), (glm4_moe, glm4_moe.Glm4Moe),
                          (glm_moe_dsa, glm_moe_dsa.GlmMoeDsa), (llama, llama.Llama)):
        register(
            Architecture(
                name=module.ARCH,
                model_types=module.MODEL_TYPES,
                parse_config=module.parse_config,
                build=build,
                weight_map=module.weight_map,
                skip_tensor=module.skip_tensor,
                mtp=getattr(module, "BUILDS_MTP", False),
            )
        )


_register_builtin()
