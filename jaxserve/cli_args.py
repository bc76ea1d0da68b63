"""Command-line options and set-up shared by generate, serve, bench and experiment: per-phase weight formats,
the matmul and attention backends, presets and the KV memory budget (EngineConfig fields; see
README), virtual CPU devices and the persistent compile cache."""
from __future__ import annotations

import os


def add_format_args(p, skip: tuple[str, ...] = ()) -> None:
    """Per-phase weight formats, matmul and attention backends, KV budget, preset (generate, serve,
    bench, experiment); ``skip`` names flags a command defines its own way (their value is then None)."""
    add = _skipping(p, skip)
    add("--prefill-weights", default=None,
        help="prefill weight format: bf16 | int8 | fp8_e4m3 | fp8:block128 (default: as loaded)")
    add("--decode-weights", default=None,
        help="decode weight format: bf16 | int8 | fp8_e4m3 | fp8:block128 | int4:g32|g64|g128 "
             "(default: as loaded)")
    add("--prefill-from-decode-weights", action="store_true",
        help="prefill reads the decode copy (e.g. int4): one resident weight copy instead of two")
    add("--matmul-backend", default="auto", choices=["auto", "cpu", "gpu", "interpret"],
        help="quantized matmul formulations (auto: gpu on a GPU host, else cpu)")
    add("--kv-cache-memory", default=None,
        help="KV pool size in bytes (48GiB, 512MiB, ...): decides the page count for the KV format")
    add("--memory-fraction", type=float, default=None,
        help="KV pool = this fraction of the memory free after loading (GPU: device; CPU: available RAM)")
    add("--attention-backend", default=None, choices=["xla", "pallas", "pallas_interpret"],
        help="attention over the paged cache, prefill and decode (default: pallas on a GPU, else xla)")
    add("--preset", default=None,
        help="a named configuration: article (fp8 KV, fp8 prefill, int4 decode) | cpu (bf16 prefill, int8 decode)")


def _skipping(p, skip):
    def add(flag, **kw):
        if flag not in skip:
            p.add_argument(flag, **kw)
    return add


def format_kwargs(args) -> dict:
    """The engine keyword arguments these flags give (a flag the command skipped reads as unset)."""
    get = lambda name: getattr(args, name, None)  # noqa: E731
    kw = dict(prefill_weights=get("prefill_weights"), decode_weights=get("decode_weights"),
              matmul_backend=get("matmul_backend") or "auto", attention_backend=get("attention_backend"),
              kv_cache_memory=get("kv_cache_memory"), memory_fraction=get("memory_fraction"),
              prefill_from_decode_weights=bool(get("prefill_from_decode_weights")))
    if get("preset") is not None:
        kw["preset"] = get("preset")
    return kw


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
