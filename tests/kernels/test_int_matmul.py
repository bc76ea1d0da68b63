"""jaxserve's integer kernels (W4A8 for int4 groups, W8A8 for int8 per channel, the exact
s8 x s8 -> s32 entry) against numpy, on whichever instruction set this CPU runs them with
(AVX512-VNNI, or AVX2's vpmaddubsw where there is no VNNI): the activations quantized
independently here (per row per weight group for int4, per row for int8: scale d = amax / 127,
rint of x / d, round half to even, in float32 as the kernel and jaxserve's XLA W8A8 path do),
the stored weights decoded here from their bytes, the integer dots in int64 and the rest in
float64. So the match is tight: only the kernels' float32 scaling and accumulation differ. Odd
shapes: N not a multiple of a vector or a panel, K not a multiple of 4 or of the group, 1-17
rows. Where the CPU has VNNI, the AVX2 kernels (JAXSERVE_NATIVE_ISA=avx2) are checked too, in
a subprocess: against numpy, and bit for bit against the VNNI kernels.
"""
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import native
from jaxserve.quant import get_weight_format, quantize
from jaxserve.quant.native_paths import KERNELS

ACC = 3e-6  # float32 scaling and accumulation, relative to the sum of |terms|

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status().reason}")
has_vnni = native.available() and native.status().isa in ("avx512-vnni", "amx")  # amx: below its tile rows


def rand(shape, seed, scale=1.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def quant_rows(x):
    """int8 codes and float32 scales of x [..., n], one scale over the last axis: d = amax / 127
    (1 where amax is 0), codes rint(x / d) in float32 (jaxserve's W8A8 convention)."""
    d = (np.max(np.abs(x), axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    d = np.where(d > 0, d, np.float32(1)).astype(np.float32)
    q = np.clip(np.rint((x / d).astype(np.float32)), -127, 127).astype(np.int64)
    return q, d


def int4_codes(qw):
    """The stored nibbles as signed ints [Kp, N] (plain k order)."""
    g = get_weight_format(qw.format).group
    b = np.asarray(qw.values).astype(np.int64).reshape(-1, g // 2, qw.shape[1])
    lo, hi = b & 15, b >> 4
    q = np.stack([lo, hi], axis=1).reshape(-1, qw.shape[1])
    return np.where(q >= 8, q - 16, q)


def check(y, ref, mag):
    y = np.asarray(y, np.float64)
    assert y.shape == ref.shape
    err = np.abs(y - ref) / (ACC * mag + 1e-30)
    assert np.all(err <= 1), np.max(err)


SHAPES = [(1, 200, 77), (3, 1000, 200), (5, 96, 64), (8, 64, 136), (9, 130, 300),
          (7, 1536, 129),  # W4A8: 4 chunks of 12 groups (g32), a 5-row pass and a 2-row pass
          (9, 96, 8000)]  # wide: the walks split the columns into ranges (their sums kept in L2)
W4_SHAPES = SHAPES + [(13, 160, 700), (17, 64, 129)]  # rows past one shared unpacking (8)


@needs_native
@pytest.mark.parametrize("m,k,n", W4_SHAPES)
@pytest.mark.parametrize("fmt", ["int4:g32", "int4:g128"])
def test_w4a8_against_numpy(fmt, m, k, n):
    qw = quantize(rand((k, n), seed=k + n, scale=0.05), fmt)
    g = get_weight_format(fmt).group
    x = rand((m, k), seed=m)
    q = int4_codes(qw)  # [Kp, N]
    kp, t = q.shape[0], q.shape[0] // g
    xp = np.pad(x, ((0, 0), (0, kp - k))).reshape(m, t, g)
    xq, xs = quant_rows(xp)  # [m, t, g], [m, t, 1]
    dots = np.einsum("mtg,tgn->mtn", xq, q.reshape(t, g, n))  # exact int64
    terms = xs.astype(np.float64) * np.asarray(qw.scales, np.float64)[None] * dots
    y = jax.jit(KERNELS["int4"][1])(jnp.asarray(x), qw)
    check(y, terms.sum(axis=1), np.abs(terms).sum(axis=1))


@needs_native
@pytest.mark.parametrize("fmt", ["int4:g32", "int4:g128"])
def test_w4a8_rows_do_not_depend_on_the_batch(fmt):
    """A row's W4A8 result is bit for bit the same alone and among 2..17 rows, whichever way
    the kernel groups the rows (one at a time, chunks of 4, chunks sharing one unpacking of the
    weights): what makes a verify call's and a batch's tokens the same as a lone decode's."""
    qw = quantize(rand((256, 900), seed=7, scale=0.05), fmt)
    f = jax.jit(KERNELS["int4"][1])
    x = rand((17, 256), seed=3)
    alone = np.concatenate([np.asarray(f(jnp.asarray(x[i : i + 1]), qw)) for i in range(17)])
    for m in (2, 4, 5, 8, 9, 12, 13, 16, 17):
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x[:m]), qw)), alone[:m], err_msg=f"{m} rows")


