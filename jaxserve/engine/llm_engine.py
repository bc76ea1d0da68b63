"""The engine: requests in, token deltas out, one ``step()`` at a time.

Each step: the scheduler picks a prefill batch and a decode batch; the block manager's
generation bumps are applied on device; the prefill program and then the decode program
run (each checks every row's pages first); rows that fail the check are aborted with an
``IntegrityError`` and emit nothing; sampled tokens are appended, stop conditions checked
and text detokenized incrementally.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from typing import Iterable

import jax
import numpy as np

from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.outputs import Completion, RequestOutput, Timing, Usage
from jaxserve.engine.page_tracker import NoOpTracker, PageTracker, TrackerStats, integrity_errors
from jaxserve.engine.sampler import sample_rows
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.sequence import Sequence
from jaxserve.kv import memory as kv_memory
from jaxserve.runner import ModelRunner, bucket, pick_bucket, pow2_buckets, token_buckets


def default_attention_backend() -> str:
    import jax

    return "pallas" if jax.default_backend() == "gpu" else "xla"


class LLMEngine:
    KEEP_FINISHED = 1024  # finished requests kept in `seqs` for inspection

    def __init__(self, model, config: EngineConfig, fmt, tokenizer=None, mesh=None):
        page_bytes = kv_memory.format_token_bytes(fmt, *kv_memory.model_token_layout(model, fmt)) * config.page_size
        budget = kv_memory.kv_budget(config.kv_cache_memory, config.memory_fraction)
        if budget is not None:  # the byte budget decides the page count
            config = dataclasses.replace(config, num_pages=kv_memory.pages_for_budget(budget, page_bytes))
        self.kv_page_bytes = page_bytes
        self.config = config
        self.cfg = model.cfg
        self.tokenizer = tokenizer
        pool_tokens = (config.num_pages - 1) * config.page_size
        self.max_model_len = min(config.max_model_len or self.cfg.max_position_embeddings, self.cfg.max_position_embeddings)
        self.max_pages_per_seq = -(-self.max_model_len // config.page_size)
        self.bm = BlockManager(config.num_pages, config.page_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler_config(), self.bm)
        tracker = PageTracker() if config.integrity_check else NoOpTracker()
        self.runner = ModelRunner(
            model, fmt, config.num_pages, config.page_size, mesh, tracker, max_pages_per_seq=self.max_pages_per_seq,
            prefill_weights=config.prefill_weights, decode_weights=config.decode_weights,
            attention_backend=config.attention_backend or default_attention_backend(),
            matmul_backend=config.matmul_backend, quantize_tied_head=config.quantize_tied_head,
            prefill_from_decode_weights=config.prefill_from_decode_weights,
        )
        self.pool_tokens = pool_tokens
        # Prefill programs: rows in powers of two, tokens in token_buckets (compiled at warm-up).
        self.prefill_token_buckets = token_buckets(16, min(config.prefill_chunk, config.max_num_batched_tokens))
        self.stats = TrackerStats()
        self.seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._seed_rng = np.random.default_rng(config.seed)
        self._just_finished: list[Sequence] = []
        self._finished_order: collections.deque[str] = collections.deque()
        eos = set(self.cfg.eos_token_id) | set(tokenizer.eos_token_ids if tokenizer is not None else [])
        self.eos_token_ids = frozenset(eos)

    def memory_report(self) -> dict:
        """What the engine holds: weight bytes per phase (and resident: shared arrays once), the
        KV pool's bytes and pages (the null page included in the bytes, not in kv_pages), and
        the tokens those pages cache."""
        usable = self.config.num_pages - 1
        return {
            "weight_bytes": self.runner.weight_bytes(),
            "kv_format": self.runner.fmt.name,
            "kv_bytes": int(sum(x.nbytes for x in jax.tree.leaves(self.runner.kv))),
            "kv_bytes_per_page": self.kv_page_bytes,
            "kv_bytes_per_token": self.kv_page_bytes // self.config.page_size,
            "kv_pages": usable,
            "max_cached_tokens": usable * self.config.page_size,
        }

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_ids, params: SamplingParams, request_id: str | None = None) -> str:
        """Validate and queue a request; returns its id. Bad input raises ValueError."""
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise ValueError("empty prompt")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {self.cfg.vocab_size})")
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the "
                f"maximum context of {self.max_model_len} tokens"
            )
        if total > self.pool_tokens:
            raise ValueError(f"prompt + max_tokens = {total} tokens exceeds the whole KV pool ({self.pool_tokens})")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.seqs and not self.seqs[rid].finished:
            raise ValueError(f"request id {rid!r} is already running")
        # Any integer seed works: it is folded into the 31-bit range the PRNG key takes.
        seed = params.seed % 2**31 if params.seed is not None else int(self._seed_rng.integers(0, 2**31 - 1))
        seq = Sequence(rid, ids, params, seed)
        if self.tokenizer is not None:
            from jaxserve.tokenizer import IncrementalDetokenizer

            seq.detok = IncrementalDetokenizer(self.tokenizer)
        self.seqs[rid] = seq
        self.scheduler.add(seq)
        return rid

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its pages. False if unknown or already finished."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.finished:
            return False
        self._finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        self.runner.apply_generation_updates(*self.bm.take_generation_updates())
        events: dict[str, list[int]] = {}  # request id -> token ids sampled this step
        if sched.prefill:
            chunks = [c for c in sched.prefill if not c.seq.finished]
            rows = [(c.seq, c.seq.all_ids[c.start : c.start + c.num_tokens], c.start) for c in chunks]
            t = pick_bucket(max(len(r[1]) for r in rows), self.prefill_token_buckets)
            res = self._run("prefill", rows, bucket(len(rows)), t)
            to_sample = []
            for i, c in enumerate(chunks):
                if not res.ok[i] or c.seq.finished:
                    continue
                c.seq.num_computed += c.num_tokens
                self.bm.commit_full_pages(c.seq.request_id, c.seq.all_ids[: c.seq.num_computed])
                if c.completes_prompt and not c.seq.output_ids:
                    to_sample.append((i, c.seq))
            self._sample(res.logits, to_sample, events)
        decode = [s for s in sched.decode if not s.finished]
        if decode:
            rows = [(s, [s.output_ids[-1]], s.total_len - 1) for s in decode]
            res = self._run("decode", rows, bucket(len(rows)), 1)
            to_sample = []
            for i, s in enumerate(decode):
                if res.ok[i] and not s.finished:
                    s.num_computed += 1
                    self.bm.commit_full_pages(s.request_id, s.all_ids[: s.num_computed])
                    to_sample.append((i, s))
            self._sample(res.logits, to_sample, events)
        outs = [self._output(self.seqs[rid], ids) for rid, ids in events.items()]
        # Requests that finished this step without a new token (aborted, failed check).
        outs += [self._output(s, []) for s in self._just_finished if s.request_id not in events]
        self._just_finished = []
        return outs

    def _run(self, phase, rows, b, t):
        """rows: (seq, new token ids, start position) -> runner step; aborts failing rows."""
        m = self.runner.max_pages_per_seq  # the width warm-up compiled (a power of two)
        s = self.config.page_size
        tokens = np.zeros((b, t), np.int32)
        cached = np.zeros((b,), np.int32)
        new = np.zeros((b,), np.int32)
        table = np.zeros((b, m), np.int32)
        expected = np.zeros((b, m), np.int32)
        used = np.zeros((b,), np.int32)
        for i, (seq, toks, start) in enumerate(rows):
            n = len(seq.pages)
            if n > m:
                raise AssertionError(f"{seq.request_id} maps {n} pages > {m} per sequence")
            tokens[i, : len(toks)] = toks
            cached[i], new[i] = start, len(toks)
            table[i, :n], expected[i, :n] = seq.pages, seq.expected
            used[i] = -(-(start + len(toks)) // s)
        res = self.runner.step(phase, tokens, cached, new, table, expected, used)
        self.stats.record(res.ok, res.cause, len(rows))
        for err in integrity_errors([r[0].request_id for r in rows], res.ok, res.cause):
            self._finish(self.seqs[err.request_id], "abort", err)
        return res

    def _sample(self, logits, rows: list[tuple[int, Sequence]], events) -> None:
        if not rows:
            return
        b = bucket(len(rows))
        v = self.cfg.vocab_size
        idx = np.zeros((b,), np.int32)
        temp, top_p, min_p = np.zeros(b, np.float32), np.ones(b, np.float32), np.zeros(b, np.float32)
        top_k, seeds, steps = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32)
        for j, (i, s) in enumerate(rows):
            p = s.params
            idx[j] = i
            temp[j], top_p[j], min_p[j], top_k[j] = p.temperature, p.top_p, p.min_p, p.top_k
            seeds[j], steps[j] = s.seed, len(s.output_ids)
        penalties = any(s.params.uses_penalties for _, s in rows)
        extra = {}
        if penalties:
            counts = np.zeros((b, v), np.int32)
            seen = np.zeros((b, v), bool)
            rep, pres, freq = np.ones(b, np.float32), np.zeros(b, np.float32), np.zeros(b, np.float32)
            for j, (_, s) in enumerate(rows):
                np.add.at(counts[j], s.output_ids, 1)
                seen[j, s.prompt_ids] = True
                seen[j, s.output_ids] = True
                rep[j], pres[j], freq[j] = s.params.repetition_penalty, s.params.presence_penalty, s.params.frequency_penalty
            extra = dict(counts=counts, seen=seen, repetition=rep, presence=pres, frequency=freq)
        n_lp = max((s.params.logprobs or 0) for _, s in rows)
        n_lp = 0 if n_lp == 0 and all(s.params.logprobs is None for _, s in rows) else bucket(max(n_lp, 1))
        tokens, lp, top_ids, top_lp = sample_rows(
            logits, idx, temp, top_k, top_p, min_p, seeds, steps, **extra,
            all_greedy=all(s.params.greedy for _, s in rows), penalties=penalties, num_logprobs=n_lp,
        )
        tokens, lp, top_ids, top_lp = map(np.asarray, (tokens, lp, top_ids, top_lp))
        now = time.perf_counter()
        for j, (_, s) in enumerate(rows):
            if s.finished:
                continue
            tok = int(tokens[j])
            s.output_ids.append(tok)
            s.token_times.append(now)
            if s.first_token_time is None:
                s.first_token_time = now
            if s.params.logprobs is not None:
                n = s.params.logprobs
                s.logprobs.append((float(lp[j]), {int(a): float(c) for a, c in zip(top_ids[j, :n], top_lp[j, :n])}))
            piece = s.detok.push(tok) if s.detok is not None else ""
            s.text += piece
            events.setdefault(s.request_id, []).append(tok)
            self._check_stop(s, tok)

    def _check_stop(self, s: Sequence, tok: int) -> None:
        p = s.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            return self._finish(s, "stop")
        for stop in p.stop:
            at = s.text.find(stop)
            if at >= 0:
                s.text = s.text[:at]
                return self._finish(s, "stop")
        if len(s.output_ids) >= p.max_tokens or s.total_len >= self.max_model_len:
            return self._finish(s, "length")

    def _finish(self, s: Sequence, reason: str, error: Exception | None = None) -> None:
        if s.finished:
            return
        if reason != "stop" or not s.params.stop:  # a stop string already cut the text
            if s.detok is not None and reason != "abort":
                s.text += s.detok.flush()
        self.scheduler.finish(s, reason, error)
        s.finish_time = time.perf_counter()
        self._just_finished.append(s)
        # Keep the most recent finished requests inspectable; forget older ones (a long-running
        # server must not grow without bound).
        self._finished_order.append(s.request_id)
        while len(self._finished_order) > self.KEEP_FINISHED:
            old = self._finished_order.popleft()
            if old in self.seqs and self.seqs[old].finished:
                del self.seqs[old]

    def _output(self, s: Sequence, new_ids: list[int]) -> RequestOutput:
        # Hold back text that could be the start of a stop string until it is decided.
        hold = 0 if s.finished or not s.params.stop else max(len(x) for x in s.params.stop) - 1
        end = max(s.emitted_text, len(s.text) - hold)
        delta = s.text[s.emitted_text : end]
        s.emitted_text = end
        return RequestOutput(
            s.request_id, list(new_ids), delta, s.finished, s.finish_reason, s.error,
            self.completion(s) if s.finished else None,
        )

    def completion(self, s: Sequence) -> Completion:
        end = s.finish_time or time.perf_counter()
        return Completion(
            list(s.output_ids),
            s.text if s.detok is not None else None,
            s.finish_reason,
            list(s.prompt_ids),
            usage=Usage(len(s.prompt_ids), len(s.output_ids), s.num_cached_tokens),
            timing=Timing(
                s.first_token_time - s.arrival_time if s.first_token_time is not None else None,
                end - s.arrival_time,
            ),
            logprobs=list(s.logprobs) if s.params.logprobs is not None else None,
            request_id=s.request_id,
            error=s.error,
        )

    # ------------------------------------------------------------------ warm-up
    def warmup(self) -> None:
        """Compile every serving bucket (prefill rows x tokens, decode rows) and the plain
        greedy and sampling variants of the sampler for each batch size (the penalty and
        logprob variants compile on first use)."""
        c = self.config
        decode = pow2_buckets(1, c.max_num_seqs)
        prefill_t = self.prefill_token_buckets
        prefill_b = pow2_buckets(1, c.max_prefill_seqs)
        prefill = [(b, t) for b in prefill_b for t in prefill_t]
        self.runner.warmup(decode, prefill)
        v = self.cfg.vocab_size
        for rows in sorted(set(decode) | set(prefill_b)):
            for n in pow2_buckets(1, rows):
                f32, i32 = np.zeros(n, np.float32), np.zeros(n, np.int32)
                for greedy in (True, False):
                    sample_rows(np.zeros((rows, v), np.float32), i32, f32, i32, np.ones(n, np.float32), f32, i32, i32,
                                all_greedy=greedy, penalties=False, num_logprobs=0)

    def run_until_done(self, request_ids: Iterable[str] | None = None) -> None:
        while self.has_unfinished():
            self.step()
