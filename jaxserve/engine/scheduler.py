"""Continuous batching: which sequences run this step, and how many tokens each.

Every step the scheduler builds two batches, one per jitted program:
- decode: every running sequence whose prompt is fully computed, one token each (up to
  ``max_num_seqs``). Each needs a KV slot for its newest token; when pages run out the
  newest running sequence is preempted (pages released, recomputed later from its
  prompt + output so far), never crashed or dropped.
- prefill: chunks of prompts under a per-step token budget (chunked prefill). Sequences
  that are part-way through their prompt continue first; then waiting sequences are
  admitted while their whole prompt fits in free KV pages, in the order of the client policy
  (``fair_share``: the least-served client's oldest request first, or arrival order under
  ``fifo``). Prefix-cache hits skip the cached pages (``num_computed`` starts past them).
- fair share: before either batch, a client over ``max_slots_per_client`` running requests
  gives up its newest to a waiting client under the bound when the decode batch is full; a
  client at the bound is not admitted more while another client is present (``fair_share``).

Host-side only (no JAX): the tests drive it directly.
"""
from __future__ import annotations

import dataclasses
from collections import deque

from jaxserve.engine import fair_share
from jaxserve.engine.block_manager import BlockManager, NoFreePagesError
from jaxserve.engine.sequence import Sequence, Status


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32  # decode batch limit (running sequences)
    max_num_batched_tokens: int = 256  # prefill tokens per step
    max_prefill_seqs: int = 4  # prefill rows per step
    prefill_chunk: int = 128  # max new tokens of one sequence in one prefill step
    client_scheduling: str = fair_share.FAIR  # fair | fifo (fair_share)
    max_slots_per_client: int = 0  # running requests of one client while others are present; 0 = no bound

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_prefill_seqs", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        self.share_policy()  # a clear error for a bad policy or bound

    def share_policy(self) -> fair_share.SharePolicy:
        return fair_share.SharePolicy(self.client_scheduling, self.max_slots_per_client)


@dataclasses.dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first token index (= seq.num_computed)
    num_tokens: int

    @property
    def completes_prompt(self) -> bool:
        """After this chunk the sequence's known tokens are computed (sample if it has no output yet)."""
        return self.start + self.num_tokens >= self.seq.total_len - (1 if self.seq.output_ids else 0)


