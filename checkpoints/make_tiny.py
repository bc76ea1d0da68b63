"""Build the small shipped checkpoint ``checkpoints/tiny-kimi-k2/``.

A Kimi K2-shaped model (DeepseekV3ForCausalLM: MLA + sigmoid-routed MoE with a shared expert
and a leading dense layer) at toy width, random weights, written by Hugging Face
``transformers`` so that it is a genuine HF-format directory. It lets the README's first
command run on a fresh machine without a model hub. Regenerate with:

    .venv/bin/python checkpoints/make_tiny.py
"""
from pathlib import Path

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

OUT = Path(__file__).parent / "tiny-kimi-k2"


def main():
    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=8,
        n_shared_experts=1, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        routed_scaling_factor=2.827, first_k_dense_replace=1,
        kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
        max_position_embeddings=4096, bos_token_id=0, eos_token_id=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
                         "original_max_position_embeddings": 1024, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "beta_fast": 32, "beta_slow": 1},
    )
    model = DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    model.save_pretrained(OUT)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
