"""jaxserve's native CPU matmul kernels vs XLA's paths vs float32, on a decode step's matrices.

The SmolLM2-135M decode skeleton: every matrix a batch-M decode step multiplies (30 layers of
q/k/v/o/gate/up/down and the 576 x 49152 tied head), in one jitted call per (format, path)
(independent calls, which XLA may run two or more at a time; --chain makes each wait for the one
before, as a program's layers do), the calls interleaved in rotating order, --reps timed each; reported: best ms per call, stored
GB/s, speed relative to float32 from the same process. --no-amx adds the same build's kernels
with AMX off (a second copy of the library), so AMX and the VNNI/AVX-512 kernels are timed
side by side. Plus the copy bandwidth of the machine
(a jitted in-place x + 1 over 256 MiB, read + write counted). --baseline LIB.so adds a third
path per format: the same calls into another build of the kernels (e.g. main's), registered
under prefixed names, so old and new kernels are timed side by side in one process.

    .venv/bin/python bench/native_kernels.py --m 1,8 --json bench/results/native_kernels.json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import native
from jaxserve.quant import nbytes, quantize
from jaxserve.quant.native_paths import KERNELS
from jaxserve.quant.paths import XLA_PATHS, family_of

SHAPES = [(576, 576)] * 2 + [(576, 192)] * 2 + [(576, 1536)] * 2 + [(1536, 576)]  # one layer


def skeleton(layers: int):
    return [s for _ in range(layers) for s in SHAPES] + [(576, 49152)]


def baseline_kernels(lib_path: str, prefix: str = "baseline_", amx_rows: int | None = None) -> dict:
    """family -> dense(x, qw) calling the kernels of the library at lib_path (registered as
    "<prefix><target>"), with the argument handling of jaxserve.native's wrappers; amx_rows:
    that copy's AMX row threshold (1 << 30: no AMX)."""
    lib = ctypes.CDLL(lib_path)
    if amx_rows is not None:
        lib.jaxserve_native_set_amx_rows(amx_rows)
    for name in native.TARGETS:
        jax.ffi.register_ffi_target(prefix + name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")

    def out(x, qw):
        return jax.ShapeDtypeStruct((x.shape[0], qw.values.shape[-1]), jnp.float32)

    def int4(x, qw):
        xp = jnp.pad(x, ((0, 0), (0, 2 * qw.values.shape[-2] - x.shape[1])))
        return jax.ffi.ffi_call(prefix + "jaxserve_int4_w4a16", out(x, qw))(
            xp, qw.values, jnp.asarray(qw.scales, jnp.float32), group=np.int64(qw.fmt.group))

    def fp8(x, qw):
        bk, bn = qw.fmt.scale_block
        return jax.ffi.ffi_call(prefix + "jaxserve_fp8_w8a16", out(x, qw))(
            x, qw.values, qw.scales, bk=np.int64(bk or qw.shape[0]), bn=np.int64(max(bn, 1)))

    return {"int4": int4, "fp8": fp8, "fp8_block": fp8,
            "int8": lambda x, qw: jax.ffi.ffi_call(prefix + "jaxserve_int8_w8a16", out(x, qw))(x, qw.values, qw.scales),
            "bf16": lambda x, qw: jax.ffi.ffi_call(prefix + "jaxserve_bf16_w16a32", out(x, qw))(x, qw.values)}


def best(fn, args, reps):
    jax.block_until_ready(fn(*args))
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append(time.perf_counter() - t)
    return min(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default="1,8")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--formats", default="bf16,int8,int4:g32,fp8_e4m3")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--baseline", default=None, help="another build of the kernels (.so) to time alongside")
    ap.add_argument("--chain", action="store_true",
                    help="each call's input depends on the one before (as in a decode program, where XLA runs "
                         "the calls one after another on one thread); without it the calls are independent "
                         "and XLA may run several at once on its pool's threads")
    ap.add_argument("--no-amx", action="store_true",
                    help="also time a second copy of this build with its AMX kernels off (the VNNI/AVX-512 ones)")
    args = ap.parse_args(argv)
    assert native.available(), native.status().reason
    rng = np.random.default_rng(0)
    ws = [(0.02 * rng.standard_normal(s)).astype(np.float32) for s in skeleton(args.layers)]
    big = jnp.zeros((64 << 20,), jnp.float32)
    copy = jax.jit(lambda a: a + 1, donate_argnums=0)
    big = copy(big).block_until_ready()  # compiled outside the timing
    copy_gbs = 0.0
    for _ in range(3):  # the best of 3 rounds of 5 copies
        t = time.perf_counter()
        for _ in range(5):
            big = copy(big)
        big.block_until_ready()
        copy_gbs = max(copy_gbs, 5 * 2 * big.nbytes / (time.perf_counter() - t) / 1e9)
    base = baseline_kernels(args.baseline) if args.baseline else None
    noamx = None
    if args.no_amx:
        copy_path = os.path.join(tempfile.mkdtemp(), "noamx_kernels.so")
        shutil.copy(native.status().library, copy_path)  # its own statics: AMX off there only
        noamx = baseline_kernels(copy_path, "noamx_", 1 << 30)
    cases = {"float32": ([jnp.asarray(w) for w in ws], lambda x, w: x @ w, sum(w.nbytes for w in ws))}
    for f in args.formats.split(","):
        qs = jax.device_put([quantize(w, f) for w in ws])  # on the device once, as an engine holds them
        fam = family_of(f)
        cases[f"{f} xla"] = (qs, XLA_PATHS[(fam, "cpu")].dense, sum(nbytes(q) for q in qs))
        cases[f"{f} native"] = (qs, KERNELS[fam][1], sum(nbytes(q) for q in qs))
        if base:
            cases[f"{f} baseline"] = (qs, base[fam], sum(nbytes(q) for q in qs))
        if noamx:
            cases[f"{f} no-amx"] = (qs, noamx[fam], sum(nbytes(q) for q in qs))
    rows = []
    for m in [int(v) for v in args.m.split(",")]:
        x = jnp.asarray(rng.standard_normal((m, 576)), jnp.float32)
        x2 = jnp.asarray(rng.standard_normal((m, 1536)), jnp.float32)
        fns = {}
        for name, (weights, dense, nb) in cases.items():
            def step(x, x2, weights, dense=dense):
                acc = jnp.float32(0)
                for w in weights:
                    acc = acc + dense(x if w.shape[0] == 576 else x2, w)[0, 0]
                    if args.chain:  # adds nothing, but the next call must wait for this one
                        x, x2 = x + 0 * acc, x2 + 0 * acc
                return acc
            fns[name] = jax.jit(step)
        times = {n: [] for n in cases}
        for r in range(args.reps):
            order = list(cases)[r % len(cases):] + list(cases)[:r % len(cases)]
            for n in order:
                times[n].append(best(fns[n], (x, x2, cases[n][0]), 1))
        f32 = min(times["float32"])
        for n in cases:
            t = min(times[n])
            rows.append(dict(m=m, case=n, ms=1e3 * t, gb_s=cases[n][2] / t / 1e9, vs_f32=f32 / t))
            print(f"M={m:2d} {n:18s} {1e3 * t:8.2f} ms {cases[n][2] / t / 1e9:6.1f} GB/s {f32 / t:5.2f}x float32",
                  flush=True)
    load = os.getloadavg()
    print(f"copy bandwidth {copy_gbs:.1f} GB/s; isa {native.status().isa}; load average {load}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(rows=rows, copy_gb_s=copy_gbs, isa=native.status().isa, load=load,
                           baseline=args.baseline), fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
