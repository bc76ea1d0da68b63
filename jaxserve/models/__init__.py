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


def config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    """A HF ``config.json`` dict -> ModelConfig, parsed by the architecture it names."""
    return resolve_architecture(raw).parse_config(raw)


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
            )
        )


_register_builtin()
