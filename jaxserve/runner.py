"""The model runner: owns the parameters, the KV pools and the page generations, and runs
the jitted programs.

Two serving programs, ``prefill`` and ``decode``, each jitted separately, once per padding
bucket (batch rows x new tokens; the page-table width is fixed to the longest sequence, and
attention reads pages only up to the batch's longest context, so a wide table costs nothing
until it is used), with the KV pools donated so they are updated in place. Each program first
runs the page tracker's batched check on every row's page table; a failing row is redirected
to the null page and writes nothing, and the caller aborts its request.

Parameters are passed as the flat leaves of the NNX state (cheaper to dispatch than an
``nnx.State``). Serving programs are built ahead of time into a ``ProgramSet`` (maybe from the
program cache on disk: ``jaxserve.runner_programs``); once ``warm``, any other compilation of a
serving program is counted, and raises ``RecompilationError`` when ``strict`` (tests), else is
logged as a warning.

A mesh over several processes (``jaxserve.multihost``): every process makes the same device
calls in the same order. Process 0 sets a mirror (``set_mirror``) that sends each call's host
inputs to the others before making it; they replay it (``step`` / ``apply_padded_updates``).
The logits come back replicated, and ``step`` returns process 0's local copy, so sampling
runs on process 0 alone. Such a runner keeps the jit path (no ProgramSet, no program cache):
its warm-up is ``warmup``, whose every call is mirrored, so the followers compile the same
programs in the same order.
"""
from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.handoff_programs import HandoffPrograms, HandoffRunnerMixin, weights_digest
from jaxserve.kv.page_tracker import NoOpTracker, PageTracker, pad_updates
from jaxserve.kv.formats import KVFormat
from jaxserve.models.attention_backends import get_backend
from jaxserve.models.step import StepInput
from jaxserve.buckets import bucket, pick_bucket, pow2_buckets, step_name, token_buckets, weights_phase  # noqa: F401 (re-exported)
from jaxserve.quant.linear import fixed_row_tiles, resolve_backend, use_backend
from jaxserve.quant.report import WeightPath, describe_phase, weight_paths
from jaxserve.runner_programs import ProgramsRunnerMixin
from jaxserve.quant.phase import phase_states, record_phase_specs
from jaxserve.sharding import MODEL_AXIS, Mesh, NamedSharding, PartitionSpec, kernel_mesh, replicated


log = logging.getLogger("jaxserve.runner")
BATCH_INVARIANT_ROWS = 8  # rows per matmul tile in batch-invariant mode (a row's numbers never see the batch)


class RecompilationError(RuntimeError):
    """A serving program compiled after warm-up (a shape escaped the padding buckets)."""


@dataclasses.dataclass
class StepResult:
    logits: jax.Array  # f32 [B, V] at each row's last new token (padded rows included); [B, T, V] all_logits
    ok: np.ndarray  # bool [B] integrity check per row
    cause: np.ndarray  # int32 [B] page_tracker cause codes


