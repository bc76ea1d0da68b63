"""``StepBatch.as_inputs``: what the runner hands the programs. Host fields stay numpy (the
program call copies them), every field int32 with its values unchanged, jax fields stay jax."""
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.step_batch import DATA_FIELDS, StepBatch


def test_as_inputs_keeps_host_arrays_on_the_host_as_int32():
    rng = np.random.default_rng(0)
    fields = dict(tokens=rng.integers(0, 1000, (2, 3)), cached_lens=np.array([5, 0]), new_lens=np.array([3, 1]),
                  page_table=rng.integers(0, 9, (2, 4)), expected=rng.integers(0, 9, (2, 4)),
                  pages_used=np.array([2, 1]))  # int64, as numpy builds them by default
    got = StepBatch(**fields, phase="decode").as_inputs()
    assert got.phase == "decode" and got.shape == (2, 3)
    for f in DATA_FIELDS:
        x = getattr(got, f)
        assert type(x) is np.ndarray and x.dtype == np.int32, f
        np.testing.assert_array_equal(x, fields[f])
    on_dev = StepBatch(**{f: jnp.asarray(v) for f, v in fields.items()}).as_inputs()
    assert all(isinstance(getattr(on_dev, f), jax.Array) and getattr(on_dev, f).dtype == jnp.int32
               for f in DATA_FIELDS)
