"""Command-line options and set-up shared by generate, serve, bench, experiment and convert: the
model flags (``ModelOptions``: one declaration, each command's defaults), the engine flags, built
from EngineConfig's fields (one source for names, defaults and help), the KV format and presets;
virtual CPU devices, the persistent compile cache and the program cache."""
from __future__ import annotations

import dataclasses
import os


# The engine fields the format options cover (experiments sweep some of them).
FORMAT_FIELDS = ("prefill_weights", "decode_weights", "prefill_from_decode_weights", "matmul_backend",
                 "kv_cache_memory", "memory_fraction", "attention_backend")
PRESET_HELP = ("a named configuration: article (fp8 KV, fp8 prefill, int4 decode) | cpu (bf16 prefill, int8 decode, "
               "bf16 tied head; the default for the embedded default model on CPU) | as-loaded (the weights as loaded)")
# Flags that choose a weight representation: with none of them (nor --model, --kv-format,
# --dtype) the embedded default model on CPU runs the "cpu" preset (llm.PRESETS, "default").
WEIGHT_CHOICES = ("prefill_weights", "decode_weights", "prefill_from_decode_weights", "quantize_tied_head",
                  "tied_head_weights", "preset")
KV_FORMAT_HELP = "bf16 | fp8_e4m3 | float32 (default: what a converted checkpoint or --preset holds, else bf16)"


OMIT = "omit"  # a ModelOptions field the command takes no flag for
MODEL_HELP = "Hugging Face-format checkpoint directory; default: the embedded SmolLM2-135M-Instruct"
DTYPE_HELP = "activations and loaded weights"
AUTO_DTYPE_HELP = DTYPE_HELP + " (auto: bfloat16 on a GPU, float32 elsewhere)"


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """The model flags of one command, generated from one declaration: ``--model``, ``--dtype``,
    ``--num-devices`` and ``--kv-format``, with that command's defaults (a field set to ``OMIT``:
    the command has no such flag). ``--dtype`` offers auto where auto is the default. ``helps``:
    (flag, help) pairs where a command says more than the shared help."""

    model: str | None = None
    dtype: str = "float32"
    num_devices: int | None = OMIT
    kv_format: str | None = OMIT
    helps: tuple[tuple[str, str], ...] = ()

    def add_to(self, p) -> None:
        helps = dict(self.helps)
        if self.model != OMIT:
            p.add_argument("--model", default=self.model, help=helps.get("--model", MODEL_HELP))
        if self.dtype != OMIT:
            auto = self.dtype == "auto"
            p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"] if auto else ["float32", "bfloat16"],
                           default=self.dtype, help=helps.get("--dtype", AUTO_DTYPE_HELP if auto else DTYPE_HELP))
        if self.num_devices != OMIT:
            p.add_argument("--num-devices", type=int, default=self.num_devices, help=helps.get("--num-devices"))
        if self.kv_format != OMIT:
            p.add_argument("--kv-format", default=self.kv_format, help=helps.get("--kv-format"))


