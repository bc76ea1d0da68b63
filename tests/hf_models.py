"""Tiny random Hugging Face models, built and saved by the tests themselves (the reference)."""
from __future__ import annotations

import torch


def deepseek_v3_config(**overrides):
    from transformers import DeepseekV3Config

    kw = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=8,
        n_shared_experts=1,
        n_routed_experts=16,
        routed_scaling_factor=2.5,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=16,
        v_head_dim=16,
        qk_nope_head_dim=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        first_k_dense_replace=1,
        max_position_embeddings=1024,
        bos_token_id=0,
        eos_token_id=1,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 256,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    )
    kw.update(overrides)
    return DeepseekV3Config(**kw)


def build_deepseek_v3(path, seed: int = 0, dtype=torch.float32, **overrides):
    """Build, randomise (incl. e_score_correction_bias, zero at init) and save; return the torch model."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(deepseek_v3_config(**overrides)).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))  # non-trivial norm scales
            elif p.dim() >= 2:
                p.copy_(0.08 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    model.save_pretrained(path)
    return model


def _randomise(model, seed):
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.05 * torch.randn_like(p))
            elif p.dim() >= 2:
                p.copy_(0.08 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return model


def build_glm4_moe(path, seed: int = 0, **overrides):
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    kw = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
        n_shared_experts=1, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        routed_scaling_factor=1.5, first_k_dense_replace=1, use_qk_norm=True, attention_bias=True,
        max_position_embeddings=1024, bos_token_id=0, eos_token_id=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    model = _randomise(Glm4MoeForCausalLM(Glm4MoeConfig(**kw)).eval(), seed)
    model.save_pretrained(path)
    return model


def build_llama(path, seed: int = 0, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=0, eos_token_id=1, tie_word_embeddings=True, rope_theta=10000.0,
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    model = _randomise(LlamaForCausalLM(LlamaConfig(**kw)).eval(), seed)
    model.save_pretrained(path)
    return model


def build_kimi_k25(path, text_model, seed: int = 0):
    """Wrap the DeepseekV3ForCausalLM `text_model` in transformers' own Kimi K2.5/K2.6 multimodal
    model (a vision tower and projector, as small as the classes allow, randomised), copy the text
    weights in unchanged and save; return the torch wrapper."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    vision = dict(patch_size=2, pos_emb_height=2, pos_emb_width=2, pos_emb_time=1, num_attention_heads=1,
                  num_hidden_layers=1, hidden_size=8, intermediate_size=8, merge_kernel_size=[2, 2])
    cfg = Kimi_K25Config(text_config=text_model.config.to_dict(), vision_config=vision,
                         projection_hidden_size=8, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Kimi_K25ForConditionalGeneration(cfg).to(text_model.dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith(("model.language_model.", "lm_head.")):
                p.copy_(0.1 * torch.randn_like(p))
    model.model.language_model.load_state_dict(text_model.model.state_dict(), strict=True)
    model.lm_head.load_state_dict(text_model.lm_head.state_dict(), strict=True)
    model.save_pretrained(path)
    return model


def build_glm_moe_dsa(path, seed: int = 0, **overrides):
    """GLM-5 (MLA + DSA indexer + sigmoid MoE), tiny: index_topk far below the test prompts'
    lengths so the sparse path runs; full and shared indexer layers; grouped routing."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    kw = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
        q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
        n_shared_experts=1, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, first_k_dense_replace=1,
        index_topk=8, index_head_dim=32, index_n_heads=16,
        indexer_types=["full", "shared", "full", "shared"],
        max_position_embeddings=1024, bos_token_id=0, eos_token_id=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**kw)).eval()
    model.config._attn_implementation = "eager"
    model = _randomise(model, seed)
    model.save_pretrained(path)
    return model


def torch_logprobs(model, ids):
    """float32 [T, vocab] log-probs of a transformers model over the token ids ``ids``."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1).numpy()


def paged_decode_logits(llm, prompt, continuation):
    """Prefill `prompt`, then feed `continuation` one token per decode step; logits per step."""
    import numpy as np

    runner, s = llm.runner, llm.page_size
    table = np.array([list(range(1, (len(prompt) + len(continuation)) // s + 2))], np.int32)
    out = [np.asarray(runner.run(np.array([prompt], np.int32), [0], [len(prompt)], table))[0]]
    for i, tok in enumerate(continuation):
        out.append(np.asarray(runner.run(np.array([[tok]], np.int32), [len(prompt) + i], [1], table))[0])
    return np.stack(out)


def add_mtp_layer(path, seed: int = 1):
    """Append a random MTP layer (``model.layers.{num_hidden_layers}.*``, DeepSeek-V3's layout,
    shaped like the last layer) to the checkpoint saved at ``path``: the generator the shipped
    tiny checkpoint uses (``checkpoints/make_tiny.py``)."""
    import importlib.util
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "checkpoints" / "make_tiny.py"
    spec = importlib.util.spec_from_file_location("make_tiny", src)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.add_mtp_layer(Path(path), seed)
