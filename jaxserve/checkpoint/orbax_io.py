"""jaxserve's own checkpoint: per-phase weight representations saved with orbax.

Layout of a converted checkpoint directory (written by ``jaxserve convert``)::

    config.json                the source's config (its quantization_config dropped)
    tokenizer.json, ...        copied from the source
    jaxserve_checkpoint.json   METADATA: formats per phase, every parameter's stored form
    state/                     orbax StandardCheckpointer directory

The orbax tree has up to three sections, ``shared`` (parameters both phases store the
same way: norms, embeddings, router, and matmul weights when the phases agree), ``prefill``
and ``decode`` (the phase-specific representations). A parameter path ``layers/3/attn/o``
is the nested key ``["layers"]["3"]["attn"]["o"]``; its leaf is an array (unquantized) or
``{"values": ..., "scales": ...}`` (a QuantizedWeight; no "scales" for bf16). The metadata
records each parameter's shape, format per phase and leaf shapes/dtypes, so a restore
builds its target (with shardings from the logical-axis rules) before reading a byte.

Why StandardCheckpointer: it saves and restores NNX state arrays bit-exact and restores
each array straight into the sharding its target names, fp8 and
uint8 included (checked on this machine with orbax-checkpoint 0.12.8).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

METADATA = "jaxserve_checkpoint.json"
STATE_DIR = "state"
FORMAT = "jaxserve-orbax"
VERSION = 1
SECTIONS = ("shared", "prefill", "decode")


def is_jaxserve_checkpoint(path) -> bool:
    return (Path(path) / METADATA).is_file()


def read_metadata(path) -> dict:
    from jaxserve.checkpoint.prequantized import CheckpointError

    with open(Path(path) / METADATA) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"{path}/{METADATA}: not a {FORMAT} v{VERSION} checkpoint "
                              f"(format {meta.get('format')!r}, version {meta.get('version')!r})")
    return meta


def _label_name(label) -> str:
    return label or "as loaded"


def resolve_llm_formats(model_path, kv_format, prefill_weights, decode_weights):
    """LLM arguments for a checkpoint: a converted one supplies its formats.

    -> (kv_format, prefill_weights, decode_weights). For a jaxserve checkpoint, an argument
    left None takes the checkpoint's value, and an explicit one that disagrees is a
    ValueError (the stored representations are used as they are, never requantized). Any
    other checkpoint: the arguments come back unchanged (kv_format None -> "bf16").
    """
    if model_path is None or not is_jaxserve_checkpoint(model_path):
        return kv_format or "bf16", prefill_weights, decode_weights
    from jaxserve.kv.formats import get_kv_format
    from jaxserve.quant.formats import get_weight_format

    meta = read_metadata(model_path)
    out = []
    for phase, given in (("prefill", prefill_weights), ("decode", decode_weights)):
        stored = meta[f"{phase}_weights"]
        if given is not None and get_weight_format(given).name != stored:
            raise ValueError(f"{model_path} was converted with {phase} weights {_label_name(stored)}; "
                             f"{phase}_weights={given!r} disagrees (convert the source again to change it)")
        out.append(stored)
    stored_kv = meta.get("kv_format")
    if kv_format is not None and stored_kv and get_kv_format(kv_format).name != get_kv_format(stored_kv).name:
        raise ValueError(f"{model_path} was converted for kv_format {stored_kv}; kv_format={kv_format!r} disagrees")
    return kv_format or stored_kv or "bf16", out[0], out[1]


# ----------------------------------------------------------------------------- saving


def _put(tree: dict, path: str, leaf) -> None:
    *parents, last = path.split("/")
    for k in parents:
        tree = tree.setdefault(k, {})
    tree[last] = leaf


def _get(tree: dict, path: str):
    for k in path.split("/"):
        tree = tree[k]
    return tree


def stored_leaf(value):
    """A phase value (array or PhaseWeight) -> (orbax leaf, format name or None)."""
    from jaxserve.quant.phase import PhaseWeight

    if isinstance(value, PhaseWeight):
        leaf = {"values": value.qw.values}
        if value.qw.scales is not None:
            leaf["scales"] = value.qw.scales
        return leaf, value.qw.format
    return value, None


def _describe(leaf):
    import jax.numpy as jnp

    if isinstance(leaf, dict):
        return {k: _describe(v) for k, v in leaf.items()}
    return [list(leaf.shape), jnp.dtype(leaf.dtype).name]


def save(dst, values: dict, shapes: dict, meta: dict) -> None:
    """Write the orbax state and the metadata file.

    values: parameter path -> {"shared": value} or {"prefill": value, "decode": value}
    (value: array or PhaseWeight); shapes: path -> parameter shape; meta: top-level
    metadata (formats, dtype, source, sizes), completed here with the per-parameter table.
    """
    import orbax.checkpoint as ocp

    tree: dict = {s: {} for s in SECTIONS}
    params = {}
    for path, by_section in values.items():
        entry = {"shape": list(shapes[path]), "leaves": {}}
        for section, value in by_section.items():
            leaf, fmt = stored_leaf(value)
            _put(tree[section], path, leaf)
            entry["leaves"][section] = _describe(leaf)
            phases = ("prefill", "decode") if section == "shared" else (section,)
            for phase in phases:
                entry[phase] = fmt
        entry["shared"] = "shared" in by_section
        params[path] = entry
    tree = {s: t for s, t in tree.items() if t}  # orbax wants no empty sections
    dst = Path(dst).absolute()
    with ocp.StandardCheckpointer() as ck:
        ck.save(dst / STATE_DIR, tree)
        ck.wait_until_finished()
    meta = dict(meta, format=FORMAT, version=VERSION, params=params)
    with open(dst / METADATA, "w") as f:
        json.dump(meta, f, indent=1)


# ----------------------------------------------------------------------------- loading


def _target(desc, sharding):
    import jax
    import jax.numpy as jnp

    shape, dtype = desc
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)


def load_model(path, dtype=None, mesh=None):
    """Restore a converted checkpoint -> (ModelConfig, model).

    Parameters both phases share are plain arrays / PhaseWeights; phase-specific ones are
    PhaseSets that ``quantize_state`` resolves per phase. Stored bytes come back bit-exact,
    each array directly in its sharding under `mesh` (logical-axis rules; QuantizedWeight
    fields by ``quant.phase.qw_shardings``). Unquantized arrays are cast to the model `dtype` if the
    checkpoint stored another (quantized ones never change).
    """
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from flax import nnx

    from jaxserve.checkpoint.prequantized import CheckpointError
    from jaxserve.models import config_from_dict, get_architecture
    from jaxserve.quant.phase import PhaseSet
    from jaxserve.sharding import config_for_mesh

    dtype = dtype or jnp.float32
    meta = read_metadata(path)
    with open(Path(path) / "config.json") as f:
        cfg = config_for_mesh(config_from_dict(json.load(f)), mesh)
    arch = get_architecture(cfg)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: arch.build(cfg, dtype, nnx.Rngs(0))))
    flat = list(nnx.to_flat_state(state))
    keys = {"/".join(str(k) for k in p) for p, _ in flat}
    params = meta["params"]
    if keys != set(params):
        raise CheckpointError(f"{path}: stored parameters do not match the {cfg.architecture} model: "
                              f"missing {sorted(keys - set(params))[:8]}, unexpected {sorted(set(params) - keys)[:8]}")
    target = _restore_target(path, cfg, flat, params, mesh)
    with ocp.StandardCheckpointer() as ck:
        restored = ck.restore(Path(path).absolute() / STATE_DIR, target)
    labels = (meta["prefill_weights"], meta["decode_weights"])
    loaded = []
    for p, var in flat:
        key = "/".join(str(k) for k in p)
        entry = params[key]
        if entry["shared"]:
            v = _restored_value(restored, "shared", key, entry["prefill"], var, mesh)
        else:
            v = PhaseSet(labels, tuple(_restored_value(restored, ph, key, entry[ph], var, mesh)
                                       for ph in ("prefill", "decode")))
        loaded.append((p, var.replace(v)))
    return cfg, nnx.merge(graphdef, nnx.from_flat_state(loaded))


def _restore_target(path, cfg, flat, params: dict, mesh) -> dict:
    """{section: nested {key: ShapeDtypeStruct leaves}}: what orbax restores, each leaf in its
    sharding (one device for a vocabulary that is padded after restoring)."""
    import jax

    from jaxserve.checkpoint.prequantized import CheckpointError
    from jaxserve.quant.phase import matrix_view, qw_shardings
    from jaxserve.quant.qweight import QuantizedWeight
    from jaxserve.sharding import named, unpadded_shape

    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target: dict = {}
    for p, var in flat:
        key = "/".join(str(k) for k in p)
        entry = params[key]
        shape = tuple(var.get_value().shape)
        axes = var.get_metadata().get("logical_axes") or (None,) * len(shape)
        stored = unpadded_shape(cfg, shape, axes)  # the vocabulary without padding for the mesh
        if tuple(entry["shape"]) != stored:
            raise CheckpointError(f"{path}: {key} is stored with shape {tuple(entry['shape'])}, model has {stored}")
        for section, desc in entry["leaves"].items():
            fmt = entry["prefill" if section == "shared" else section]
            if fmt is None:  # a vocabulary to pad is restored on one device, padded, then placed
                sh = named(mesh, axes, shape, key) if mesh is not None and stored == shape else single
                leaf = _target(desc, sh)
            elif stored != shape:
                raise CheckpointError(f"{path}: {key} is stored as {fmt}, so its vocabulary ({cfg.vocab_size}) "
                                      f"cannot be padded to {cfg.vocab_rows} to split over the devices: "
                                      "use a device count that divides it")
            else:
                mshape, maxes = matrix_view(key, shape, axes)
                qw = QuantizedWeight(_target(desc["values"], None),
                                     _target(desc["scales"], None) if "scales" in desc else None, fmt, mshape)
                if mesh is not None:
                    shs = qw_shardings(qw, maxes, mesh, key)
                    leaf = {f: _target(desc[f], getattr(shs, f)) for f in desc}
                else:
                    leaf = {f: _target(desc[f], single) for f in desc}
            _put(target.setdefault(section, {}), key, leaf)
    return target


def _restored_value(restored: dict, section: str, key: str, fmt, var, mesh):
    """One restored parameter as the model holds it: a plain array in the variable's dtype
    (its vocabulary padded for the mesh if needed), or a quantized phase weight."""
    import jax
    import numpy as np

    from jaxserve.quant.phase import matrix_view, phase_weight
    from jaxserve.quant.qweight import QuantizedWeight
    from jaxserve.sharding import named, pad_vocab

    leaf = _get(restored[section], key)
    shape = tuple(var.get_value().shape)
    axes = var.get_metadata().get("logical_axes") or (None,) * len(shape)
    if fmt is None:
        want = var.get_value().dtype
        leaf = leaf if leaf.dtype == want else leaf.astype(want)
        if tuple(leaf.shape) == shape:
            return leaf
        padded = pad_vocab(np.asarray(jax.device_get(leaf)), axes, shape, key)
        return jax.device_put(padded, named(mesh, axes, shape, key))
    qw = QuantizedWeight(leaf["values"], leaf.get("scales"), fmt, matrix_view(key, shape, axes)[0])
    return phase_weight(key, qw, shape)


def describe(path) -> str:
    """One line naming a converted checkpoint's formats (for logs and errors)."""
    meta = read_metadata(path)
    return (f"{os.fspath(path)}: prefill {_label_name(meta['prefill_weights'])}, "
            f"decode {_label_name(meta['decode_weights'])}, kv {meta.get('kv_format') or 'unset'}")
