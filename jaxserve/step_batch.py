"""``StepBatch``: one step's inputs as one pytree, end to end. The engine builds it once
(``engine.input_batch.build_batch``), the runner passes it whole to the checked program, and over
several processes it crosses the step channel whole (``multihost.channel.pack`` / ``unpack``).

Data fields are arrays (numpy on the host, jax inside the program); static fields (the program
and its variant) are part of the pytree's structure, so a jitted program sees them as constants.
Padding rows and padding slots are zero: page 0 is the null page, and a padding row has no new
tokens.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

DATA_FIELDS = ("tokens", "cached_lens", "new_lens", "page_table", "expected", "pages_used")
STATIC_FIELDS = ("phase", "all_logits")


@functools.partial(jax.tree_util.register_dataclass, data_fields=list(DATA_FIELDS), meta_fields=list(STATIC_FIELDS))
@dataclasses.dataclass(frozen=True)
class StepBatch:
    tokens: jax.Array  # int32 [B, T] new token ids of each row
    cached_lens: jax.Array  # int32 [B]    tokens already in the row's pages
    new_lens: jax.Array  # int32 [B]       new tokens of the row (0: padding)
    page_table: jax.Array  # int32 [B, M]  physical page of each logical page (M: the runner's width)
    expected: jax.Array  # int32 [B, M]    generation each page must have (the integrity check)
    pages_used: jax.Array  # int32 [B]     pages the row's tokens reach
    # "prefill" | "decode" | "verify" | "draft"
    phase: str = dataclasses.field(default="prefill", metadata={"static": True})
    all_logits: bool = dataclasses.field(default=False, metadata={"static": True})  # scoring: logits [B, T, V]

    @property
    def shape(self) -> tuple[int, int]:
        """(B, T): the bucket."""
        return tuple(self.tokens.shape)

    def as_inputs(self) -> "StepBatch":
        """Every data field as int32, host (numpy) fields left on the host: what the programs
        take. The program call copies them to the device itself, several times cheaper than a
        ``jnp.asarray`` (one ``device_put``) per field first; the programs are built for
        uncommitted int32 inputs either way."""
        return dataclasses.replace(self, **{f: _int32(getattr(self, f)) for f in DATA_FIELDS})

    @classmethod
    def zeros(cls, phase: str, batch: int, tokens: int, width: int) -> "StepBatch":
        """An all-padding batch (null page tables: it writes nothing), for warm-up and tests."""
        z, zm = np.zeros((batch,), np.int32), np.zeros((batch, width), np.int32)
        return cls(np.zeros((batch, tokens), np.int32), z, z, zm, zm, z, phase=phase)


def _int32(x):
    """A numpy array as int32 numpy (no copy if it is one); a jax array as int32 jax."""
    if isinstance(x, jax.Array):
        return x.astype(jnp.int32)
    return np.asarray(x, np.int32)