@needs_native
@pytest.mark.parametrize("m,k,n", SHAPES + [(2, 1027, 65), (2, 16400, 70)]  # two float partial sums of 16384 k
                         + [(17, 300, 130), (32, 576, 200)])  # the rows the registry sends it with VNNI (<= 32)
def test_w8a8_against_numpy(m, k, n):
    qw = quantize(rand((k, n), seed=k + n, scale=0.05), "int8")
    x = rand((m, k), seed=m)
    xq, xs = quant_rows(x)
    q = np.asarray(qw.values).astype(np.int64)
    scale = xs.astype(np.float64) * np.asarray(qw.scales, np.float64)  # [m, n]
    y = jax.jit(KERNELS["int8"][1])(jnp.asarray(x), qw)
    check(y, scale * (xq @ q), scale * (np.abs(xq) @ np.abs(q)))


@needs_native
def test_w8a8_rows_do_not_depend_on_the_batch():
    """A row's W8A8 result is bit for bit the same alone and among up to 32 rows (passes of a few
    rows, the column sums taken on the first): a decode step's tokens do not depend on how many
    other requests share its bucket."""
    qw = quantize(rand((576, 300), seed=9, scale=0.05), "int8")
    f = jax.jit(KERNELS["int8"][1])
    x = rand((32, 576), seed=4)
    alone = np.concatenate([np.asarray(f(jnp.asarray(x[i : i + 1]), qw)) for i in range(32)])
    for m in (2, 5, 9, 16, 17, 32):
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x[:m]), qw)), alone[:m], err_msg=f"{m} rows")


@needs_native
def test_w8a8_rows_of_a_deep_weight_do_not_depend_on_the_batch():
    """Past 16384 k the walk sums its int32 parts in float (vnni.inc's kW8Chunk) where AMX's
    tiles keep one int32 sum, so a deep weight stays on the walk below 16 rows (isa.inc's
    UseAmxInt8; from 8 rows the tiles take weights of one part): a row's bits alone and among
    9 or 12 rows agree."""
    # codes near the top: int32 sums of ~2 x 10^8, where float32's spacing is 16 and the two ways
    # of summing round apart
    qw = quantize((1 + 0.2 * np.abs(rand((16400, 70), seed=11))).astype(np.float32), "int8")
    f = jax.jit(KERNELS["int8"][1])
    x = (1 + 0.2 * np.abs(rand((12, 16400), seed=5))).astype(np.float32)
    alone = np.concatenate([np.asarray(f(jnp.asarray(x[i : i + 1]), qw)) for i in range(12)])
    for m in (9, 12):
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x[:m]), qw)), alone[:m], err_msg=f"{m} rows")


