"""Load a Hugging Face safetensors checkpoint directory into a jaxserve model.

The architecture's explicit name map (``weight_map``) says which HF tensors build each of
our parameters. Before reading any data the loader checks both directions: every tensor
the map needs must exist (a missing one is an error naming it) and every tensor in the
files must be used or deliberately skipped (an unexpected one is an error naming it).
Parameters are never left at their random initial values. A multimodal wrapper (Kimi
K2.5's ``kimi_k25``) loads its text model: config from ``text_config``, tensors renamed from
the wrapper's names and its vision tensors skipped (``jaxserve.checkpoint.multimodal``).

Pre-quantized checkpoints (FP8 block-scaled as DeepSeek-V3/GLM ship, compressed-tensors
int4 as Kimi K2 ships; see ``jaxserve.checkpoint.prequantized``) load in their own format:
each quantized matmul weight becomes a ``PhaseWeight`` (our fp8:block128 / int4:g<G>) in
its Variable, and the runner keeps it unless a phase asks for another format. A
jaxserve-converted orbax checkpoint (``jaxserve convert``) is detected by its metadata file
and restored by ``jaxserve.checkpoint.orbax_io``.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxserve.checkpoint import multimodal, prequantized
from jaxserve.checkpoint.prequantized import CheckpointError  # noqa: F401  (defined there, public here)
from jaxserve.checkpoint.safetensors_io import SafetensorsFile
from jaxserve.config import ConfigError, ModelConfig
from jaxserve.models import config_from_dict, get_architecture, text_model_config, wrapper_name
from jaxserve.quant.phase import PhaseWeight, matrix_view, place
from jaxserve.sharding import Mesh, config_for_mesh, named, pad_vocab, place as place_array, unpadded_shape


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
        for name in SafetensorsFile(fn).keys():
            if name in out:
                raise CheckpointError(f"tensor {name} appears in both {out[name].name} and {fn.name}")
            out[name] = fn
    return out


class _Reader:
    """Reads tensors as numpy arrays (bf16 / fp8 included), one parsed header per shard.
    `stored` renames a name the model asks for to the one in the file (multimodal wrappers)."""

    def __init__(self, index: dict[str, Path], stored: dict[str, str] | None = None):
        self.index = index
        self.stored = stored or {}
        self._open = {}

    def _file(self, name: str) -> SafetensorsFile:
        fn = self.index[name]
        if fn not in self._open:
            self._open[fn] = SafetensorsFile(fn)
        return self._open[fn]

    def __call__(self, name: str) -> np.ndarray:
        return self._file(name).get(self.stored.get(name, name))

    def dtype_code(self, name: str) -> str | None:
        return self._file(name).dtype_code(self.stored.get(name, name)) if name in self.index else None


def raw_config(path) -> dict:
    """A checkpoint directory's config.json as read (a multimodal wrapper's included)."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.exists():
        raise ConfigError(f"{path} has no config.json")
    with open(cfg_path) as f:
        return json.load(f)


def load_config(path: str | os.PathLike) -> ModelConfig:
    """The model config (a multimodal wrapper's text model's); a quantization_config must be one
    jaxserve loads (else ConfigError)."""
    text = text_model_config(raw_config(path))
    prequantized.parse_quantization_config(text.get("quantization_config"))
    return config_from_dict(text)


def _checkpoint_tensors(path, raw: dict) -> tuple[dict[str, Path], _Reader]:
    """(tensor name -> file, reader), named as the text model's own checkpoints name them: a
    multimodal wrapper's text tensors are renamed and its vision tensors skipped (logged)."""
    index = tensor_index(path)
    wrapper = wrapper_name(raw)
    if wrapper is None:
        return index, _Reader(index)
    text = multimodal.text_tensors(index, path, wrapper)
    return text.index, _Reader(text.index, text.stored)


def _names_note(read: _Reader) -> str:
    if not read.stored:
        return ""
    some = next(iter(read.stored.items()))
    return f" (named as the text model names them; this checkpoint stores e.g. {some[0]} as {some[1]})"


