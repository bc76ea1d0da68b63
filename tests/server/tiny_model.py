"""A tiny random LlamaForCausalLM that speaks text: the SmolLM2 tokenizer files beside
random weights (vocab 49152, 2 layers, hidden 64), so server tests and the load test can
use text prompts and still run in seconds on a CPU. Needs torch + transformers (test extra).
"""
from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def build_tiny_text_model(path, seed: int = 3) -> str:
    """Write the model into `path` (created) and return it as a string."""
    from tests.hf_models import build_llama

    from jaxserve.checkpoint.gguf import default_model_dir
    from jaxserve.tokenizer import Tokenizer

    src = Path(default_model_dir())
    tok = Tokenizer.from_dir(src)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_llama(path, seed=seed, vocab_size=tok.vocab_size, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_ids[0], max_position_embeddings=1024)
    for name in TOKENIZER_FILES:  # after save_pretrained, so the tokenizer's generation config wins
        if (src / name).exists():
            shutil.copy(src / name, path / name)
    return str(path)