@needs_native
@pytest.mark.parametrize("fmt", ["int4:g32", "int4:g128"])
def test_w4a8_at_the_extreme_codes(fmt):
    """Every nibble at 7 (the largest unsigned code the kernels multiply) against activations
    all at +-127: the sums a kernel keeps in narrow integers before widening are at their
    largest (an int16 sum over more row pairs than fit would wrap)."""
    k, n = 512, 96
    qw = quantize(np.full((k, n), 0.05, np.float32), fmt)  # max / 7.5 scales: every code 7
    assert np.all(int4_codes(qw) == 7)
    x = np.where(np.arange(k) % 3 == 0, -1.0, 1.0).astype(np.float32)[None].repeat(2, 0)
    x[1] = 1.0
    g = get_weight_format(fmt).group
    xq, xs = quant_rows(x.reshape(2, k // g, g))
    terms = xs.astype(np.float64) * np.asarray(qw.scales, np.float64)[None] * np.einsum(
        "mtg,tgn->mtn", xq, int4_codes(qw).reshape(k // g, g, n))
    y = jax.jit(KERNELS["int4"][1])(jnp.asarray(x), qw)
    check(y, terms.sum(axis=1), np.abs(terms).sum(axis=1))


@needs_native
def test_w8a8_at_the_extreme_codes():
    """Stored codes -128 and 127 (-128 never comes from jaxserve's quantizer, but a checkpoint's
    int8 may hold it) against activations at +-127: the largest products the kernels pair up."""
    import dataclasses

    k, n = 1030, 70
    rng = np.random.default_rng(5)
    codes = np.where(rng.random((k, n)) < 0.5, -128, 127).astype(np.int8)
    qw = dataclasses.replace(quantize(rand((k, n), seed=1), "int8"), values=jnp.asarray(codes))
    x = np.where(rng.random((3, k)) < 0.5, -2.0, 2.0).astype(np.float32)
    xq, xs = quant_rows(x)
    scale = xs.astype(np.float64) * np.asarray(qw.scales, np.float64)
    y = jax.jit(KERNELS["int8"][1])(jnp.asarray(x), qw)
    check(y, scale * (xq @ codes.astype(np.int64)), scale * (np.abs(xq) @ np.abs(codes.astype(np.int64))))


@needs_native
@pytest.mark.parametrize("m,k,n", [(1, 2500, 70), (6, 1101, 33), (9, 5, 129)])
def test_exact_s32_with_codes_at_the_extremes(m, k, n):
    rng = np.random.default_rng(k)
    xq = rng.integers(-128, 128, (m, k), dtype=np.int8)
    q = rng.integers(-128, 128, (k, n), dtype=np.int8)
    xq[0], q[:, 0] = -128, -128  # the extreme codes: 2500 * 128^2 > 2^24
    got = np.asarray(jax.jit(native.w8a8_s32)(jnp.asarray(xq), jnp.asarray(q)))
    np.testing.assert_array_equal(got, xq.astype(np.int64) @ q.astype(np.int64))


@needs_native
def test_registry_says_the_activations_are_quantized():
    from jaxserve.quant.paths import PATHS

    isa = "avx512-vnni" if native.status().isa == "amx" else native.status().isa
    for fam, tag in (("int4", "W4A8"), ("int8", "W8A8")):
        path = PATHS[(fam, "cpu")]
        assert path.name.startswith("cpu:native") and f"native {isa} {tag} kernel" in path.numerics, path


@pytest.mark.skipif(not has_vnni, reason="the CPU runs the AVX2 integer kernels already (the tests above)")
def test_the_avx2_kernels_pass_and_match_vnni_to_the_bit(tmp_path):
    """JAXSERVE_NATIVE_ISA=avx2 keeps a VNNI CPU on the AVX2 kernels: the tests above pass there
    (a subprocess), and the two give the same bits for the same call (W4A8 and W8A8)."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "JAXSERVE_NATIVE_ISA": "avx2", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__),
                          "-k", "numpy or batch"], env=env, capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(here)))
    assert out.returncode == 0 and " passed" in out.stdout and "skipped" not in out.stdout, out.stdout[-2000:]
    code = ("import numpy as np\nfrom tests.kernels.test_int_matmul import bit_cases\n"
            f"np.savez({str(tmp_path / 'avx2.npz')!r}, *bit_cases())")
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(here))).returncode == 0
    avx2 = np.load(tmp_path / "avx2.npz")
    for i, got in enumerate(bit_cases()):
        np.testing.assert_array_equal(got, avx2[f"arr_{i}"], err_msg=f"case {i}")


@needs_native
@pytest.mark.parametrize("env", [{"JAXSERVE_NATIVE_THREADS": "1"},
                                 {"JAXSERVE_NATIVE_SHARE_BYTES": "1", "JAXSERVE_NATIVE_SPIN_US": "0"},
                                 {"JAXSERVE_NATIVE_SHARE_BYTES": "1", "JAXSERVE_NATIVE_SPIN_US": "100",
                                  "JAXSERVE_NATIVE_THREADS": "2"},
                                 {"JAXSERVE_NATIVE_SHARE_BYTES": "1", "JAXSERVE_NATIVE_SPIN_US": "100",
                                  "JAXSERVE_NATIVE_THREADS": "2", "JAXSERVE_NATIVE_POOL_ROWS": "1"}],
                         ids=["one-thread", "every-call-shared-on-the-pool", "every-call-shared-with-the-crew",
                              "every-call-on-the-pool-beside-the-crew"])
def test_the_thread_count_does_not_change_a_bit(tmp_path, env):
    """W4A8 and W8A8 split K into chunks that threads claim as they come; the chunks' sums are
    added in a fixed order, so one thread (JAXSERVE_NATIVE_THREADS=1, a subprocess) gives the
    bits two or more give: a request's tokens do not depend on the machine's load. Calls of
    little work run on the caller alone by default; JAXSERVE_NATIVE_SHARE_BYTES=1 shares every
    call over the threads, with the same bits, whether XLA's pool lends them
    (JAXSERVE_NATIVE_SPIN_US=0) or the library's own polling crew does (two threads, one helper,
    even on a machine where the probe would leave the crew off), and when calls of many rows go
    to the pool beside a crew (JAXSERVE_NATIVE_POOL_ROWS=1: every call)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import numpy as np\nfrom tests.kernels.test_int_matmul import bit_cases\n"
            f"np.savez({str(tmp_path / 'other.npz')!r}, *bit_cases())")
    env = {**os.environ, **env, "JAX_PLATFORMS": "cpu"}
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=300, cwd=root).returncode == 0
    other = np.load(tmp_path / "other.npz")
    for i, got in enumerate(bit_cases()):
        np.testing.assert_array_equal(got, other[f"arr_{i}"], err_msg=f"case {i}")


@needs_native
def test_the_crew_is_what_the_settings_say():
    """JAXSERVE_NATIVE_SPIN_US sets the helper crew's polling (0: none), one thread has no crew,
    and unset a probe decides and the status says what it measured (subprocesses: the choice is
    made once per process)."""
    code = ("import json\nfrom jaxserve import native\n"
            "s = native.status()\nprint(json.dumps([s.spin_us, s.share_bytes, s.reason, s.pool_rows]))")

    def status(**env):
        env = {k: v for k, v in os.environ.items() if not k.startswith("JAXSERVE_NATIVE")} | env
        out = subprocess.run([sys.executable, "-c", code], env={**env, "JAX_PLATFORMS": "cpu"}, timeout=120,
                             capture_output=True, text=True, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])[:3]

    spin, share, reason = status(JAXSERVE_NATIVE_SPIN_US="0")
    assert (spin, share) == (0, 1 << 20) and "no polling helper threads" in reason, reason
    spin, share, reason = status(JAXSERVE_NATIVE_SPIN_US="250", JAXSERVE_NATIVE_THREADS="2")
    assert (spin, share) == (250, 64 << 10) and "helper threads poll 250 us" in reason, reason
    assert "calls of >= 128 rows on XLA's pool" in reason, reason  # prefill's calls stay off the crew
    _, _, reason = status(JAXSERVE_NATIVE_SPIN_US="250", JAXSERVE_NATIVE_THREADS="2", JAXSERVE_NATIVE_POOL_ROWS="4096")
    assert "calls of >= 4096 rows on XLA's pool" in reason, reason
    spin, _, reason = status(JAXSERVE_NATIVE_THREADS="1")
    assert spin == 0 and "two threads read" not in reason, reason  # nothing to share: no probe
    spin, share, reason = status()
    measured = re.search(r"two threads read ([0-9.]+)x one", reason)
    ratio = float(measured.group(1)) if measured else 0.0  # none: a process on one CPU
    if abs(ratio - 1.3) >= 0.01:  # (printed to two places)
        assert spin == (100 if ratio >= 1.3 else 0), reason
    assert share == (64 << 10 if spin else 1 << 20), reason


def bit_cases():
    """The integer kernels' outputs on a few odd shapes, as numpy arrays."""
    out = []
    for fmt, (m, k, n) in [("int4:g32", (3, 1000, 200)), ("int4:g128", (9, 130, 300)), ("int8", (5, 1027, 65)),
                           ("int4:g32", (7, 1536, 2000)), ("int8", (6, 16400, 70)), ("int8", (200, 576, 300))]:
        qw = quantize(rand((k, n), seed=k + n, scale=0.05), fmt)
        out.append(np.asarray(jax.jit(KERNELS[fmt.split(":")[0]][1])(jnp.asarray(rand((m, k), seed=m)), qw)))
    return out