class ModelRunner(HandoffRunnerMixin, ProgramsRunnerMixin):
    def __init__(
        self,
        model,
        fmt: KVFormat,
        num_pages: int,
        page_size: int,
        mesh: Mesh | None = None,
        tracker: PageTracker | NoOpTracker | None = None,
        max_pages_per_seq: int | None = None,
        prefill_weights: str | None = None,
        decode_weights: str | None = None,
        attention_backend: str = "xla",
        matmul_backend: str = "auto",
        quantize_tied_head: bool = False,
        prefill_from_decode_weights: bool = False,
        strict: bool = False,
        batch_invariant: bool = False,
        role: str = "both",
    ):
        """role: "both"; "prefill" (only the prefill weights are built: no decode program);
        "decode" (prefill reads the decode copy: one resident copy). A prefill or decode role
        also hashes the weights as loaded (``source_digest``), for the handoff fingerprint."""
        if role not in ("both", "prefill", "decode"):
            raise ValueError(f"role must be both, prefill or decode, got {role!r}")
        self.role = role
        self.cfg = model.cfg
        self.fmt = fmt
        self.num_pages, self.page_size, self.mesh = num_pages, page_size, mesh
        self.tracker = tracker if tracker is not None else PageTracker()
        self.max_pages_per_seq = bucket(max_pages_per_seq or num_pages - 1)
        self.graphdef, state = nnx.split(model)
        self.dtype = model.dtype
        # The attention backend object every layer calls (the Pallas ones carry the mesh their
        # kernels run over, per device under shard_map).
        self.attention, self.attention_backend = get_backend(attention_backend, mesh), attention_backend
        self.matmul_backend = resolve_backend(matmul_backend)
        # The mesh reaches devices of other processes: outputs are replicated for process 0.
        self.spans_processes = mesh is not None and any(
            d.process_index != jax.process_index() for d in mesh.devices.flat)
        self.source_digest = weights_digest(jax.tree.leaves(state)) if role != "both" else ""
        if role == "decode":
            prefill_weights, prefill_from_decode_weights = None, True
        # Each phase's own weight representation (None: the loaded weights), one copy where one suffices.
        self.weight_formats, states = phase_states(state, prefill_weights, decode_weights, mesh, quantize_tied_head,
                                                   prefill_from_decode_weights,
                                                   only="prefill" if role == "prefill" else None)
        states = record_phase_specs(states) if mesh is not None else states  # each weight's split, for kernels
        self.phase_params = {p: jax.tree.flatten(s) for p, s in states.items()}
        if states["prefill"] is states.get("decode"):  # (record_phase_specs keeps a shared state shared)
            self.phase_params["prefill"] = self.phase_params["decode"]
        self.handoff = HandoffPrograms(model.init_kv, self.cfg.architecture, fmt, page_size, self.max_pages_per_seq,
                                       mesh, self.spans_processes)
        self._commit_inputs(model.init_kv(num_pages, page_size, fmt))
        self.params, self.treedef = self.phase_params["prefill"]
        self._jitted: dict = {}
        self.warm = False
        self.row_tile = BATCH_INVARIANT_ROWS if batch_invariant else 0  # 0: whole-batch ops (faster)
        self.strict = strict  # a compilation after warm-up raises (else it is logged and counted)
        self.compiles_after_warmup = 0
        self._mirror = None

    def set_mirror(self, fn) -> None:
        """fn(kind, arrays, meta) runs before every device call of ``step`` ("step") and of the
        generation updates ("updates"), with the call's numpy inputs (multi-process serving)."""
        self._mirror = fn

    def _commit_inputs(self, kv) -> None:
        """Commit every program input to its device(s) from the start, as the programs' outputs
        (the KV pools, the generations) are after their first call: a jitted program's cache
        key includes where its inputs are committed, so an uncommitted pool at warm-up and a
        committed one while serving would compile the same bucket twice."""
        mesh = self.mesh
        home = jax.devices()[0] if mesh is None else replicated(mesh)
        self.kv = jax.device_put(kv, self.kv_sharding(kv) if mesh is not None else home)
        self.generation = jax.device_put(self.tracker.init(self.num_pages), home)
        if mesh is None:  # (under a mesh the weights are placed, so committed, at load)
            placed = {id(x): x for leaves, _ in self.phase_params.values() for x in leaves}
            placed = dict(zip(placed, jax.device_put(list(placed.values()), home)))  # an array both phases read stays one
            self.phase_params = {p: ([placed[id(x)] for x in leaves], treedef)
                                 for p, (leaves, treedef) in self.phase_params.items()}

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of each phase's weights, and of what is resident (an array both phases read counts once)."""
        out = {p: 0 for p in ("prefill", "decode")}  # a phase this role does not hold: 0
        out.update({p: int(sum(x.nbytes for x in leaves)) for p, (leaves, _) in self.phase_params.items()})
        unique = {id(x): x.nbytes for leaves, _ in self.phase_params.values() for x in leaves}
        out["resident"] = int(sum(unique.values()))
        return out

    def weight_paths(self) -> dict[str, str]:
        """Per phase, the matmul paths its weights run on: 'int8 -> cpu:w8a8 (...)', one per
        stored format ('as loaded -> xla:dot (...)' for plain arrays); the weights a kernel
        refuses are named with the reason and the path that runs them instead."""
        out = {p: "not held (a prefill worker)" for p in ("prefill", "decode")}
        for phase, rows in self.weight_path_rows().items():
            out[phase] = describe_phase(rows, self.matmul_backend)
        return out

    def weight_path_rows(self) -> dict[str, list[WeightPath]]:
        """Per phase held, every stored weight with the matmul path that runs it (``quant.report``)."""
        return {phase: weight_paths(jax.tree.unflatten(treedef, leaves), self.matmul_backend, self.mesh)
                for phase, (leaves, treedef) in self.phase_params.items()}

    def kv_sharding(self, kv):
        """MLA pools [P, S, X] have no head axis: replicated on every device (each head reads
        the whole latent). GQA pools [KVH, P, S, D] split by KV head when the heads divide."""
        n = self.mesh.shape[MODEL_AXIS]
        if self.cfg.is_mla or self.cfg.num_key_value_heads % n:
            return jax.tree.map(lambda _: replicated(self.mesh), kv)
        return jax.tree.map(lambda _: NamedSharding(self.mesh, PartitionSpec(MODEL_AXIS)), kv)

    # ------------------------------------------------------------------ programs
    def _model_fn(self, all_logits: bool, phase: str = "prefill"):
        graphdef, fmt, page_size = self.graphdef, self.fmt, self.page_size
        backend = self.attention
        treedef = self.phase_params[phase][1]

        matmuls, rows, mesh = self.matmul_backend, self.row_tile, self.mesh

        def forward(params, kv, inp: StepInput):
            # Quantized weights enter as stored; every matmul reads them through quant.linear.
            model = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
            with use_backend(matmuls), fixed_row_tiles(rows), kernel_mesh(mesh):
                return model(inp, kv, fmt, page_size, all_logits=all_logits, backend=backend)

        return forward

    def _program(self, name: str, all_logits: bool = False):
        """The checked program `name` ("prefill" | "decode" | "verify": the decode weights with
        logits at every position, speculative decoding's check of draft tokens), jitted once;
        with ``all_logits`` the scoring variant (logits at every position, not part of serving)."""
        key = name + ("/all_logits" if all_logits else "")
        weights = weights_phase(name)
        if weights not in self.phase_params:
            raise RuntimeError(f"a {self.role} worker holds no {weights} weights: it has no {name} program")
        if key not in self._jitted:
            forward, tracker = self._model_fn(all_logits or name == "verify", weights), self.tracker

            def step(params, kv, generation, inp: StepInput, expected, num_pages_used):
                # The integrity check is its own batched op, before any attention read.
                ok, cause = tracker.check(generation, inp.page_table, expected, num_pages_used)
                safe = StepInput(
                    tokens=inp.tokens,
                    cached_lens=jnp.where(ok, inp.cached_lens, 0),
                    new_lens=jnp.where(ok, inp.new_lens, 0),  # a failing row writes nothing
                    page_table=tracker.redirect(inp.page_table, ok),
                )
                logits, kv = forward(params, kv, safe)
                if self.spans_processes:  # every process holds all of them; process 0 reads its copy
                    logits, ok, cause = (jax.lax.with_sharding_constraint(x, replicated(self.mesh))
                                         for x in (logits, ok, cause))
                return logits, kv, ok, cause

            self._jitted[key] = jax.jit(step, donate_argnums=(1,))
        return self._jitted[key]

    def _unchecked(self):
        if "all_logits" not in self._jitted:
            self._jitted["all_logits"] = jax.jit(self._model_fn(True), donate_argnums=(1,))
        return self._jitted["all_logits"]

    def _apply_updates_fn(self):
        if "updates" not in self._jitted:
            self._jitted["updates"] = jax.jit(self.tracker.apply_updates, donate_argnums=(0,))
        return self._jitted["updates"]

    # ------------------------------------------------------------------ running
    def apply_generation_updates(self, pages: np.ndarray, counts: np.ndarray) -> None:
        """Bring the device generations up to date with the block manager's bumps."""
        if len(pages) == 0 or not self.tracker.enabled:
            return
        self.apply_padded_updates(*pad_updates(pages, counts))

    def apply_padded_updates(self, pages: np.ndarray, counts: np.ndarray) -> None:
        """The generation update on padded int32 [n] pages / counts (n a power of two)."""
        if self._mirror is not None:
            self._mirror("updates", (pages, counts), {})
        n = len(pages)
        built = self._built(f"updates/{n}", lambda: self._updates_spec(n))
        self.generation = (built or self._apply_updates_fn())(self.generation, jnp.asarray(pages), jnp.asarray(counts))

    def step(self, phase: str, tokens, cached_lens, new_lens, page_table, expected, num_pages_used,
             all_logits: bool = False) -> StepResult:
        """Run the checked `phase` program on padded numpy inputs; updates the KV pools. With
        ``all_logits`` (scoring, never while serving) the logits are [B, T, V] and its
        compilations are not serving compilations; "verify" (a serving program) returns
        [B, T, V] too."""
        if self._mirror is not None:
            host = tuple(np.asarray(x, np.int32) for x in (tokens, cached_lens, new_lens, page_table, expected,
                                                           num_pages_used))
            self._mirror("step", host, {"phase": phase, "all_logits": all_logits})
        weights = weights_phase(phase)
        if weights not in self.phase_params:
            raise RuntimeError(f"a {self.role} worker holds no {weights} weights: it has no {phase} program")
        inp = StepInput(
            tokens=jnp.asarray(tokens, jnp.int32),
            cached_lens=jnp.asarray(cached_lens, jnp.int32),
            new_lens=jnp.asarray(new_lens, jnp.int32),
            page_table=jnp.asarray(page_table, jnp.int32),
        )
        args = (self.phase_params[weights][0], self.kv, self.generation, inp,
                jnp.asarray(expected, jnp.int32), jnp.asarray(num_pages_used, jnp.int32))
        b, t = inp.tokens.shape
        built = None if all_logits else self._built(step_name(phase, b, t), lambda: self._step_spec(phase, b, t))
        if built is not None:  # compiled ahead of time: a call with other shapes raises, never compiles
            logits, self.kv, ok, cause = built(*args)
            return StepResult(self._local(logits), np.asarray(ok), np.asarray(cause))
        fn = self._program(phase, all_logits)
        before = fn._cache_size()
        logits, self.kv, ok, cause = fn(*args)
        if self.warm and not all_logits and fn._cache_size() != before:
            self.recompiled(f"{phase} program compiled after warm-up for shape tokens={tuple(inp.tokens.shape)}")
        return StepResult(self._local(logits), np.asarray(ok), np.asarray(cause))

    def _local(self, logits):
        """Process 0's copy of replicated logits when the mesh spans processes."""
        return logits.addressable_data(0) if self.spans_processes else logits

    def recompiled(self, msg: str) -> None:
        """A serving program compiled after warm-up: counted; raises when strict."""
        self.compiles_after_warmup += 1
        if self.strict:
            raise RecompilationError(msg)
        log.warning("%s (a shape escaped the warm-up buckets: counted in compiles_after_warmup)", msg)

    def run(self, tokens, cached_lens, new_lens, page_table, all_logits: bool = False) -> jax.Array:
        """Unchecked forward for tests and scoring (pages chosen by the caller).

        Returns logits [B, T, V] if all_logits else [B, V]. Not a serving path: the caller
        owns the pages it names.
        """
        inp = StepInput(*(jnp.asarray(x, jnp.int32) for x in (tokens, cached_lens, new_lens, page_table)))
        fn = self._unchecked() if all_logits else self._model_only()
        logits, self.kv = fn(self.params, self.kv, inp)
        return logits

    def _model_only(self):
        if "last_logits" not in self._jitted:
            self._jitted["last_logits"] = jax.jit(self._model_fn(False), donate_argnums=(1,))
        return self._jitted["last_logits"]
