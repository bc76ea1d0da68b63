"""The model runner: owns the parameters and the KV pools and runs jitted steps.

``step(params, kv, StepInput) -> (logits, kv)`` is one pure function, jitted per padding
bucket (batch, new tokens, pages per row) with the KV pools donated, so the cache is
updated in place. Parameters are passed as the flat leaves of the NNX state (cheaper to
dispatch than an ``nnx.State``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.kv.formats import KVFormat
from jaxserve.models.step import StepInput
from jaxserve.sharding import MODEL_AXIS, Mesh, NamedSharding, PartitionSpec, replicated


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


class ModelRunner:
    def __init__(self, model, fmt: KVFormat, num_pages: int, page_size: int, mesh: Mesh | None = None):
        self.cfg = model.cfg
        self.fmt = fmt
        self.num_pages = num_pages
        self.page_size = page_size
        self.mesh = mesh
        self.graphdef, state = nnx.split(model)
        self.params, self.treedef = jax.tree.flatten(state)
        kv = model.init_kv(num_pages, page_size, fmt)
        if mesh is not None:
            kv = jax.device_put(kv, self.kv_sharding(kv))
        self.kv = kv
        self._compiled: dict = {}
        self.compile_count = 0

    def kv_sharding(self, kv):
        """MLA pools [P, S, X] have no head axis: replicated on every device (each head reads
        the whole latent). GQA pools [KVH, P, S, D] split by KV head when the heads divide."""
        n = self.mesh.shape[MODEL_AXIS]
        if self.cfg.is_mla or self.cfg.num_key_value_heads % n:
            return jax.tree.map(lambda _: replicated(self.mesh), kv)
        return jax.tree.map(lambda _: NamedSharding(self.mesh, PartitionSpec(MODEL_AXIS)), kv)

    def _fn(self, all_logits: bool):
        key = all_logits
        if key not in self._compiled:
            graphdef, treedef, fmt, page_size = self.graphdef, self.treedef, self.fmt, self.page_size

            def step(params, kv, inp: StepInput):
                model = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
                return model(inp, kv, fmt, page_size, all_logits=all_logits)

            self._compiled[key] = jax.jit(step, donate_argnums=(1,))
        return self._compiled[key]

    def run(self, tokens, cached_lens, new_lens, page_table, all_logits: bool = False) -> jax.Array:
        """Run one padded step (numpy int32 inputs), update the KV pools, return logits."""
        inp = StepInput(
            tokens=jnp.asarray(tokens, jnp.int32),
            cached_lens=jnp.asarray(cached_lens, jnp.int32),
            new_lens=jnp.asarray(new_lens, jnp.int32),
            page_table=jnp.asarray(page_table, jnp.int32),
        )
        fn = self._fn(all_logits)
        before = fn._cache_size() if hasattr(fn, "_cache_size") else None
        logits, self.kv = fn(self.params, self.kv, inp)
        if before is not None and fn._cache_size() != before:
            self.compile_count += 1
        return logits


def pad_batch(rows: list[tuple[list[int], int, list[int]]], t_min: int = 1):
    """rows: (new token ids, cached len, page list) -> padded numpy arrays in buckets.

    -> tokens [B, T], cached_lens [B], new_lens [B], page_table [B, M] (padding = page 0).
    """
    b = bucket(len(rows))
    t = bucket(max(len(r[0]) for r in rows), t_min)
    m = bucket(max(len(r[2]) for r in rows))
    tokens = np.zeros((b, t), np.int32)
    cached = np.zeros((b,), np.int32)
    new = np.zeros((b,), np.int32)
    table = np.zeros((b, m), np.int32)
    for i, (toks, c, pages) in enumerate(rows):
        tokens[i, : len(toks)] = toks
        cached[i] = c
        new[i] = len(toks)
        table[i, : len(pages)] = pages
    return tokens, cached, new, table
