"""KV formats (quantize on write, dequantize on read) and the paged write/gather helpers."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kv import paged
from jaxserve.kv.formats import get_kv_format


def test_fp8_roundtrip_error_is_bounded_per_vector():
    fmt = get_kv_format("fp8_e4m3")
    x = jnp.asarray(np.random.RandomState(0).randn(64, 32).astype(np.float32) * np.logspace(-3, 3, 64)[:, None])
    q, scale = fmt.quantize(x)
    assert q.dtype == jnp.float8_e4m3fn and scale.dtype == jnp.float32 and scale.shape == (64,)
    y = fmt.dequantize(q, scale, jnp.float32)
    amax = np.abs(np.asarray(x)).max(-1, keepdims=True)
    # e4m3 has 3 mantissa bits: relative step 2**-3 at worst, so error <= amax / 16 per element.
    assert (np.abs(np.asarray(y - x)) <= amax / 16 + 1e-12).all()
    np.testing.assert_allclose(np.abs(np.asarray(y)).max(-1), amax[:, 0], rtol=1e-6)  # the max survives exactly


def test_fp8_zero_vector_stays_zero_and_finite():
    fmt = get_kv_format("fp8_e4m3")
    q, s = fmt.quantize(jnp.zeros((2, 8)))
    assert np.all(np.asarray(fmt.dequantize(q, s, jnp.float32)) == 0)


def test_unknown_format_is_named():
    with pytest.raises(ValueError, match="fp4_magic"):
        get_kv_format("fp4_magic")


def test_out_of_range_page_ids_drop_the_write_instead_of_clipping():
    """JAX clips gather/scatter indices: a bad page id must not land in another page."""
    num_pages, s = 4, 2
    pool = jnp.zeros((num_pages, s, 3))
    table = jnp.array([[1, num_pages], [-1, 2]], jnp.int32)  # page 4 and -1 are out of range
    positions = jnp.array([[0, 2], [0, 1]], jnp.int32)  # row 0 writes to its pages 0 and 1
    valid = jnp.ones((2, 2), bool)
    page, off = paged.token_slots(table, positions, valid, s, num_pages)
    out = paged.write_tokens(pool, jnp.ones((2, 2, 3)), page, off)
    written = np.asarray(out).sum(axis=(1, 2)) > 0
    assert written.tolist() == [False, True, False, False]  # only page 1; pages 3 and 0 untouched


def test_position_past_the_page_table_is_dropped():
    page, _ = paged.token_slots(jnp.array([[1]], jnp.int32), jnp.array([[5]], jnp.int32), jnp.ones((1, 1), bool), 2, 4)
    assert int(page[0, 0]) == 4  # sentinel, not clipped to the last table entry


def test_gqa_layout_roundtrip():
    fmt = get_kv_format("bf16")
    pools = paged.new_pool(fmt, (2, 5, 4, 8), "k")  # [KVH, P, S, D]
    vals = jnp.asarray(np.random.RandomState(1).randn(1, 3, 2, 8).astype(np.float32))  # [B, T, KVH, D]
    table = jnp.array([[3, 1]], jnp.int32)
    page, off = paged.token_slots(table, jnp.array([[0, 1, 4]]), jnp.ones((1, 3), bool), 4, 5)
    pools = paged.store(fmt, pools, "k", vals, page, off, headed=True)
    back = paged.load(fmt, pools, "k", table, jnp.float32, headed=True)  # [B, KVH, 8, D]
    got = np.take(np.asarray(back[0]), [0, 1, 4], axis=1).transpose(1, 0, 2)  # [T, KVH, D]
    np.testing.assert_allclose(got, np.asarray(vals[0]), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("name,container", [("bf16", np.uint16), ("fp8_e4m3", np.uint8), ("float32", np.float32)])
def test_pools_hold_the_formats_bits_in_an_integer_container(name, container):
    """Sub-32-bit pools are unsigned-int containers (XLA:CPU scatters into them in place);
    the bits written are exactly the format's quantized values."""
    fmt = get_kv_format(name)
    pools = paged.new_pool(fmt, (5, 4, 8), "x")
    assert pools["x"].dtype == container
    vals = jnp.asarray(np.random.RandomState(2).randn(1, 2, 8).astype(np.float32))
    pools = paged.store(fmt, pools, "x", vals, jnp.array([[3, 3]]), jnp.array([[1, 2]]))
    q, _ = fmt.quantize(vals)
    stored = paged.values_view(pools["x"], fmt)[3, 1:3]
    assert stored.dtype == fmt.dtype
    np.testing.assert_array_equal(np.asarray(stored.astype(jnp.float32)), np.asarray(q[0].astype(jnp.float32)))
    assert not np.asarray(paged.values_view(pools["x"], fmt)[:3].astype(jnp.float32)).any()  # other pages untouched
