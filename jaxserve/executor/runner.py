"""The model runner: owns the parameters, the KV pools and the page generations, and runs the
jitted programs (``StepPrograms``) on them.

Two serving programs, ``prefill`` and ``decode``, each jitted separately, once per padding
bucket (batch rows x new tokens; the page-table width is fixed to the longest sequence, and
attention reads pages only up to the batch's longest context, so a wide table costs nothing
until it is used), with the KV pools donated so they are updated in place. Each program first
runs the page tracker's batched check on every row's page table; a failing row is redirected
to the null page and writes nothing, and the caller aborts its request.

The runner is composed of small parts: ``StepPrograms`` (the jitted programs and their specs),
``CompileGuard`` (``warm``: once marked warm, any other compilation of a serving program is
counted, and raises ``RecompilationError`` when ``strict``), ``DeviceState`` (pools and
generations), ``Mirror`` and ``HandoffCalls`` (the KV handoff's export and import). Parameters
are passed as the flat leaves of the NNX state (cheaper to dispatch than an ``nnx.State``).

Where its programs come from (``source``, ``jaxserve.executor.sources``): ``AheadOfTime``, a
``ProgramSet`` (``use_programs``; maybe from the program cache on disk), or ``JitPath`` for a mesh
over several processes. Over several processes every process makes the same device calls in the
same order: process 0 sets a mirror (``set_mirror``) that sends each call's host inputs to the
others first; they replay it (``step`` / ``apply_padded_updates``). The logits come back
replicated, and ``step`` returns process 0's local copy, so sampling runs on process 0 alone.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.executor.buckets import bucket, pad_updates, step_name, update_sizes, weights_phase
from jaxserve.executor.guard import CompileGuard, RecompilationError  # noqa: F401 (the guard's error, here too)
from jaxserve.disagg.role import WorkerRole
from jaxserve.disagg.programs import HandoffCalls, HandoffPrograms, weights_digest
from jaxserve.executor.programs import ProgramSet
from jaxserve.executor.sources import AheadOfTime, JitPath
from jaxserve.executor.state import DeviceState, Mirror
from jaxserve.executor.step_programs import StepPrograms
from jaxserve.executor.weights import PhaseWeights
from jaxserve.kv.formats import KVFormat
from jaxserve.kv.page_tracker import NoOpTracker, PageTracker
from jaxserve.models.attention_backends import get_backend
from jaxserve.models.step import StepInput
from jaxserve.multihost.channel import pack
from jaxserve.quant.linear import resolve_backend
from jaxserve.sharding import MODEL_AXIS, Mesh, NamedSharding, PartitionSpec, replicated
from jaxserve.step_batch import StepBatch

BATCH_INVARIANT_ROWS = 8  # rows per matmul tile in batch-invariant mode (a row's numbers never see the batch)


@dataclasses.dataclass
class StepResult:
    logits: jax.Array  # f32 [B, V] at each row's last new token (padded rows included); [B, T, V] all_logits
    # and verify; a draft program's draft tokens int32 [B, T - 1]
    ok: np.ndarray  # bool [B] integrity check per row
    cause: np.ndarray  # int32 [B] page_tracker cause codes


class ModelRunner:
    def __init__(self, model, fmt: KVFormat, num_pages: int, page_size: int, mesh: Mesh | None = None,
                 tracker: PageTracker | NoOpTracker | None = None, max_pages_per_seq: int | None = None,
                 prefill_weights: str | None = None, decode_weights: str | None = None,
                 attention_backend: str = "xla", matmul_backend: str = "auto", quantize_tied_head: bool | str = False,
                 prefill_from_decode_weights: bool = False, strict: bool = False, batch_invariant: bool = False,
                 role: str = "both"):
        """quantize_tied_head: True stores a tied head in each phase's format; a format spec, once
        in that format for both phases (``quant.phase.quantize_state``).
        role: "both"; "prefill" (only the prefill weights are built: no decode program);
        "decode" (prefill reads the decode copy: one resident copy). A prefill or decode role
        also hashes the weights as loaded (``source_digest``), for the handoff fingerprint."""
        role = WorkerRole(role).name  # ValueError for an unknown role
        self.role, self.cfg, self.fmt, self.dtype = role, model.cfg, fmt, model.dtype
        self.num_pages, self.page_size, self.mesh = num_pages, page_size, mesh
        self.tracker = tracker if tracker is not None else PageTracker()
        self.max_pages_per_seq = bucket(max_pages_per_seq or num_pages - 1)
        graphdef, state = nnx.split(model)
        # The attention backend object every layer calls (the Pallas ones carry the mesh their
        # kernels run over, per device under shard_map).
        attention, self.attention_backend = get_backend(attention_backend, mesh), attention_backend
        self.matmul_backend = resolve_backend(matmul_backend)
        # The mesh reaches devices of other processes: outputs are replicated for process 0.
        self.spans_processes = mesh is not None and any(
            d.process_index != jax.process_index() for d in mesh.devices.flat)
        self.source_digest = weights_digest(jax.tree.leaves(state)) if role != "both" else ""
        if role == "decode":
            prefill_weights, prefill_from_decode_weights = None, True
        self.weights = PhaseWeights(state, prefill_weights, decode_weights, mesh, quantize_tied_head,
                                    prefill_from_decode_weights, role, self.matmul_backend)
        self.row_tile = BATCH_INVARIANT_ROWS if batch_invariant else 0  # 0: whole-batch ops (faster)
        self.guard, self.mirror = CompileGuard(strict), Mirror()
        self.state = self._committed_state(model.init_kv(num_pages, page_size, fmt))
        self.step_programs = StepPrograms(graphdef, {p: t for p, (_, t) in self.phase_params.items()}, fmt, page_size,
                                      attention, self.matmul_backend, self.row_tile, mesh, self.tracker,
                                      self.spans_processes, self.max_pages_per_seq)
        self.handoff = HandoffPrograms(model.init_kv, self.cfg.architecture, fmt, page_size, self.max_pages_per_seq,
                                       mesh, self.spans_processes)
        self.handoff_calls = HandoffCalls(self.handoff, self.state, self.guard, self.mirror, num_pages)
        self.source: AheadOfTime | JitPath = JitPath()  # where serving programs come from (use_programs)

    # ------------------------------------------------------------------ parts, as attributes
    programs = property(lambda self: self.source.programs)  # the ProgramSet (None on the jit path)
    phase_params = property(lambda self: self.weights.phase_params)  # phase -> (weight leaves, treedef)
    weight_formats = property(lambda self: self.weights.formats)
    params = property(lambda self: self.weights.phase_params["prefill"][0])
    treedef = property(lambda self: self.weights.phase_params["prefill"][1])
    kv = property(lambda self: self.state.kv, lambda self, kv: setattr(self.state, "kv", kv))
    generation = property(lambda self: self.state.generation)
    warm = property(lambda self: self.guard.warm)  # set by ``mark_warm``
    strict = property(lambda self: self.guard.strict, lambda self, on: setattr(self.guard, "strict", on))
    compiles_after_warmup = property(lambda self: self.guard.compiles_after_warmup)

    def mark_warm(self) -> None:
        """Every later compilation of a serving program is counted (and raises when strict)."""
        self.guard.mark_warm()

    def recompiled(self, msg: str) -> None:
        self.guard.recompiled(msg)

    def weight_bytes(self) -> dict[str, int]:
        return self.weights.bytes()

    def weight_paths(self) -> dict[str, str]:
        return self.weights.paths(self.mesh)

    def weight_path_rows(self):
        return self.weights.path_rows(self.mesh)

    def set_mirror(self, fn) -> None:
        """fn(kind, arrays, meta) runs before every device call of ``step`` ("step"), of the
        generation updates ("updates") and of the KV handoff, with the call's numpy inputs
        (multi-process serving)."""
        self.mirror.fn = fn

    def _committed_state(self, kv) -> DeviceState:
        """Commit every program input to its device(s) from the start, as the programs' outputs
        (the KV pools, the generations) are after their first call: a jitted program's cache
        key includes where its inputs are committed, so an uncommitted pool at warm-up and a
        committed one while serving would compile the same bucket twice."""
        mesh = self.mesh
        home = jax.devices()[0] if mesh is None else replicated(mesh)
        if mesh is None:  # (under a mesh the weights are placed, so committed, at load)
            self.weights.commit(home)
        return DeviceState(jax.device_put(kv, self.kv_sharding(kv) if mesh is not None else home),
                           jax.device_put(self.tracker.init(self.num_pages), home))

    def kv_sharding(self, kv):
        """MLA pools [P, S, X] have no head axis: replicated on every device (each head reads
        the whole latent). GQA pools [KVH, P, S, D] split by KV head when the heads divide."""
        n = self.mesh.shape[MODEL_AXIS]
        if self.cfg.is_mla or self.cfg.num_key_value_heads % n:
            return jax.tree.map(lambda _: replicated(self.mesh), kv)
        return jax.tree.map(lambda _: NamedSharding(self.mesh, PartitionSpec(MODEL_AXIS)), kv)

    # ------------------------------------------------------------------ where programs come from
    def use_programs(self, programs: ProgramSet | None) -> bool:
        """Build serving programs into ``programs`` (a ProgramSet, maybe with a disk cache): each
        on first use until warm (warm-up builds them all: ``jaxserve.executor.warmup``).
        Refused (False; the jit path stays) when the mesh spans processes."""
        ahead = programs is not None and not self.spans_processes
        self.source = AheadOfTime(programs, self.guard) if ahead else JitPath()
        return ahead

    def key_parts(self) -> dict:
        """What shapes every serving program besides its bucket and inputs (the program cache
        key; the batch-invariant row tile and the role included, so a program built for one
        mode or role is never loaded for another)."""
        mesh = None if self.mesh is None else {"shape": dict(self.mesh.shape), "devices": self.mesh.devices.size}
        return {"model": repr(self.cfg), "dtype": str(self.dtype), "kv_format": self.fmt.name,
                "weights": repr(self.weight_formats), "attention": self.attention_backend,
                "matmuls": self.matmul_backend, "page_size": self.page_size, "num_pages": self.num_pages,
                "max_pages_per_seq": self.max_pages_per_seq, "tracker": type(self.tracker).__name__, "mesh": mesh,
                "row_tile": self.row_tile, "role": self.role}

    def update_sizes(self) -> list[int]:
        """Every padded size a generation update can have (none without a tracker)."""
        return update_sizes(self.num_pages) if self.tracker.enabled else []

    def program_specs(self, decode_batches: list[int], prefill_shapes: list[tuple[int, int]],
                      verify_tokens: int = 0) -> list:
        """Every serving program's ``ProgramSpec``: the checked step per bucket (largest first; no
        decode bucket for a worker without decode weights; with ``verify_tokens`` (speculative
        decoding's k + 1) a verify bucket per decode bucket, and a draft one with the MTP block), and
        the generation update at every padded size."""
        if "decode" not in self.phase_params:
            decode_batches = []
        shapes = [("decode", b, 1) for b in decode_batches] + [("prefill", b, t) for b, t in prefill_shapes]
        shapes += [("verify", b, verify_tokens) for b in decode_batches if verify_tokens]
        if self.cfg.mtp_layers:  # the MTP block's drafts, in the verify buckets
            shapes += [("draft", b, verify_tokens) for b in decode_batches if verify_tokens]
        specs = [self.step_spec(*s) for s in sorted(shapes, key=lambda s: (-s[1] * s[2], s[0]))]
        return specs + [self.updates_spec(size) for size in self.update_sizes()]

    def step_spec(self, phase: str, b: int, t: int):
        """The ``ProgramSpec`` of the checked ``phase`` step for one bucket (b rows x t tokens)."""
        spec = self.step_programs.step_spec(phase, b, t, self._weights_of(phase), self.state.kv, self.state.generation)
        return dataclasses.replace(spec, warm=lambda: self.step(StepBatch.zeros(phase, b, t, self.max_pages_per_seq)))

    def updates_spec(self, size: int):
        z = np.zeros((size,), np.int32)  # count 0: a no-op
        return dataclasses.replace(self.step_programs.updates_spec(size, self.state.generation),
                                   warm=lambda: self.apply_padded_updates(z, z))

    def lower(self, phase: str, batch: int, tokens: int = 1, platform: str | None = None):
        """The serving program ``phase`` lowered for one bucket (batch rows x new tokens), for
        inspection: ``.as_text()`` (StableHLO), ``.compile().as_text()`` (optimized HLO), or for
        another platform (``platform="cuda"`` lowers without a GPU; the matmul and attention
        backends are the runner's). Inputs are abstract: nothing runs."""
        return self.step_programs.lower(phase, batch, tokens, self.phase_params[phase][0], self.state.kv,
                                    self.state.generation, platform)

    def _weights_of(self, program: str):
        weights = weights_phase(program)
        if weights not in self.phase_params:
            raise RuntimeError(f"a {self.role} worker holds no {weights} weights: it has no {program} program")
        return self.phase_params[weights][0]

    # ------------------------------------------------------------------ running
    def apply_generation_updates(self, pages: np.ndarray, counts: np.ndarray) -> None:
        """Bring the device generations up to date with the block manager's bumps."""
        if len(pages) == 0 or not self.tracker.enabled:
            return
        self.apply_padded_updates(*pad_updates(pages, counts))

    def apply_padded_updates(self, pages: np.ndarray, counts: np.ndarray) -> None:
        """The generation update on padded int32 [n] pages / counts (n a bucket: ``pad_updates``)."""
        self.mirror("updates", (pages, counts), {})
        built = self.source.lookup(f"updates/{len(pages)}", lambda: self.updates_spec(len(pages)))
        fn = built or self.step_programs.updates()
        self.state.generation = fn(self.state.generation, jnp.asarray(pages), jnp.asarray(counts))

    def step(self, batch: StepBatch) -> StepResult:
        """Run the checked ``batch.phase`` program on one padded batch (numpy or jax arrays);
        updates the KV pools. With ``batch.all_logits`` (scoring, never while serving) the logits
        are [B, T, V] and its compilations are not serving compilations; "verify" (a serving
        program) returns [B, T, V] too."""
        if self.mirror.on:
            self.mirror("step", *pack(batch))
        phase, (b, t) = batch.phase, batch.shape
        args = (self._weights_of(phase), self.state.kv, self.state.generation, batch.as_inputs())
        name = step_name(phase, b, t)
        built = None if batch.all_logits else self.source.lookup(name, lambda: self.step_spec(phase, b, t))
        if built is not None:  # compiled ahead of time: a call with other shapes raises, never compiles
            logits, self.state.kv, ok, cause = built(*args)
            return StepResult(self._local(logits), np.asarray(ok), np.asarray(cause))
        fn = self.step_programs.checked(phase, batch.all_logits)
        before = fn._cache_size()
        logits, self.state.kv, ok, cause = fn(*args)
        if self.guard.warm and not batch.all_logits and fn._cache_size() != before:
            self.guard.recompiled(f"{phase} program compiled after warm-up for shape tokens={(b, t)}")
        return StepResult(self._local(logits), np.asarray(ok), np.asarray(cause))

    def _local(self, logits):
        """Process 0's copy of replicated logits when the mesh spans processes."""
        return logits.addressable_data(0) if self.spans_processes else logits

    def run(self, tokens, cached_lens, new_lens, page_table, all_logits: bool = False) -> jax.Array:
        """Unchecked forward for tests and scoring (pages chosen by the caller).

        Returns logits [B, T, V] if all_logits else [B, V]. Not a serving path: the caller
        owns the pages it names.
        """
        inp = StepInput(*(jnp.asarray(x, jnp.int32) for x in (tokens, cached_lens, new_lens, page_table)))
        logits, self.state.kv = self.step_programs.unchecked(all_logits)(self.params, self.state.kv, inp)
        return logits

    # ------------------------------------------------------------------ KV handoff
    def export_pages(self, pages: list[int], fmt: str):
        """A request's pages in KV format ``fmt``, digested on device (``HandoffCalls``)."""
        return self.handoff_calls.export_pages(pages, fmt)

    def import_pages(self, pages: list[int], payload, expected) -> tuple[bool, str]:
        """``payload`` written into ``pages`` if its digest is ``expected`` -> (ok, digest found)."""
        return self.handoff_calls.import_pages(pages, payload, expected)

    def warmup_handoff(self, export_formats: list[str], imports: bool) -> None:
        self.handoff_calls.warmup(export_formats, imports)