@dataclasses.dataclass
class SchedulerOutput:
    prefill: list[ScheduledChunk]
    decode: list[Sequence]
    # Admitted this step with their prompt's KV handed over (seq.kv_import): the engine writes
    # their pages before any program reads them; they decode from the next step.
    imported: list[Sequence] = dataclasses.field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.bm = block_manager
        self.policy = config.share_policy()
        self.presence = fair_share.Presence(self.policy.linger_steps)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admitted, in admission order
        self.num_preemptions = 0  # since start

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        present = self.presence.tick(self.waiting, self.running)
        for victim in fair_share.slot_victims(self.waiting, self.running, self.config.max_num_seqs,
                                              self.config.max_prefill_seqs, self.policy, present):
            self.preempt(victim)
        decode = self._schedule_decode()
        imported: list[Sequence] = []
        prefill = self._schedule_prefill(imported, present)
        return SchedulerOutput(prefill, decode, imported)

    # ------------------------------------------------------------------ decode
    def _schedule_decode(self) -> list[Sequence]:
        batch: list[Sequence] = []
        batched: set[int] = set()  # id() of the sequences in the batch
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or seq.in_prefill:
                continue
            if len(batch) >= self.config.max_num_seqs:
                break
            if not self.bm.has_seq(seq.request_id):
                # Host bookkeeping lost this sequence's pages (a bug elsewhere): schedule it
                # with the page table it holds so the device check fails it closed, with a
                # cause, instead of crashing the engine or reading pages it no longer owns.
                batch.append(seq)
                batched.add(id(seq))
                continue
            want = seq.total_len + len(seq.draft_ids)  # speculative draft tokens need slots too
            if seq.draft_ids and not self.bm.can_append_slots(seq.request_id, want):
                seq.draft_ids, want = [], seq.total_len  # ... but never preempt anyone
            while True:
                try:
                    new_pages = self.bm.append_slots(seq.request_id, want)
                    break
                except NoFreePagesError:
                    victim = self._pressure_victim(batched)
                    self.preempt(victim)
                    if victim is seq:
                        break
                    seq.draft_ids, want = [], seq.total_len
            if seq.status is not Status.RUNNING:
                continue
            self._sync_pages(seq, new_pages)
            batch.append(seq)
            batched.add(id(seq))
        return batch

    def _pressure_victim(self, batched: set[int]) -> Sequence:
        """Who gives up its pages when they run out: never one already in this step's batch."""
        candidates = [s for s in self.running if id(s) not in batched]
        return fair_share.pressure_victim(candidates, fair_share.running_counts(self.running), self.policy)

    # ------------------------------------------------------------------ prefill
    def _schedule_prefill(self, imported: list[Sequence], present: frozenset[str]) -> list[ScheduledChunk]:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []

        def take(seq: Sequence) -> None:
            nonlocal budget
            target = seq.total_len - (1 if seq.output_ids else 0)
            n = min(target - seq.num_computed, cfg.prefill_chunk, budget)
            if n > 0:
                chunks.append(ScheduledChunk(seq, seq.num_computed, n))
                budget -= n

        for seq in self.running:
            if len(chunks) >= cfg.max_prefill_seqs or budget <= 0:
                return chunks
            if seq.status is Status.RUNNING and seq.in_prefill:
                take(seq)
        while self.waiting and len(chunks) < cfg.max_prefill_seqs and budget > 0:
            if len(self.running) >= cfg.max_num_seqs:
                break
            seq = fair_share.next_waiting(self.waiting, fair_share.running_counts(self.running), self.policy,
                                          present)
            if seq is None:
                break  # every waiting client is at its bound while another is present
            tokens = seq.all_ids[:-1] if seq.output_ids else seq.prompt_ids
            handed = seq.kv_import is not None  # every page is written from the handoff: no prefix hits
            try:
                alloc = self.bm.allocate_prompt(seq.request_id, tokens, use_prefix_cache=not handed)
            except NoFreePagesError:
                break  # admission by free pages: wait until some finish
            self.waiting.remove(seq)
            seq.pages, seq.expected = list(alloc.pages), self.bm.expected_generations(seq.request_id)
            seq.num_computed = len(tokens) if handed else alloc.num_cached_tokens
            if not seq.admitted:
                seq.num_cached_tokens = seq.kv_import.cached_tokens if handed else alloc.num_cached_tokens
                seq.admitted = True
            seq.status = Status.RUNNING
            self.running.append(seq)
            if handed:
                imported.append(seq)
            else:
                take(seq)
        return chunks

    # ------------------------------------------------------------------ state changes
    def _sync_pages(self, seq: Sequence, new_pages: list[int]) -> None:
        """Extend the request's own page table (never rebuilt from the block manager, so
        the device check compares two independent records)."""
        if new_pages:
            seq.pages += new_pages
            seq.expected += self.bm.expected_generations(seq.request_id)[-len(new_pages):]

    def preempt(self, seq: Sequence) -> None:
        """Release the sequence's pages and queue it (first) for recompute."""
        self._release(seq)
        seq.status = Status.WAITING
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def requeue(self, seq: Sequence) -> None:
        """A handed-off request whose pages could not be used: release them and queue it
        (first) to prefill locally (not counted as a preemption)."""
        self._release(seq)
        seq.status = Status.WAITING
        seq.num_computed = 0
        seq.kv_import = None
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str, error: Exception | None = None) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.error = error

    def _release(self, seq: Sequence) -> None:
        if self.bm.has_seq(seq.request_id):
            self.bm.free(seq.request_id)
        seq.pages, seq.expected = [], []
