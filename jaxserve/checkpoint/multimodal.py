"""The text model inside a multimodal checkpoint (Kimi K2.5 / K2.6 ``kimi_k25``).

A multimodal wrapper holds a vision tower, a projector and a text model whose config is the
wrapper's ``text_config`` (for ``kimi_k25`` a DeepSeek-V3 / ``kimi_k2`` model). jaxserve
serves the text model alone: requests carry token ids or text, never images, and there is no
image input anywhere in the API. Image / video placeholder ids in a prompt are ordinary
vocabulary ids to the text model; nothing replaces them with image features.

Where the text model's tensors live, as ``kimi_k25`` checkpoints name them (transformers'
``conversion_mapping.py`` entry for ``kimi_k25`` renames these to its module names):

- ``language_model.model.<text name>`` and ``language_model.lm_head.weight``: Moonshot's own
  release (the wrapper held a ``DeepseekV3ForCausalLM`` as ``language_model``). transformers
  5.x writes this form back when saving, with every ``layers`` renamed ``blocks`` (its load
  map renames ``blocks`` to ``layers`` everywhere, so both spellings load).
- ``model.language_model.<text name>`` and ``lm_head.weight``: transformers' module names
  (``Kimi_K25ForConditionalGeneration.model.language_model`` / ``.lm_head``).

Every other tensor (``vision_tower.*``, ``mm_projector.*``, ...) belongs to the image path and
is skipped, counted in one log line.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from jaxserve.checkpoint.prequantized import CheckpointError
from jaxserve.checkpoint.safetensors_io import SafetensorsFile

log = logging.getLogger("jaxserve.loader")

# Checkpoint prefix -> text-model prefix, one dict per naming form; longest prefix wins.
LAYOUTS = {
    "language_model.model / language_model.lm_head": {
        "language_model.model.blocks.": "model.layers.",
        "language_model.model.": "model.",
        "language_model.lm_head.": "lm_head.",
    },
    "model.language_model / lm_head": {
        "model.language_model.": "model.",
        "lm_head.": "lm_head.",
    },
}


@dataclasses.dataclass(frozen=True)
class TextTensors:
    """The text model's view of a wrapper checkpoint."""

    index: dict[str, Path]  # text-model tensor name -> its safetensors file
    stored: dict[str, str]  # text-model tensor name -> the name stored in the file
    skipped: dict[str, Path]  # tensors outside the text model (vision tower, projector)
    layout: str

    def skipped_bytes(self) -> int:
        """Stored bytes of the skipped tensors, from the safetensors headers."""
        files: dict[Path, SafetensorsFile] = {}
        total = 0
        for name, fn in self.skipped.items():
            start, end = files.setdefault(fn, SafetensorsFile(fn)).header[name]["data_offsets"]
            total += end - start
        return total


def _text_name(name: str, layout: dict[str, str]) -> str | None:
    for prefix in sorted(layout, key=len, reverse=True):
        if name.startswith(prefix):
            return layout[prefix] + name[len(prefix):]
    return None


def text_tensors(index: dict[str, Path], path, wrapper: str) -> TextTensors:
    """Split a wrapper checkpoint's tensors into the text model's (renamed to the names its own
    checkpoints use) and the rest; logs what is skipped. CheckpointError if no form matches."""
    counts = {k: sum(_text_name(n, lay) is not None for n in index) for k, lay in LAYOUTS.items()}
    form = max(counts, key=counts.get)
    if not counts[form]:
        raise CheckpointError(f"checkpoint {path} ({wrapper}) has no text-model tensors: none is named under "
                              f"{', '.join(p for lay in LAYOUTS.values() for p in lay)}")
    text_index, stored, skipped = {}, {}, {}
    for name, fn in index.items():
        text = _text_name(name, LAYOUTS[form])
        if text is None:
            other = [k for k, lay in LAYOUTS.items() if _text_name(name, lay) is not None]
            if other:  # e.g. a top-level lm_head.weight beside language_model.*: which one is served?
                raise CheckpointError(f"checkpoint {path} mixes naming forms: {name} is named as in "
                                      f"'{other[0]}' but most text tensors as in '{form}'")
            skipped[name] = fn
        elif text in stored:
            raise CheckpointError(f"checkpoint {path} names text tensor {text} twice: {stored[text]} and {name}")
        else:
            text_index[text], stored[text] = fn, name
    out = TextTensors(text_index, stored, skipped, form)
    if skipped:
        depth = lambda n: 2 if n.startswith("model.") else 1  # noqa: E731  (model.vision_tower.*, ...)
        heads = sorted({".".join(n.split(".")[: depth(n)]) for n in skipped})
        log.warning("%s: loading the text model only (no image input); "
                    "skipped %d vision/projector tensor(s), %d bytes (%s)",
                    wrapper, len(skipped), out.skipped_bytes(), ", ".join(h + ".*" for h in heads))
    return out
