"""``jaxserve convert SRC DST``: a checkpoint becomes a jaxserve orbax checkpoint holding
the chosen weight representation for each phase.

SRC: a Hugging Face directory (plain, or pre-quantized FP8 / compressed-tensors int4) or a
converted jaxserve checkpoint. Each phase's format (``--prefill-weights``,
``--decode-weights``) is built once, here, so that loading DST never requantizes; a phase
left unset keeps the weights as loaded (for a jaxserve SRC: the format SRC stored for that
phase). A parameter both phases store identically is saved once ("shared"). The size
report gives the bytes of each section and each phase's total (shared + its own).

Layout and restore: ``jaxserve.checkpoint.orbax_io``. Formats: ``jaxserve.quant``.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

# Source files that are not copied: weights (re-stored by orbax), the config (rewritten)
# and a jaxserve source's own state.
_NOT_COPIED = {"config.json", "model.safetensors.index.json", "jaxserve_checkpoint.json"}
_DTYPES = ("float32", "bfloat16")


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _nbytes(value) -> int:
    import jax
    import numpy as np

    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(value))


def size_report(sizes: dict) -> str:
    """A table of the bytes per section and per format, and each phase's total."""
    lines = [f"{'section':<9} {'representation':<22} {'bytes':>12}"]
    for section in ("shared", "prefill", "decode"):
        for rep, n in sorted(sizes["by_format"].get(section, {}).items()):
            lines.append(f"{section:<9} {rep:<22} {_fmt_bytes(n):>12}")
    lines.append(f"prefill weights (shared + prefill): {_fmt_bytes(sizes['prefill_total'])}; "
                 f"decode weights (shared + decode): {_fmt_bytes(sizes['decode_total'])}; "
                 f"stored: {_fmt_bytes(sizes['stored_total'])}")
    return "\n".join(lines)


def _phase_formats(src, prefill_weights, decode_weights) -> dict:
    """Each phase's label (canonical format name, or None = as loaded)."""
    from jaxserve.checkpoint import orbax_io
    from jaxserve.quant.formats import get_weight_format

    given = {"prefill": prefill_weights, "decode": decode_weights}
    src_meta = orbax_io.read_metadata(src) if orbax_io.is_jaxserve_checkpoint(src) else {}
    return {ph: get_weight_format(g).name if g is not None else src_meta.get(f"{ph}_weights")
            for ph, g in given.items()}


def convert(src, dst, prefill_weights: str | None = None, decode_weights: str | None = None,
            kv_format: str | None = None, dtype: str = "float32", overwrite: bool = False,
            progress: bool = True) -> dict:
    """Convert SRC into a jaxserve checkpoint at DST; returns the sizes (see size_report)."""
    import jax.numpy as jnp

    from jaxserve.checkpoint import orbax_io
    from jaxserve.engine.llm_engine import EngineConfig
    from jaxserve.kv.formats import get_kv_format
    from jaxserve.loader import load_model, raw_config

    src, dst = Path(src), Path(dst)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src} is not a checkpoint directory (no config.json)")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    if dst.exists() and any(dst.iterdir()):
        if not overwrite:
            raise ValueError(f"{dst} exists and is not empty (pass overwrite / --overwrite to replace it)")
        shutil.rmtree(dst)
    labels = _phase_formats(src, prefill_weights, decode_weights)
    # The engine's per-phase rules (e.g. no int4 prefill) apply to what we store.
    EngineConfig(prefill_weights=labels["prefill"], decode_weights=labels["decode"])
    kv = get_kv_format(kv_format).name if kv_format is not None else None
    if kv is None and orbax_io.is_jaxserve_checkpoint(src):
        kv = orbax_io.read_metadata(src).get("kv_format")

    _, model = load_model(src, {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype])
    values, shapes, by_format = _stored_values(model, labels, progress)
    section_bytes = {s: sum(by_format.get(s, {}).values()) for s in ("shared", "prefill", "decode")}
    sizes = {
        "by_format": by_format,
        "sections": section_bytes,
        "prefill_total": section_bytes["shared"] + section_bytes["prefill"],
        "decode_total": section_bytes["shared"] + section_bytes["decode"],
        "stored_total": sum(section_bytes.values()),
    }

    dst.mkdir(parents=True, exist_ok=True)
    raw = raw_config(src)
    source_quant = (raw.pop("quantization_config", None) or {}).get("quant_method")
    with open(dst / "config.json", "w") as f:
        json.dump(raw, f, indent=2)
    for fn in sorted(src.iterdir()):  # tokenizer, generation config, chat template, ...
        if fn.is_file() and fn.name not in _NOT_COPIED and fn.suffix != ".safetensors":
            shutil.copy2(fn, dst / fn.name)
    meta = {
        "prefill_weights": labels["prefill"], "decode_weights": labels["decode"], "kv_format": kv,
        "dtype": dtype, "source": {"path": str(src), "quant_method": source_quant}, "sizes": sizes,
    }
    orbax_io.save(dst, values, shapes, meta)
    return sizes