def load_model(path: str | os.PathLike, dtype=jnp.float32, mesh: Mesh | None = None, mtp: bool = False):
    """-> (ModelConfig, model) with every parameter read from the checkpoint at `path`.

    mtp: build and load the checkpoint's multi-token-prediction block as well (speculative
    decoding's drafts; ``mtp_config`` says why a checkpoint has none). Without it the MTP
    layers' tensors are skipped.

    Quantized tensors of a pre-quantized checkpoint load as PhaseWeights in their own format
    (not expanded to `dtype`); a jaxserve-converted checkpoint restores its stored phases.
    Under a mesh whose size does not divide the vocabulary, the embedding and LM head are
    zero-padded (``config_for_mesh``); the model cuts the padded ids' logits off.
    """
    from jaxserve.checkpoint import orbax_io  # late: orbax is only needed for converted checkpoints

    if orbax_io.is_jaxserve_checkpoint(path):
        return orbax_io.load_model(path, dtype, mesh)
    raw = raw_config(path)
    text = text_model_config(raw)
    scheme = prequantized.parse_quantization_config(text.get("quantization_config"))
    cfg = config_for_mesh(config_from_dict(text), mesh)
    index, read = _checkpoint_tensors(path, raw)
    if mtp:
        cfg = mtp_config(path, cfg, index)
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
    plans = {t: prequantized.plan_tensors(scheme, s, index.__contains__, read.dtype_code, read.stored.get)
             for t, s in specs.items()}
    _check_tensors(path, cfg, arch, scheme, index, plans, _names_note(read))

    values, transfers = {}, _Transfers()
    for p, var in nnx.to_flat_state(state):
        key = "/".join(str(k) for k in p)
        spec = specs[key]
        plan = plans[key]
        if plan.kind != "plain" and not plan.dense:
            values[key] = _load_quantized(cfg, plan, scheme, read, key, var, mesh)
            continue
        if plan.dense:  # kept in full precision, shipped quantized
            arr = spec.build(prequantized.dequantized_source(plan, scheme, read, key))
        else:
            arr = spec.build(*(read(n) for n in spec.sources))
        value = _load_plain(cfg, spec, arr, key, var, mesh)
        if isinstance(value, tuple):  # (host array, sharding or None): batched
            transfers.add(key, *value)
        else:
            values[key] = value
    values.update(transfers.flush())
    loaded = [(p, var.replace(values["/".join(str(k) for k in p)])) for p, var in nnx.to_flat_state(state)]
    model = nnx.merge(graphdef, nnx.from_flat_state(loaded))
    return cfg, model


def mtp_config(path, cfg: ModelConfig, index) -> ModelConfig:
    """``cfg`` with the MTP block built (``mtp_layers=1``), or a ConfigError naming why the
    checkpoint at ``path`` has none: its architecture, ``num_nextn_predict_layers``, or the
    layer's tensors."""
    arch, n = get_architecture(cfg), cfg.num_hidden_layers
    if not arch.mtp:
        raise ConfigError(f"--speculative mtp: {cfg.architecture} checkpoints' MTP layers are not supported "
                          "(DeepseekV3ForCausalLM and GlmMoeDsaForCausalLM only); use --speculative ngram")
    if cfg.num_nextn_predict_layers < 1:
        raise ConfigError(f"--speculative mtp: {path} has no MTP layers (config.json num_nextn_predict_layers = "
                          f"{cfg.num_nextn_predict_layers}); use --speculative ngram")
    if f"model.layers.{n}.eh_proj.weight" not in index:
        raise ConfigError(f"--speculative mtp: {path}'s config.json says num_nextn_predict_layers = "
                          f"{cfg.num_nextn_predict_layers}, but it has no MTP layer tensors (model.layers.{n}.*); "
                          "use --speculative ngram")
    return dataclasses.replace(cfg, mtp_layers=1)