def flag_of(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def add_engine_args(p, fields: tuple[str, ...] | None = None, skip: tuple[str, ...] = ()) -> None:
    """One flag per EngineConfig field (name, help and default from the field), all unset by
    default so the config's own defaults apply; ``fields`` limits them, ``skip`` names flags a
    command defines its own way. Plus --kv-format and --preset (LLM arguments)."""
    from jaxserve.engine.config import EngineConfig

    for f in dataclasses.fields(EngineConfig):
        flag = flag_of(f)
        if not f.metadata.get("cli", True) or flag in skip or (fields is not None and f.name not in fields):
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_ = f.metadata["help"] + ("" if default is None else f" (default: {default})")
        if isinstance(default, bool):
            p.add_argument(flag, dest=f.name, action="store_const", const=not flag.startswith("--no-"), default=None,
                           help=f.metadata["help"])
        else:
            typ = f.metadata.get("type") or type(default)
            p.add_argument(flag, dest=f.name, type=typ, default=None, choices=f.metadata.get("choices"), help=help_)
    for flag, help_ in (("--kv-format", KV_FORMAT_HELP), ("--preset", PRESET_HELP)):
        if flag not in skip and (fields is None or flag.lstrip("-").replace("-", "_") in fields):
            p.add_argument(flag, default=None, help=help_)


def add_format_args(p, skip: tuple[str, ...] = ()) -> None:
    """The weight-format, backend, KV-budget and preset flags alone (``add_engine_args``)."""
    add_engine_args(p, fields=FORMAT_FIELDS + ("preset",), skip=skip)


def engine_kwargs(args, fields: tuple[str, ...] | None = None) -> dict:
    """The EngineConfig arguments (and preset) the command line set; unset flags are left out,
    so the config's defaults (or a preset's values) apply."""
    from jaxserve.engine.config import EngineConfig

    names = [f.name for f in dataclasses.fields(EngineConfig) if f.metadata.get("cli", True)] + ["preset"]
    return {n: getattr(args, n) for n in names
            if (fields is None or n in fields) and getattr(args, n, None) is not None}


def with_default_config(args, kwargs: dict) -> dict:
    """``kwargs`` with ``preset="default"`` (the "cpu" preset on a CPU backend, the weights as
    loaded elsewhere) where nothing chose a representation: the
    embedded default model (no --model), no weight, preset, KV format or dtype flag, on CPU. The
    preset is measured on that model only (decode KL 0.020 nats/token against float32 on the
    quality experiment, BENCHMARKS.md issue 28); another checkpoint stays as loaded."""
    if (getattr(args, "model", None) is not None or getattr(args, "kv_format", None) is not None
            or getattr(args, "dtype", "auto") not in (None, "auto") or any(k in kwargs for k in WEIGHT_CHOICES)):
        return kwargs
    return {**kwargs, "preset": "default"}  # LLM resolves it once its backend is known


def engine_flags(args) -> list[str]:
    """The engine flags the command line set, spelled for another command line (a server
    subprocess launched with the same engine)."""
    from jaxserve.engine.config import EngineConfig

    out = []
    for f in dataclasses.fields(EngineConfig):
        value = getattr(args, f.name, None)
        if value is None or not f.metadata.get("cli", True):
            continue
        out += [flag_of(f)] if isinstance(value, bool) else [flag_of(f), str(value)]
    for name in ("kv_format", "preset"):
        if getattr(args, name, None) is not None:
            out += ["--" + name.replace("_", "-"), getattr(args, name)]
    return out


def format_kwargs(args) -> dict:
    """The format, backend, budget and preset arguments the command line set."""
    return engine_kwargs(args, FORMAT_FIELDS + ("preset",))


def ensure_cpu_devices(n: int) -> None:
    """Ask XLA's host platform for n devices (no effect on GPU). Must run before jax import."""
    flags = os.environ.get("XLA_FLAGS", "")
    if n > 1 and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def enable_compile_cache() -> None:
    """Persist compiled programs across runs (~/.cache/jaxserve/xla, or $JAXSERVE_CACHE_DIR/xla)."""
    import jax

    from jaxserve.checkpoint.gguf import cache_root

    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(cache_root() / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def with_program_cache(kwargs: dict) -> dict:
    """The engine arguments with the command line's default program cache
    (``<cache>/programs``: $JAXSERVE_CACHE_DIR or ~/.cache/jaxserve) unless one was given, and
    the caches set up: jax's own persistent cache only when the program cache is off. (On CPU
    an executable that jax loaded from its own cache serializes incomplete, so the program
    cache cannot keep it: with both on, a program jax had cached would come from jax's cache
    on every start, traced and lowered each time, and never enter the program cache.)"""
    from jaxserve.checkpoint.gguf import cache_root

    kwargs = {"program_cache": str(cache_root() / "programs"), **kwargs}
    if kwargs["program_cache"] in (None, "off"):
        enable_compile_cache()
    return kwargs