def _stored_values(model, labels: dict, progress: bool) -> tuple[dict, dict, dict]:
    """Each parameter in each phase's format -> (values {path: {"shared"} or {"prefill", "decode"}},
    shapes {path: shape}, stored bytes {section: {representation: bytes}})."""
    import jax.numpy as jnp
    from flax import nnx
    from tqdm import tqdm

    from jaxserve.checkpoint import orbax_io
    from jaxserve.quant.formats import get_weight_format
    from jaxserve.quant.phase import PhaseSet, phase_value

    _, state = nnx.split(model)
    fmts = {ph: get_weight_format(lab) if lab is not None else None for ph, lab in labels.items()}
    values, shapes, by_format = {}, {}, {}
    for p, var in tqdm(list(nnx.to_flat_state(state)), desc="convert", unit="param", disable=not progress):
        path = "/".join(str(k) for k in p)
        v = var.get_value()
        axes = var.get_metadata().get("logical_axes")
        per = {}
        for ph in ("prefill", "decode"):
            src_v = v
            if isinstance(v, PhaseSet):  # a jaxserve source: its member for this label, else its best one
                src_v = v.pick(labels[ph]) if labels[ph] in v.labels else max(v.members, key=_nbytes)
            if ph == "decode" and labels["decode"] == labels["prefill"]:
                per[ph] = per["prefill"]  # same format: same value, stored once
            else:
                per[ph] = phase_value(path, src_v, axes, fmts[ph], None)  # a tied table stays as loaded
        entry = {"shared": per["prefill"]} if per["prefill"] is per["decode"] else per
        values[path] = entry
        shapes[path] = tuple(per["prefill"].shape)
        for section, val in entry.items():
            leaf, fmt = orbax_io.stored_leaf(val)
            rep = fmt or f"unquantized {jnp.dtype(_leaf_dtype(leaf)).name}"
            by_format.setdefault(section, {}).setdefault(rep, 0)
            by_format[section][rep] += _nbytes(leaf)
    return values, shapes, by_format


def _leaf_dtype(leaf):
    return leaf["values"].dtype if isinstance(leaf, dict) else leaf.dtype


# ----------------------------------------------------------------------------- CLI


def register(subparsers) -> None:
    """Add the ``convert`` subcommand (cli.py calls this)."""
    from jaxserve.cli_args import OMIT, ModelOptions

    p = subparsers.add_parser(
        "convert", help="convert a checkpoint into a jaxserve orbax checkpoint with per-phase weight formats",
        description=__doc__.splitlines()[0].replace("``", ""),
    )
    p.add_argument("src", help="Hugging Face checkpoint directory (plain, FP8 or compressed-tensors int4) "
                               "or a jaxserve checkpoint")
    p.add_argument("dst", help="output directory (new or empty)")
    p.add_argument("--prefill-weights", default=None,
                   help="prefill weight format: bf16 | fp8 (per channel) | fp8:block128; default: as loaded")
    p.add_argument("--decode-weights", default=None,
                   help="decode weight format: bf16 | fp8 | fp8:block128 | int4:g32 | int4:g64 | int4:g128 "
                        "(int4 = int4:g128); default: as loaded")
    ModelOptions(model=OMIT, dtype="float32", kv_format=None, helps=(
        ("--kv-format", "KV cache format recorded for serving (bf16 | fp8_e4m3)"),
        ("--dtype", "dtype of the weights stored unquantized (norms, embeddings, ...); default float32, "
                    "as `jaxserve generate` loads"))).add_to(p)
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_convert)


def run_convert(args) -> int:
    import sys
    import time

    t0 = time.perf_counter()
    sizes = convert(args.src, args.dst, args.prefill_weights, args.decode_weights, args.kv_format,
                    args.dtype, args.overwrite, progress=not args.no_progress)
    from jaxserve.checkpoint.orbax_io import describe

    print(describe(args.dst))
    print(size_report(sizes))
    print(f"converted in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0
