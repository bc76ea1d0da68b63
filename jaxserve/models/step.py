"""The metadata a jitted model step takes, as a pytree of arrays (shapes on every field)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInput:
    """One padded batch of new tokens over a paged KV cache.

    Row b holds ``new_lens[b]`` new tokens at positions ``cached_lens[b] + t``; the first
    ``cached_lens[b]`` tokens of its sequence are already in pages. Padding rows have
    new_lens == 0. Prefill (T = chunk bucket) and decode (T = 1) share this form.
    """

    tokens: jax.Array  # int32 [B, T]
    cached_lens: jax.Array  # int32 [B]   tokens already in the KV pages
    new_lens: jax.Array  # int32 [B]   valid new tokens in this row (<= T)
    page_table: jax.Array  # int32 [B, M] physical page of each logical page

    @property
    def positions(self) -> jax.Array:  # int32 [B, T]
        t = self.tokens.shape[1]
        return self.cached_lens[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]

    @property
    def valid(self) -> jax.Array:  # bool [B, T]
        t = self.tokens.shape[1]
        return jnp.arange(t, dtype=jnp.int32)[None, :] < self.new_lens[:, None]

    def causal_mask(self) -> jax.Array:
        """bool [B, T, T]: new token t sees new tokens <= t of its own row."""
        t = self.tokens.shape[1]
        tri = jnp.tril(jnp.ones((t, t), bool))
        v = self.valid
        return tri[None] & v[:, None, :] & v[:, :, None]


def last_token_index(new_lens: jax.Array) -> jax.Array:
    """int32 [B]: index of each row's last valid new token (0 for empty rows)."""
    return jnp.maximum(new_lens - 1, 0)
