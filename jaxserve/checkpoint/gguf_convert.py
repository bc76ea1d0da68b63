"""GGUF (llama.cpp) -> Hugging Face Llama directory.

Conversion undoes what llama.cpp's ``convert_hf_to_gguf.py`` did to a Llama checkpoint:
renamed tensors, Q/K rows permuted for its rope layout, quantised blocks (dequantised
here with ``gguf.quants.dequantize``), and a tokenizer stored as metadata arrays.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tqdm import tqdm

from jaxserve.checkpoint.gguf_tokenizer import tokenizer_files_from_gguf

_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}

# llama.cpp tensor name -> HF name. "{i}" is the layer index.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


class GGUFConversionError(ValueError):
    """The GGUF cannot be converted faithfully (unsupported architecture, odd tensors)."""


def gguf_fields(reader: GGUFReader) -> dict[str, Any]:
    """All metadata as plain Python values (str, int, float, bool, lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def _f32(value: float) -> float:
    # GGUF stores floats as float32: 1e-5 reads back as 9.999999747e-06. The shortest
    # float32 repr recovers the number the original config.json had.
    return float(str(np.float32(value)))


def llama_config_from_gguf(meta: dict[str, Any], tied: bool, dtype: str) -> dict[str, Any]:
    """A transformers LlamaConfig dict from llama.cpp's ``llama.*`` metadata keys."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFConversionError(f"only llama-architecture GGUFs are supported, got {arch!r}")

    def need(key: str):
        if f"llama.{key}" not in meta:
            raise GGUFConversionError(f"GGUF metadata lacks llama.{key}")
        return meta[f"llama.{key}"]

    if any(k.startswith("llama.rope.scaling") for k in meta):
        # rope scaling (llama3/yarn) would need rope_freqs handling; refuse rather than guess.
        raise GGUFConversionError("GGUF rope scaling is not supported by this converter")
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(meta.get("llama.rope.dimension_count", hidden // heads))
    if head_dim * heads != hidden:
        raise GGUFConversionError(f"rope dimension {head_dim} x {heads} heads != hidden {hidden}")
    vocab = meta.get("llama.vocab_size", len(meta.get("tokenizer.ggml.tokens", [])))
    if not vocab:
        raise GGUFConversionError("GGUF metadata has neither llama.vocab_size nor tokenizer tokens")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(need("context_length")),
        "vocab_size": int(vocab),
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": dtype,
        "dtype": dtype,
        "use_cache": True,
    }


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    HF Llama applies rope to the two halves of each head (rotate_half); llama.cpp wants the
    rotated pairs adjacent, so its converter reorders each head's rows from
    ``(2, half)`` to ``(half, 2)``. Reading rows as ``(head, half, 2)`` and swapping back
    restores HF's order (transformers' GGUF loader does the same).
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise GGUFConversionError(f"{rows} rows cannot be split into {n_head} rope heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensor_name(gguf_name: str) -> str:
    """The HF name of a llama.cpp tensor; an error names any tensor the map does not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise GGUFConversionError(f"GGUF tensor {gguf_name!r} has no Hugging Face Llama equivalent")


def _expected_hf_names(config: dict[str, Any]) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        names.add("lm_head.weight")
    for i in range(config["num_hidden_layers"]):
        names.update(f"model.layers.{i}.{n}" for n in _LAYER_NAMES.values())
    return names


def convert_gguf_to_hf(
    gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "float32", progress: bool = True
) -> Path:
    """Write `gguf_path` (a llama-architecture GGUF) as a Hugging Face Llama directory.

    Produces config.json, generation_config.json, model.safetensors (dequantised to
    `dtype`: "float32", "bfloat16" or "float16"), tokenizer.json and tokenizer_config.json.
    Missing, unknown or duplicate tensors are errors. Returns `out_dir`.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(str(gguf_path))
    meta = gguf_fields(reader)
    tied = all(t.name != "output.weight" for t in reader.tensors)
    config = llama_config_from_gguf(meta, tied=tied, dtype=dtype)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    tensors: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc=f"converting {Path(gguf_path).name}", unit="tensor", disable=not progress):
        name = hf_tensor_name(t.name)
        if name in tensors:
            raise GGUFConversionError(f"GGUF has tensor {t.name!r} twice")
        # dequantize gives numpy (row-major) order, i.e. HF's [out_features, in_features].
        w = dequantize(t.data, t.tensor_type)
        if name.endswith("q_proj.weight"):
            w = unpermute_rope_rows(w, heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_rope_rows(w, kv_heads)
        tensors[name] = np.ascontiguousarray(w, dtype=_DTYPES[dtype])

    expected = _expected_hf_names(config)
    missing, extra = sorted(expected - tensors.keys()), sorted(tensors.keys() - expected)
    if missing or extra:
        raise GGUFConversionError(f"GGUF tensors do not match the config: missing {missing[:5]}, extra {extra[:5]}")
    emb = tensors["model.embed_tokens.weight"].shape
    if emb != (config["vocab_size"], config["hidden_size"]):
        raise GGUFConversionError(f"token_embd shape {emb} != (vocab_size, hidden_size)")

    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {
        k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config[k] is not None
    })
    backend, tok_config = tokenizer_files_from_gguf(meta)
    if backend.get_vocab_size(with_added_tokens=True) != config["vocab_size"]:
        raise GGUFConversionError("tokenizer vocabulary size differs from the model's vocab_size")
    backend.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tok_config)
    return out


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")
