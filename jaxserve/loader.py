"""Load a Hugging Face safetensors checkpoint directory into a jaxserve model.

The architecture's explicit name map (``weight_map``) says which HF tensors build each of
our parameters. Before reading any data the loader checks both directions: every tensor
the map needs must exist (a missing one is an error naming it) and every tensor in the
files must be used or deliberately skipped (an unexpected one is an error naming it).
Parameters are never left at their random initial values.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from jaxserve.config import ConfigError, ModelConfig
from jaxserve.models import get_architecture
from jaxserve.sharding import Mesh, named


class CheckpointError(ValueError):
    """The checkpoint's tensors do not match what the model needs."""


def _list_shown(names, n=8) -> str:
    names = sorted(names)
    more = f" (and {len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def tensor_index(path: str | os.PathLike) -> dict[str, Path]:
    """Tensor name -> safetensors file, for a single file or a sharded index."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = {path / fn for fn in weight_map.values()}
        for fn in files:
            if not fn.exists():
                raise CheckpointError(f"{index} names shard {fn.name}, which does not exist")
        return {name: path / fn for name, fn in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    out: dict[str, Path] = {}
    for fn in files:
        with safe_open(fn, "np") as f:
            for name in f.keys():
                if name in out:
                    raise CheckpointError(f"tensor {name} appears in both {out[name].name} and {fn.name}")
                out[name] = fn
    return out


class _Reader:
    """Reads tensors as numpy arrays, keeping one open handle per shard."""

    def __init__(self, index: dict[str, Path]):
        self.index = index
        self._open = {}

    def __call__(self, name: str) -> np.ndarray:
        fn = self.index[name]
        if fn not in self._open:
            self._open[fn] = safe_open(fn, "np")
        return self._open[fn].get_tensor(name)


def load_config(path: str | os.PathLike) -> ModelConfig:
    cfg_path = Path(path) / "config.json"
    if not cfg_path.exists():
        raise ConfigError(f"{path} has no config.json")
    with open(cfg_path) as f:
        raw = json.load(f)
    if raw.get("quantization_config"):
        q = raw["quantization_config"]
        kind = q.get("quant_method") or q.get("format") or "unknown"
        raise ConfigError(f"pre-quantized checkpoints ({kind}) are not supported yet; give a BF16/FP32 checkpoint")
    return ModelConfig.from_dict(raw)


def load_model(path: str | os.PathLike, dtype=jnp.float32, mesh: Mesh | None = None):
    """-> (ModelConfig, model) with every parameter read from the checkpoint at `path`."""
    cfg = load_config(path)
    arch = get_architecture(cfg)
    abstract = nnx.eval_shape(lambda: arch.build(cfg, dtype, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = {"/".join(str(k) for k in p): v for p, v in nnx.to_flat_state(state)}

    specs = {s.target: s for s in arch.weight_map(cfg)}
    if set(specs) != set(flat):  # a bug in the name map, not in the checkpoint
        raise AssertionError(
            f"{cfg.architecture} weight map out of sync with the model: "
            f"unmapped {_list_shown(set(flat) - set(specs))}; unknown {_list_shown(set(specs) - set(flat))}"
        )
    index = tensor_index(path)
    needed = {n for s in specs.values() for n in s.sources}
    missing = needed - set(index)
    if missing:
        raise CheckpointError(f"checkpoint {path} is missing {len(missing)} tensor(s): {_list_shown(missing)}")
    unexpected = {n for n in index if n not in needed and not arch.skip_tensor(cfg, n)}
    if unexpected:
        raise CheckpointError(
            f"checkpoint {path} has {len(unexpected)} unexpected tensor(s): {_list_shown(unexpected)}"
        )

    read = _Reader(index)
    loaded = []
    for p, var in nnx.to_flat_state(state):
        key = "/".join(str(k) for k in p)
        spec = specs[key]
        want = var.get_value()
        arr = spec.build(*(read(n) for n in spec.sources))
        if tuple(arr.shape) != tuple(want.shape):
            raise CheckpointError(
                f"{_list_shown(spec.sources, 2)} gives shape {tuple(arr.shape)} for {key}, expected {tuple(want.shape)}"
            )
        arr = np.asarray(arr).astype(want.dtype)
        if mesh is not None:
            value = jax.device_put(arr, named(mesh, var.get_metadata()["logical_axes"], arr.shape, key))
        else:
            value = jnp.asarray(arr)
        loaded.append((p, var.replace(value)))
    model = nnx.merge(graphdef, nnx.from_flat_state(loaded))
    return cfg, model
