"""jaxserve's native CPU kernels: small-batch matmuls on the stored weight bytes, as XLA FFI
custom calls inside the jitted programs.

The C++ source is ``csrc/matmul.cc``; the normal install (``pip install -e .``, i.e.
``scripts/setup.sh``) compiles it into ``_kernels*.so`` next to this file (setup.py, XLA's FFI
headers from ``jax.ffi.include_dir()``). ``status()`` loads it once, asks it which copy of the
kernels the CPU runs (cpuid: AMX tiles with AMX-BF16, AMX-INT8, AVX512-BF16 and VBMI on top of
AVX512-VNNI, with Linux's leave to use the tile state; AVX-512 F/BW/VL/DQ with AVX512-VNNI;
AVX-512 without; else AVX2; all with FMA and F16C; ``JAXSERVE_NATIVE_ISA=avx512-vnni``,
``=avx512`` or ``=avx2`` caps it) and registers the handlers for the CPU platform; when
any of that fails, or ``JAXSERVE_NATIVE=0`` is set, ``available()`` is False, the reason is
logged once, and the matmul registry keeps XLA's own formulations.

Entry points (x f32 [M, K]; all return f32 [M, N] except ``w8a8_s32``):
- ``int4_w4a16(x, packed, scales, group)``: jaxserve's int4 group layout (group a multiple of
  4), x padded to Kp, as W4A8: each row of x quantized to int8 per group of ``group`` k
  (d = amax / 127, rint(x / d)), exact int32 group dots, then the weight and activation scales
  in f32;
- ``int8_w8a16(x, q, scales)``: int8 per channel as W8A8 (x quantized to int8 per row as above,
  exact int32 dots, scales on the result; the numerics of XLA's W8A8 path);
  both integer kernels use vpdpbusd where cpuid has AVX512-VNNI and AVX2's vpmaddubsw +
  vpmaddwd elsewhere, with the same result to the bit;
- ``w8a8_s32(xq, q)``: int8 x int8, exact int32 [M, N] (VNNI where there is);
- ``fp8_w8a16(x, w, scales, bk, bn)``: e4m3fn weights (or their uint8 bits) with a scale per
  (bk x bn) block;
- ``bf16_w16a32(x, w)``: bf16 weights widened exactly to f32.

With AMX (isa "amx"), calls of at least ``status().amx_rows[family]`` rows (16 for bf16
and fp8, 8 for int8 where K <= 16384, whose tiles then give the VNNI kernel's bits, 16 for deeper
int8; ``JAXSERVE_NATIVE_AMX_ROWS`` sets every family ("R") or some ("int8=4,bf16=32"), for
measuring) run tile kernels instead: bf16 and fp8 weights decoded to bf16 tiles (e4m3 times its scale in f32, rounded to
bf16), x rounded to bf16, f32 accumulation (AMX-BF16); int8 as W8A8 with the VNNI kernel's
activation quantization, exact int32 dots (AMX-INT8); ``w8a8_s32`` exact on AMX-INT8. The int4
entry has a bf16-tile kernel too (nibble times scale, rounded to bf16), which lost to the W4A8
VNNI kernel at every row count measured, so int4 runs W4A8 unless JAXSERVE_NATIVE_AMX_ROWS.

Threads: a call's work is shared by the calling thread and either the library's own crew of
helper threads, which poll for the next call for ``status().spin_us`` after each (100 us, where a
probe at first use finds that two threads read memory at least 1.3x as fast as one;
``JAXSERVE_NATIVE_SPIN_US`` sets it, 0 = no crew), or XLA's intra-op thread pool: without the
crew, while another call has it, and for a call of at least ``status().pool_rows`` rows or
queries (128; ``JAXSERVE_NATIVE_POOL_ROWS`` sets it): a prefill program keeps XLA's pool busy
between its calls, and a polling crew would take a CPU from it. A matmul whose stored weight
bytes times rows is under ``status().share_bytes`` (64 KiB with the crew, 1 MiB without; ``JAXSERVE_NATIVE_SHARE_BYTES``
sets it, for measuring) runs on the calling thread alone: a sleeping pool thread takes about as
long to wake as such a call takes. The bits do not depend on any of it.

The grouped-by-expert form of each (the ragged MoE matmul; ``csrc/handlers.cc``):
``int4_grouped(x, packed, scales, sizes, group)``, ``int8_grouped``, ``fp8_grouped``,
``bf16_grouped`` and ``f32_grouped`` (plain float32 weights): x f32 [M, K] rows sorted by
expert, the stacked weight [E, ...] in the same layout per expert, sizes int32 [E]; each expert
that has rows runs the dense kernel on its rows and its own bytes (an expert without rows is not
read); rows past sum(sizes) are zeros.

And two that are not matmuls:
- ``greedy_rows(logits, rows, mask)`` (``csrc/greedy.cc``): each sampled row's first argmax (of
  the masked row) and the raw log-probability of that token, for the sampler's all-greedy
  batches;
- ``gqa_paged(q, k_pool, v_pool, k_scale, v_scale, page_table, cached_lens, new_lens, scale)``
  (``csrc/attention.cc``): grouped-query attention of a step's queries over the K/V their
  pages hold, in the pools' own format (f32, bf16, e4m3 with per-vector scales), the numbers
  of ``jaxserve.models.attention.gqa_attention_paged``; the "native" attention backend runs it
  for steps of a few queries a row.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)
TARGETS = ("jaxserve_int4_w4a16", "jaxserve_int8_w8a16", "jaxserve_fp8_w8a16", "jaxserve_bf16_w16a32",
           "jaxserve_w8a8_s32", "jaxserve_int4_grouped", "jaxserve_int8_grouped", "jaxserve_fp8_grouped",
           "jaxserve_bf16_grouped", "jaxserve_f32_grouped", "jaxserve_greedy_rows", "jaxserve_gqa_paged")
ENV = "JAXSERVE_NATIVE"  # "0": do not use the native kernels
# JAXSERVE_NATIVE_ISA=avx2 keeps AVX-512 machines on the AVX2 copy; =avx512 off the VNNI kernels;
# =avx512-vnni off the AMX kernels
ISA_NAMES = {4: "amx", 3: "avx512-vnni", 2: "avx512", 1: "avx2"}
AMX_FAMILIES = ("bf16", "int8", "int4", "fp8")  # the C++ side's format numbers
NEVER = 1 << 30


@dataclasses.dataclass(frozen=True)
class NativeStatus:
    available: bool
    reason: str  # why not, or what was loaded
    library: str | None = None
    isa: str | None = None  # "amx" | "avx512-vnni" | "avx512" | "avx2": the kernels' instruction set (cpuid)
    amx_rows: dict | None = None  # isa "amx": family -> calls of at least that many rows run its AMX kernel
    share_bytes: int | None = None  # matmul calls with less work (weight bytes x rows) run on the calling thread
    spin_us: int | None = None  # the crew's helper threads poll this long between calls (0: no crew)
    pool_rows: int | None = None  # calls of at least this many rows (queries) share XLA's pool, not the crew


def _library_path() -> pathlib.Path | None:
    found = sorted(pathlib.Path(__file__).parent.glob("_kernels*.so"))
    return found[0] if found else None


def _cpu_flags() -> set[str]:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.cache
def status() -> NativeStatus:
    """Load and register the kernels once; say why not where they cannot run."""
    st = _load()
    (log.info if st.available else log.warning)("native CPU kernels: %s", st.reason)
    return st


def _load() -> NativeStatus:
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return NativeStatus(False, f"disabled by {ENV}=0; XLA's own matmul paths run")
    path = _library_path()
    if path is None:
        return NativeStatus(False, "library not built (reinstall with `pip install -e .` and a C++17 compiler); "
                                   "XLA's own matmul paths run")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return NativeStatus(False, f"library {path.name} failed to load ({e}); XLA's own matmul paths run")
    level = lib.jaxserve_native_isa()
    if level not in ISA_NAMES:
        missing = [f for f in ("avx2", "fma", "f16c") if f not in _cpu_flags()]
        return NativeStatus(False, f"CPU lacks {', '.join(missing) or 'AVX2/FMA/F16C'}; XLA's own matmul paths run")
    for name in TARGETS:
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
    amx_rows = None
    lib.jaxserve_native_amx_rows.argtypes = [ctypes.c_int]
    if level == 4:  # the AMX kernels' row threshold per format family; NEVER: that family has none
        amx_rows = {f: int(lib.jaxserve_native_amx_rows(i)) for i, f in enumerate(AMX_FAMILIES)}
        amx_rows = {f: r for f, r in amx_rows.items() if r < NEVER}
    lib.jaxserve_native_spin_us.restype = ctypes.c_int64
    lib.jaxserve_native_crew_probe.restype = ctypes.c_double
    spin_us, probe = int(lib.jaxserve_native_spin_us()), float(lib.jaxserve_native_crew_probe())
    lib.jaxserve_native_share_bytes.restype = ctypes.c_int64
    share = int(lib.jaxserve_native_share_bytes())
    lib.jaxserve_native_pool_rows.restype = ctypes.c_int64
    pool_rows = int(lib.jaxserve_native_pool_rows())
    what = f"{ISA_NAMES[level]} kernels (cpuid)" + (
        "".join(f", AMX {f} from {r} rows" for f, r in amx_rows.items()) if amx_rows else "")
    what += f"; matmuls of under {share / 2**20:g} MiB of weight x rows on the calling thread"
    measured = f" (two threads read {probe:.2f}x one)" if probe else ""
    what += (f"; helper threads poll {spin_us} us between calls{measured}, calls of >= {pool_rows} rows on "
             f"XLA's pool" if spin_us else f"; no polling helper threads{measured}")
    return NativeStatus(True, f"loaded {path.name}, {what}", str(path), ISA_NAMES[level], amx_rows, share, spin_us,
                        pool_rows)


def available() -> bool:
    return status().available


def _f32(rows: int, cols: int, dtype=jnp.float32):
    if not available():
        raise RuntimeError(f"native CPU kernels unavailable: {status().reason}")
    return jax.ShapeDtypeStruct((rows, cols), dtype)


def int4_w4a16(x, packed, scales, group: int):
    """x f32 [M, Kp] (zero-padded), packed u8 [Kp/2, N], scales [Kp/G, N] (f32 or a checkpoint's
    bf16, widened exactly) -> f32 [M, N]."""
    return jax.ffi.ffi_call("jaxserve_int4_w4a16", _f32(x.shape[0], packed.shape[1]))(
        x.astype(jnp.float32), packed, jnp.asarray(scales, jnp.float32), group=np.int64(group))


def int8_w8a16(x, q, scales):
    """x f32 [M, K], q s8 [K, N], scales f32 [1, N] -> f32 [M, N]."""
    return jax.ffi.ffi_call("jaxserve_int8_w8a16", _f32(x.shape[0], q.shape[1]))(
        x.astype(jnp.float32), q, jnp.asarray(scales, jnp.float32))


def w8a8_s32(xq, q):
    """xq s8 [M, K], q s8 [K, N] -> exact int32 [M, N]."""
    return jax.ffi.ffi_call("jaxserve_w8a8_s32", _f32(xq.shape[0], q.shape[1], jnp.int32))(xq, q)


def fp8_w8a16(x, bits, scales, bk: int, bn: int):
    """x f32 [M, K], bits [K, N] (float8_e4m3fn, or its bits as uint8), scales f32
    [ceil(K/bk), ceil(N/bn)] -> f32 [M, N]."""
    return jax.ffi.ffi_call("jaxserve_fp8_w8a16", _f32(x.shape[0], bits.shape[1]))(
        x.astype(jnp.float32), bits, jnp.asarray(scales, jnp.float32), bk=np.int64(bk), bn=np.int64(bn))


def bf16_w16a32(x, w):
    """x f32 [M, K], w bf16 [K, N] -> f32 [M, N]."""
    return jax.ffi.ffi_call("jaxserve_bf16_w16a32", _f32(x.shape[0], w.shape[1]))(x.astype(jnp.float32), w)


def int4_grouped(x, packed, scales, sizes, group: int):
    """x f32 [M, Kp] (zero-padded) sorted by expert, packed u8 [E, Kp/2, N], scales [E, Kp/G, N],
    sizes int32 [E] -> f32 [M, N]."""
    return jax.ffi.ffi_call("jaxserve_int4_grouped", _f32(x.shape[0], packed.shape[-1]))(
        x.astype(jnp.float32), packed, jnp.asarray(scales, jnp.float32), sizes.astype(jnp.int32), group=np.int64(group))


def int8_grouped(x, q, scales, sizes):
    """x f32 [M, K] sorted by expert, q s8 [E, K, N], scales [E, 1, N], sizes [E] -> f32 [M, N]."""
    return jax.ffi.ffi_call("jaxserve_int8_grouped", _f32(x.shape[0], q.shape[-1]))(
        x.astype(jnp.float32), q, jnp.asarray(scales, jnp.float32), sizes.astype(jnp.int32))


def fp8_grouped(x, bits, scales, sizes, bk: int, bn: int):
    """x f32 [M, K] sorted by expert, bits [E, K, N] (e4m3fn or uint8), scales [E, ceil(K/bk),
    ceil(N/bn)], sizes [E] -> f32 [M, N]."""
    return jax.ffi.ffi_call("jaxserve_fp8_grouped", _f32(x.shape[0], bits.shape[-1]))(
        x.astype(jnp.float32), bits, jnp.asarray(scales, jnp.float32), sizes.astype(jnp.int32),
        bk=np.int64(bk), bn=np.int64(bn))


def bf16_grouped(x, w, sizes):
    """x f32 [M, K] sorted by expert, w bf16 [E, K, N], sizes [E] -> f32 [M, N]."""
    return jax.ffi.ffi_call("jaxserve_bf16_grouped", _f32(x.shape[0], w.shape[-1]))(
        x.astype(jnp.float32), w, sizes.astype(jnp.int32))


def f32_grouped(x, w, sizes):
    """x f32 [M, K] sorted by expert, w f32 [E, K, N], sizes [E] -> f32 [M, N]."""
    return jax.ffi.ffi_call("jaxserve_f32_grouped", _f32(x.shape[0], w.shape[-1]))(
        x.astype(jnp.float32), w, sizes.astype(jnp.int32))


def greedy_rows(logits, rows, mask):
    """logits f32 [L, V], rows int32 [B], mask int32 [B, ceil(V/32)] (packed allowed tokens, all
    ones = none) -> (token int32 [B]: first argmax of the masked row, logprob f32 [B]: of the raw
    row's log-softmax)."""
    if not available():
        raise RuntimeError(f"native CPU kernels unavailable: {status().reason}")
    b = rows.shape[0]
    out = (jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.float32))
    return jax.ffi.ffi_call("jaxserve_greedy_rows", out)(
        logits.astype(jnp.float32), rows.astype(jnp.int32), mask.astype(jnp.int32))


def gqa_paged(q, k_pool, v_pool, k_scale, v_scale, page_table, cached_lens, new_lens, scale: float):
    """q [B, T, H, D] (any float; computed in f32), pools [KVH, P, S, D] as stored (float32,
    bf16 or its uint16 container, float8_e4m3fn or its uint8 container), scales f32 [KVH, P, S]
    for e4m3 pools (None otherwise), page_table int32 [B, M], cached_lens / new_lens int32 [B]
    -> f32 [B, T, H, D]: query t of row b (position cached + t) over the row's positions <= its
    own below cached + new."""
    if not available():
        raise RuntimeError(f"native CPU kernels unavailable: {status().reason}")
    none = jnp.zeros((0,), jnp.float32)
    return jax.ffi.ffi_call("jaxserve_gqa_paged", jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32), k_pool, v_pool, none if k_scale is None else k_scale.astype(jnp.float32),
        none if v_scale is None else v_scale.astype(jnp.float32), page_table.astype(jnp.int32),
        cached_lens.astype(jnp.int32), new_lens.astype(jnp.int32), scale=np.float32(scale))
