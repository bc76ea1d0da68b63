"""Built-in model shapes (as config.json dicts), device memory sizes, and the article's figures.

A model preset is exactly what a Hugging Face ``config.json`` would hold, so a preset and a
real checkpoint's config go through the same code. Fields the planner does not read (rope
scaling, token ids) are kept where they describe the model, for the reader.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os

MIB = 1 << 20

# Kimi K2 (K2.6 keeps the K2 text shape). The shipped checkpoint is compressed-tensors:
# routed experts int4, group 32, bf16 scales; attention, dense/shared MLP, embeddings bf16.
KIMI_K2_6 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    "vocab_size": 163840,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "topk_method": "noaux_tc",
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.827,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
    "max_position_embeddings": 262144,
    "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                   "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    },
}

# GLM-4.6 (same text shape as GLM-4.5). Ships bf16 (and an FP8 128x128-block variant).
GLM_4_6 = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "vocab_size": 151552,
    "hidden_size": 5120,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 92,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "partial_rotary_factor": 0.5,
    "attention_bias": True,
    "use_qk_norm": True,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 202752,
    "rope_theta": 1000000,
    "torch_dtype": "bfloat16",
}

# GLM-5: the text model of zai-org/GLM-5's config.json on Hugging Face, field for field (the
# values and where they were read: docs/PLANNER.md section 2). No indexer_types: every layer
# runs its own indexer.
GLM_5 = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "vocab_size": 154880,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 78,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 192,
    "v_head_dim": 256,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 2048,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 202752,
    "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
    "rms_norm_eps": 1e-05,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}

MODEL_PRESETS: dict[str, dict] = {"kimi-k2.6": KIMI_K2_6, "glm-4.6": GLM_4_6, "glm-5": GLM_5}

# Figures from the source article (the provider's write-up of this deployment), printed beside the planner's own.
ARTICLE = {
    "kimi-k2.6": {
        "setup": "8x H200, int4 experts + bf16 rest, tp=8",
        "kv_tokens": {"bf16": 686_000, "fp8_e4m3": 1_370_000},
        "kv_bytes_per_token": {"bf16": 70_272, "fp8_e4m3": 35_136},
        "kv_gb_per_device": 48.2,
    },
    "glm-5": {
        "setup": "GLM 5.2 (shape not public), 8x H200, 8-way TP",
        "checkpoint_gb": {"fp8": 705, "int4": 421},
        "weights_gb_per_device": {"fp8": 88, "int4": 52},
        "freed_kv_tokens": 1_180_000,
    },
}


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: the memory the runtime reports (what an allocator can see)."""

    name: str
    memory_bytes: int
    note: str = ""

    def __post_init__(self):
        if self.memory_bytes <= 0:
            raise ValueError(f"device {self.name!r}: memory_bytes must be positive")


DEVICE_PRESETS: dict[str, DeviceSpec] = {
    # 141 GB on the datasheet; the driver reports 143,771 MiB = 150.75 GB, which is what
    # cudaMemGetInfo / an allocator sees, so that is the figure used.
    "h200": DeviceSpec("h200", 143_771 * MIB, "H200 141 GB HBM3e, as reported: 143,771 MiB"),
    # H100 SXM 80 GB: nvidia-smi reports 81,559 MiB = 85.52 GB.
    "h100": DeviceSpec("h100", 81_559 * MIB, "H100 80 GB HBM3, as reported: 81,559 MiB"),
}


def get_device(device: str | DeviceSpec) -> DeviceSpec:
    if isinstance(device, DeviceSpec):
        return device
    try:
        return DEVICE_PRESETS[device.lower()]
    except KeyError:
        raise ValueError(f"unknown device {device!r}; presets: {', '.join(DEVICE_PRESETS)}") from None


def load_model_config(spec: str) -> tuple[str, dict]:
    """A preset name, a config.json path, or a directory holding config.json -> (name, dict)."""
    if spec in MODEL_PRESETS:
        return spec, copy.deepcopy(MODEL_PRESETS[spec])
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise ValueError(f"--model {spec!r} is neither a preset ({', '.join(MODEL_PRESETS)}) "
                         "nor a config.json file or directory")
    with open(path) as f:
        return path, json.load(f)
