"""The runner's jitted programs over the KV pools: the checked step per phase ("prefill",
"decode", "verify": the decode weights with logits at every position, speculative decoding's
check of draft tokens, "draft": the decode weights' MTP block proposing those tokens, its first
output the drafts int32 [B, T - 1] in place of logits), its scoring variant (logits at every
position), the unchecked forward (tests and scoring), the generation update; each jitted once
(one executable per bucket), KV donated, traced with the runner's matmul backend and, in
batch-invariant mode, fixed row tiles.

It also gives the ``ProgramSpec`` of every serving program (for ahead-of-time builds into a
``ProgramSet``) and ``lower`` (any bucket for inspection, any platform). Programs take their
arrays as arguments: the runner owns the weights, pools and generations.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.executor.buckets import step_name, weights_phase
from jaxserve.executor.programs import ProgramSpec
from jaxserve.models.step import StepInput
from jaxserve.quant.linear import fixed_row_tiles, use_backend
from jaxserve.sharding import kernel_mesh, replicated
from jaxserve.step_batch import StepBatch


class StepPrograms:
    """graphdef: the model's NNX graph; treedefs: each phase's weight treedef; the rest as the
    runner's (KV format, page size, attention backend object, matmul backend, row tile, mesh,
    tracker, whether the mesh spans processes, page-table width)."""

    def __init__(self, graphdef, treedefs: dict, fmt, page_size: int, attention, matmul_backend: str, row_tile: int,
                 mesh, tracker, spans_processes: bool, max_pages_per_seq: int):
        self.graphdef, self.treedefs, self.fmt, self.page_size = graphdef, treedefs, fmt, page_size
        self.attention, self.matmul_backend, self.row_tile, self.mesh = attention, matmul_backend, row_tile, mesh
        self.tracker, self.spans_processes, self.max_pages_per_seq = tracker, spans_processes, max_pages_per_seq
        self._jitted: dict = {}

    def model_fn(self, all_logits: bool, phase: str = "prefill", draft: bool = False):
        """The model's forward with ``phase``'s weights; with ``draft`` the MTP block's draft
        tokens instead of logits (``CausalLM.draft``: k = T - 1 of the batch's T)."""
        graphdef, fmt, page_size, backend = self.graphdef, self.fmt, self.page_size, self.attention
        treedef, matmuls, rows, mesh = self.treedefs[phase], self.matmul_backend, self.row_tile, self.mesh

        def forward(params, kv, inp: StepInput):
            # Quantized weights enter as stored; every matmul reads them through quant.linear.
            model = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
            with use_backend(matmuls), fixed_row_tiles(rows), kernel_mesh(mesh):
                if draft:
                    return model.draft(inp, kv, fmt, page_size, inp.tokens.shape[1] - 1, backend=backend)
                return model(inp, kv, fmt, page_size, all_logits=all_logits, backend=backend)

        return forward

    def checked(self, name: str, all_logits: bool = False):
        """The checked program ``name``, jitted once; with ``all_logits`` the scoring variant
        (logits at every position, not part of serving)."""
        key = name + ("/all_logits" if all_logits else "")
        if key not in self._jitted:
            forward = self.model_fn(all_logits or name == "verify", weights_phase(name), draft=name == "draft")
            tracker = self.tracker
            spans, mesh = self.spans_processes, self.mesh

            def step(params, kv, generation, batch: StepBatch):
                # The integrity check is its own batched op, before any attention read.
                ok, cause = tracker.check(generation, batch.page_table, batch.expected, batch.pages_used)
                safe = StepInput(
                    tokens=batch.tokens,
                    cached_lens=jnp.where(ok, batch.cached_lens, 0),
                    new_lens=jnp.where(ok, batch.new_lens, 0),  # a failing row writes nothing
                    page_table=tracker.redirect(batch.page_table, ok),
                )
                logits, kv = forward(params, kv, safe)
                if spans:  # every process holds all of them; process 0 reads its copy
                    logits, ok, cause = (jax.lax.with_sharding_constraint(x, replicated(mesh))
                                         for x in (logits, ok, cause))
                return logits, kv, ok, cause

            self._jitted[key] = jax.jit(step, donate_argnums=(1,))
        return self._jitted[key]

    def unchecked(self, all_logits: bool):
        """The forward alone (pages chosen by the caller): tests and scoring."""
        key = "all_logits" if all_logits else "last_logits"
        if key not in self._jitted:
            self._jitted[key] = jax.jit(self.model_fn(all_logits), donate_argnums=(1,))
        return self._jitted[key]

    def updates(self):
        """The generation update (the block manager's bumps, padded: ``buckets.pad_updates``)."""
        if "updates" not in self._jitted:
            self._jitted["updates"] = jax.jit(self.tracker.apply_updates, donate_argnums=(0,))
        return self._jitted["updates"]

    # ------------------------------------------------------------------ ahead of time
    def step_spec(self, phase: str, b: int, t: int, params, kv, generation) -> ProgramSpec:
        """The checked step for one bucket; its inputs abstract (no array is made: each new
        shape of ``jnp.zeros`` would compile a program of its own), the committed ones with
        their placement."""
        placed = jax.tree.map(_abstract, (params, kv, generation))
        return ProgramSpec(step_name(phase, b, t), self.checked(phase), (*placed, self._abstract_batch(phase, b, t)))

    def _abstract_batch(self, phase: str, b: int, t: int) -> StepBatch:
        """A ``StepBatch`` of abstract int32 host inputs (uncommitted, no placement)."""
        z, zm = _int32(b), _int32(b, self.max_pages_per_seq)
        return StepBatch(_int32(b, t), z, z, zm, zm, z, phase=phase)

    def updates_spec(self, size: int, generation) -> ProgramSpec:
        z = _int32(size)
        return ProgramSpec(f"updates/{size}", self.updates(), (_abstract(generation), z, z))

    def lower(self, phase: str, batch: int, tokens: int, params, kv, generation, platform: str | None = None):
        """The serving program ``phase`` lowered for one bucket (abstract inputs: nothing runs)."""
        abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731 (no placement: any platform)
        inp = self._abstract_batch(phase, batch, tokens)
        traced = self.checked(phase).trace(*jax.tree.map(abstract, (params, kv, generation)), inp)
        return traced.lower(lowering_platforms=(platform,)) if platform else traced.lower()


def _abstract(x):
    """An input as the abstract input a program is built for: shape, dtype and, for a committed
    array, its placement (a host array, e.g. a weight quantized on the host, has none: default)."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


def _int32(*shape: int) -> jax.ShapeDtypeStruct:
    """An int32 host input of the step (tokens, lengths, page tables): uncommitted, no placement."""
    return jax.ShapeDtypeStruct(shape, jnp.int32)
