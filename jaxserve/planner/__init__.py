"""Capacity planner: parameters, checkpoint size, weights per device and KV-cache tokens.

``plan(config, devices=8, device="h200", ...) -> PlanResult``; CLI: ``jaxserve plan``.
Pure Python (no jax), so it runs anywhere.
"""
from .inventory import GROUPS, KVLayout, UnsupportedArchitecture, count_params, kv_layout, model_tensors
from .plan import PlanResult, WeightFormat, parse_weight_format, plan, shipped_formats
from .presets import ARTICLE, DEVICE_PRESETS, MODEL_PRESETS, DeviceSpec, get_device, load_model_config

__all__ = ["ARTICLE", "DEVICE_PRESETS", "GROUPS", "KVLayout", "MODEL_PRESETS", "DeviceSpec", "PlanResult",
           "UnsupportedArchitecture", "WeightFormat", "count_params", "get_device", "kv_layout",
           "load_model_config", "model_tensors", "parse_weight_format", "plan", "shipped_formats"]