class _Transfers:
    """Host arrays bound for this process's devices, sent in batches (``jax.device_put`` of a
    list: one transfer call per batch, not one per tensor; measured 2-3x faster for the default
    model) of at most ``budget`` bytes, so that host copies made for a dtype change never add
    up to a second copy of the model. A None sharding is the default device, uncommitted (as
    ``jnp.asarray``). ``flush`` -> {key: device array} of all added so far."""

    def __init__(self, budget: int = 1 << 30):
        self.budget, self.pending, self.pending_bytes, self.done = budget, [], 0, {}

    def add(self, key: str, arr: np.ndarray, sharding=None) -> None:
        self.pending.append((key, arr, sharding))
        self.pending_bytes += arr.nbytes
        if self.pending_bytes >= self.budget:
            self.flush()

    def flush(self) -> dict:
        import jax

        for placed in (False, True):
            batch = [(k, a, sh) for k, a, sh in self.pending if (sh is not None) == placed]
            if batch:
                keys, arrs, shardings = zip(*batch)
                out = jax.device_put(list(arrs), list(shardings)) if placed else jax.device_put(list(arrs))
                self.done.update(zip(keys, out))
        self.pending, self.pending_bytes = [], 0
        return self.done


def _check_tensors(path, cfg, arch, scheme, index, plans: dict, note: str = "") -> None:
    """Every tensor the plans read is in the checkpoint, every checkpoint tensor is read (or one
    the architecture skips), and a quantization_config is backed by quantized tensors."""
    needed = {n for p in plans.values() for n in p.names}
    missing = needed - set(index)
    if missing:
        raise CheckpointError(f"checkpoint {path} is missing {len(missing)} tensor(s): {_list_shown(missing)}{note}")
    unexpected = {n for n in index if n not in needed and not arch.skip_tensor(cfg, n)}
    if unexpected:
        raise CheckpointError(
            f"checkpoint {path} has {len(unexpected)} unexpected tensor(s): {_list_shown(unexpected)}{note}"
        )
    if scheme is not None and not prequantized.count_quantized(plans.values()):
        raise ConfigError(f"{path}: quantization_config says {scheme.method} ({scheme.weight_format}), "
                          "but no tensor in the checkpoint is stored quantized")


def _load_plain(cfg, spec, arr, key: str, var, mesh):
    """An unquantized parameter (``arr``, built from its checkpoint tensors) in the model's
    dtype, its vocabulary padded for the mesh: placed (a mesh over several processes), else
    (host array, sharding or None) for a batched transfer."""
    want = var.get_value()
    axes = var.get_metadata()["logical_axes"]
    if tuple(arr.shape) != tuple(unpadded_shape(cfg, want.shape, axes)):
        raise CheckpointError(
            f"{_list_shown(spec.sources, 2)} gives shape {tuple(arr.shape)} for {key}, "
            f"expected {tuple(unpadded_shape(cfg, want.shape, axes))}"
        )
    sharding = None if mesh is None else named(mesh, axes, want.shape, key)
    if sharding is not None and not sharding.is_fully_addressable:  # each process its own slices
        if tuple(arr.shape) == tuple(want.shape):  # converted slice by slice where placed
            return place_array(arr, sharding, want.dtype)
        return place_array(pad_vocab(np.asarray(arr).astype(want.dtype), axes, want.shape, key), sharding)
    # This process's devices hold it all: the host array, sent with others (_Transfers).
    return pad_vocab(np.asarray(arr).astype(want.dtype), axes, want.shape, key), sharding


def _load_quantized(cfg, plan, scheme, read, key: str, var, mesh) -> PhaseWeight:
    """A quantized checkpoint tensor (or expert stack) -> PhaseWeight in its own format, placed."""
    shape = tuple(var.get_value().shape)
    axes = var.get_metadata().get("logical_axes") or (None,) * len(shape)
    if shape != unpadded_shape(cfg, shape, axes):
        raise CheckpointError(f"{key} is stored quantized, so its vocabulary ({cfg.vocab_size}) cannot be padded "
                              f"to {cfg.vocab_rows} to split over the devices: use a device count that divides it")
    mshape, maxes = matrix_view(key, shape, axes)
    qw = prequantized.build_quantized(plan, scheme, read, mshape, key)
    return PhaseWeight(place(qw, maxes, mesh, key), shape)
