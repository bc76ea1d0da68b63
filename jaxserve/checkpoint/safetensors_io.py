"""Read safetensors files into numpy for every dtype real checkpoints ship.

``safetensors``' own numpy backend cannot return bfloat16 or float8 tensors (numpy has no
such dtypes), and BF16 / FP8 are exactly what Kimi, GLM and DeepSeek ship. The format is
simple enough to read directly: an 8-byte little-endian header length, a JSON header
mapping each name to ``{dtype, shape, data_offsets}``, then the raw bytes. Tensors are
memory-mapped and copied one at a time, so only the tensor being converted is in memory.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import ml_dtypes
import numpy as np

# safetensors dtype codes -> numpy dtypes (ml_dtypes for the ones numpy lacks).
DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}


class SafetensorsFile:
    """One .safetensors file: names, dtypes and shapes from the header; tensors on demand."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        self.metadata = header.pop("__metadata__", None) or {}
        self.header = header
        self._data_start = 8 + n
        self._mm = None

    def keys(self) -> list[str]:
        return list(self.header)

    def dtype_code(self, name: str) -> str:
        """The safetensors dtype code ("BF16", "F8_E4M3", "I32", ...)."""
        return self.header[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        entry = self.header[name]
        code = entry["dtype"]
        if code not in DTYPES:
            raise ValueError(f"{self.path.name}: tensor {name} has unsupported dtype {code}")
        if self._mm is None:
            self._mm = np.memmap(self.path, np.uint8, mode="r")
        start, end = entry["data_offsets"]
        raw = self._mm[self._data_start + start: self._data_start + end]
        # Copy: offsets need not be aligned to the dtype, and the copy detaches from the map.
        return np.array(raw).view(DTYPES[code]).reshape(entry["shape"])
