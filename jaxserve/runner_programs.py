"""The model runner's ahead-of-time side: the ``ProgramSpec`` of every serving program (the
checked step per bucket, the generation update per padded size), the key parts that name
them in the program cache, the lookup ``step`` makes before falling back to the jit path,
``lower`` (any bucket for inspection, any platform) and ``warmup``, the jit path's warm-up.

The key names everything that shapes a program besides its bucket and inputs, among them the
batch-invariant row tile (``row_tile``) and the worker role, so a program built for one mode
or role is never loaded for another. A runner whose mesh spans processes takes no ProgramSet
(``use_programs`` refuses it): its device calls are mirrored to the followers through the
jit path, and its warm-up is ``ModelRunner.warmup``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.buckets import step_name, weights_phase
from jaxserve.models.step import StepInput
from jaxserve.programs import ProgramSet, ProgramSpec


class ProgramsRunnerMixin:
    """Mixed into ``ModelRunner``; reads its arrays, buckets and jitted functions."""

    programs: ProgramSet | None = None  # where serving programs are built ahead of time (use_programs)

    def key_parts(self) -> dict:
        """What shapes every serving program besides its bucket and inputs (the program cache key)."""
        mesh = None if self.mesh is None else {"shape": dict(self.mesh.shape), "devices": self.mesh.devices.size}
        return {"model": repr(self.cfg), "dtype": str(self.dtype), "kv_format": self.fmt.name,
                "weights": repr(self.weight_formats), "attention": self.attention_backend,
                "matmuls": self.matmul_backend, "page_size": self.page_size, "num_pages": self.num_pages,
                "max_pages_per_seq": self.max_pages_per_seq, "tracker": type(self.tracker).__name__, "mesh": mesh,
                "row_tile": self.row_tile, "role": self.role}

    def _step_spec(self, phase: str, b: int, t: int) -> ProgramSpec:
        """The checked step for one bucket; its inputs abstract (no array is made: each new
        shape of ``jnp.zeros`` would compile a program of its own), the committed ones with
        their placement."""
        z, zm = _int32(b), _int32(b, self.max_pages_per_seq)
        inp = StepInput(tokens=_int32(b, t), cached_lens=z, new_lens=z, page_table=zm)
        placed = jax.tree.map(_abstract, (self.phase_params[weights_phase(phase)][0], self.kv, self.generation))
        return ProgramSpec(step_name(phase, b, t), self._program(phase), (*placed, inp, zm, z))

    def _updates_spec(self, size: int) -> ProgramSpec:
        z = _int32(size)
        return ProgramSpec(f"updates/{size}", self._apply_updates_fn(), (_abstract(self.generation), z, z))

    def _built(self, name: str, spec):
        """The built program ``name``; before warm-up a missing one is built now, after it None
        (the jit path, whose compilation the guard counts). None without a ProgramSet."""
        if self.programs is None:
            return None
        built = self.programs.get(name)
        if built is None and not self.warm:
            self.programs.build([spec()])
            built = self.programs.get(name)
        return built

    def update_sizes(self) -> list[int]:
        """Every padded size a generation update can have (none without a tracker)."""
        if not self.tracker.enabled:
            return []
        sizes = [8]
        while sizes[-1] < self.num_pages:
            sizes.append(sizes[-1] * 2)
        return sizes

    def program_specs(self, decode_batches: list[int], prefill_shapes: list[tuple[int, int]],
                      verify_tokens: int = 0) -> list[ProgramSpec]:
        """Every serving program: the checked step per bucket (largest first; no decode bucket
        for a worker without decode weights; with ``verify_tokens`` (speculative decoding's
        k + 1) a verify bucket per decode bucket), and the generation update at every padded size."""
        if "decode" not in self.phase_params:
            decode_batches = []
        shapes = [("decode", b, 1) for b in decode_batches] + [("prefill", b, t) for b, t in prefill_shapes]
        shapes += [("verify", b, verify_tokens) for b in decode_batches if verify_tokens]
        specs = [self._step_spec(*s) for s in sorted(shapes, key=lambda s: (-s[1] * s[2], s[0]))]
        return specs + [self._updates_spec(size) for size in self.update_sizes()]

    def use_programs(self, programs: ProgramSet | None) -> bool:
        """Build serving programs into ``programs`` (a ProgramSet, maybe with a disk cache): each
        on first use until ``warm`` (warm-up builds them all: ``jaxserve.engine.warmup``).
        Refused (False; the jit path stays) when the mesh spans processes."""
        if self.spans_processes:
            programs = None
        self.programs = programs
        return programs is not None

    def lower(self, phase: str, batch: int, tokens: int = 1, platform: str | None = None):
        """The serving program ``phase`` lowered for one bucket (batch rows x new tokens), for
        inspection: ``.as_text()`` (StableHLO), ``.compile().as_text()`` (optimized HLO), or for
        another platform (``platform="cuda"`` lowers without a GPU; the matmul and attention
        backends are the runner's). Inputs are abstract: nothing runs."""
        abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
        b, m = jax.ShapeDtypeStruct((batch,), jnp.int32), jax.ShapeDtypeStruct((batch, self.max_pages_per_seq), jnp.int32)
        inp = StepInput(tokens=jax.ShapeDtypeStruct((batch, tokens), jnp.int32), cached_lens=b, new_lens=b, page_table=m)
        args = jax.tree.map(abstract, (self.phase_params[phase][0], self.kv, self.generation))
        traced = self._program(phase).trace(*args, inp, m, b)
        return traced.lower(lowering_platforms=(platform,)) if platform else traced.lower()

    def warmup(self, decode_batches: list[int], prefill_shapes: list[tuple[int, int]], verify_tokens: int = 0) -> None:
        """Compile every serving bucket now through the jit path (page tables of padding rows
        are all null): the warm-up of a runner without a ProgramSet (a mesh over several
        processes, where every call is mirrored to the followers)."""
        m = self.max_pages_per_seq
        if "decode" not in self.phase_params:
            decode_batches = []
        verify = [(b, verify_tokens) for b in decode_batches if verify_tokens]
        for phase, shapes in (("decode", [(b, 1) for b in decode_batches]), ("prefill", prefill_shapes),
                              ("verify", verify)):
            for b, t in shapes:
                z = np.zeros((b,), np.int32)
                self.step(phase, np.zeros((b, t), np.int32), z, z, np.zeros((b, m), np.int32),
                          np.zeros((b, m), np.int32), z)
        for size in self.update_sizes():
            z = np.zeros((size,), np.int32)
            self.apply_padded_updates(z, z)  # count 0: a no-op
        self.warm = True


def _abstract(x):
    """An input as the abstract input a program is built for: shape, dtype and, for a committed
    array, its placement (a host array, e.g. a weight quantized on the host, has none: default)."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


def _int32(*shape: int) -> jax.ShapeDtypeStruct:
    """An int32 host input of the step (tokens, lengths, page tables): uncommitted, no placement."""
    return jax.ShapeDtypeStruct(shape, jnp.int32)
