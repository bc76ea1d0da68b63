"""Command-line options and set-up shared by generate, serve and bench: per-phase weight formats,
the matmul and attention backends, presets and the KV memory budget (EngineConfig fields; see
README), virtual CPU devices and the persistent compile cache."""
from __future__ import annotations

import os


def add_format_args(p) -> None:
    """Per-phase weight formats, matmul and attention backends, KV budget, preset (generate, serve, bench)."""
    p.add_argument("--prefill-weights", default=None,
                   help="prefill weight format: bf16 | int8 | fp8_e4m3 | fp8:block128 (default: as loaded)")
    p.add_argument("--decode-weights", default=None,
                   help="decode weight format: bf16 | int8 | fp8_e4m3 | fp8:block128 | int4:g32|g64|g128 "
                        "(default: as loaded)")
    p.add_argument("--prefill-from-decode-weights", action="store_true",
                   help="prefill reads the decode copy (e.g. int4): one resident weight copy instead of two")
    p.add_argument("--matmul-backend", default="auto", choices=["auto", "cpu", "gpu", "interpret"],
                   help="quantized matmul formulations (auto: gpu on a GPU host, else cpu)")
    p.add_argument("--kv-cache-memory", default=None,
                   help="KV pool size in bytes (48GiB, 512MiB, ...): decides the page count for the KV format")
    p.add_argument("--memory-fraction", type=float, default=None,
                   help="KV pool = this fraction of the memory free after loading (GPU: device; CPU: available RAM)")
    p.add_argument("--attention-backend", default=None, choices=["xla", "pallas", "pallas_interpret"],
                   help="decode attention (default: pallas on a GPU, else xla)")
    p.add_argument("--preset", default=None,
                   help="a named configuration: article (fp8 KV, fp8 prefill, int4 decode) | cpu (bf16 prefill, int8 decode)")


def format_kwargs(args) -> dict:
    kw = dict(prefill_weights=args.prefill_weights, decode_weights=args.decode_weights,
              matmul_backend=args.matmul_backend, attention_backend=args.attention_backend,
              kv_cache_memory=args.kv_cache_memory, memory_fraction=args.memory_fraction,
              prefill_from_decode_weights=args.prefill_from_decode_weights)
    if args.preset is not None:
        kw["preset"] = args.preset
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
