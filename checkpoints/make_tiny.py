"""Build the small shipped checkpoint ``checkpoints/tiny-kimi-k2/``.

A Kimi K2-shaped model (DeepseekV3ForCausalLM: MLA + sigmoid-routed MoE with a shared expert
and a leading dense layer) at toy width, random weights, written by Hugging Face
``transformers`` so that it is a genuine HF-format directory, plus one multi-token-prediction
(MTP) layer as DeepSeek-V3 checkpoints carry it (``num_nextn_predict_layers: 1``; transformers
neither builds nor saves it, so ``add_mtp_layer`` appends its tensors to the file, leaving every
main-model tensor as it was). It lets the README's first command run on a fresh machine without
a model hub. Regenerate with:

    .venv/bin/python checkpoints/make_tiny.py            # the whole directory
    .venv/bin/python checkpoints/make_tiny.py --add-mtp  # only the MTP layer, into the existing one
"""
import json
import sys
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
        max_position_embeddings=4096, bos_token_id=0, eos_token_id=1, num_nextn_predict_layers=1,
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
    add_mtp_layer(OUT)
    print(f"wrote {OUT}")


def add_mtp_layer(out: Path, seed: int = 1) -> None:
    """Append MTP layer ``model.layers.{num_hidden_layers}.*`` to ``out``'s single safetensors file.

    As DeepSeek-V3 defines the block: ``embed_tokens`` (a copy of the main embedding, as those
    checkpoints store it), ``enorm`` / ``hnorm`` (RMSNorm scales), ``eh_proj`` ([D, 2D]: the
    normed embedding first, then the normed hidden state), one MoE decoder layer (named as the
    main model's layers; random, shaped like its last layer), ``shared_head.norm`` and
    ``shared_head.head`` ([V, D]). Idempotent: an existing MTP layer is replaced."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((out / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    path = out / "model.safetensors"
    tensors = {k: v for k, v in load_file(path).items() if not k.startswith(f"model.layers.{n}.")}
    g = torch.Generator().manual_seed(seed)
    d, last = cfg["hidden_size"], f"model.layers.{n - 1}."

    def rand(shape, std):
        return (std * torch.randn(shape, generator=g)).to(torch.bfloat16)

    mtp = {}
    for name in sorted(k for k in tensors if k.startswith(last)):
        like = tensors[name]
        if name.endswith("norm.weight"):
            mtp[name] = 1.0 + rand(like.shape, 0.1).float()
        elif name.endswith("e_score_correction_bias"):
            mtp[name] = rand(like.shape, 0.05).float().to(like.dtype)
        else:
            mtp[name] = rand(like.shape, float(like.float().std()))
        mtp[name] = mtp[name].to(like.dtype)
    mtp = {f"model.layers.{n}." + k[len(last):]: v for k, v in mtp.items()}
    p = f"model.layers.{n}."
    std = float(tensors["lm_head.weight"].float().std())
    mtp.update({
        p + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
        p + "enorm.weight": (1.0 + rand((d,), 0.1).float()).to(torch.bfloat16),
        p + "hnorm.weight": (1.0 + rand((d,), 0.1).float()).to(torch.bfloat16),
        p + "eh_proj.weight": rand((d, 2 * d), 0.02),
        p + "shared_head.norm.weight": (1.0 + rand((d,), 0.1).float()).to(torch.bfloat16),
        p + "shared_head.head.weight": rand((cfg["vocab_size"], d), std),
    })
    save_file({**tensors, **mtp}, path, metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    add_mtp_layer(OUT) if "--add-mtp" in sys.argv[1:] else main()
