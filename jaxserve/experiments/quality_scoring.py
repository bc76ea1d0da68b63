"""Scoring for the quality experiment: the configurations (``NAME=KV/PREFILL/DECODE``), a
scorer that drives one LLM's prefill and decode programs over fixed-shape batches of documents
(log-probabilities per position, seeded samples), and the token-by-token comparison with the
reference (negative log-likelihood, KL, top-1 agreement).
How the phases exercise each format is described in ``jaxserve.experiments.quality``.
"""
from __future__ import annotations

import inspect

import numpy as np

from jaxserve.step_batch import StepBatch

REFERENCE = "float32=float32/none/none"
DEFAULT_CONFIGS = (
    "kv-bf16=bf16/none/none",
    "kv-fp8=fp8_e4m3/none/none",
    "w-bf16=float32/bf16/bf16",
    "w-fp8=float32/fp8_e4m3/fp8_e4m3",
    "w-fp8-block128=float32/fp8:block128/fp8:block128",
    "w-int4-g32=float32/none/int4:g32",
    "w-int4-g64=float32/none/int4:g64",
    "w-int4-g128=float32/none/int4:g128",
    "article=fp8_e4m3/fp8:block128/int4:g32",
)


def parse_config(spec: str) -> tuple[str, str, str | None, str | None]:
    """'name=kv/prefill/decode[/head]' -> (name, kv format, prefill weights | None, decode weights | None)."""
    return config_parts(spec)[:4]


def config_parts(spec: str) -> tuple[str, str, str | None, str | None, str | None]:
    """'name=kv/prefill/decode[/head]' -> (name, kv, prefill | None, decode | None, tied head format | None).
    The optional fourth part stores a tied model's head once in that format (``tied_head_weights``)."""
    if "=" not in spec or spec.split("=", 1)[1].count("/") not in (2, 3):
        raise ValueError(f"quality config {spec!r} must look like NAME=KV/PREFILL/DECODE[/HEAD] "
                         "(e.g. kv-fp8=fp8_e4m3/none/none or article=fp8_e4m3/fp8:block128/int4:g32)")
    name, rest = spec.split("=", 1)
    kv, pre, dec, *head = rest.split("/")
    norm = lambda s: None if s.strip().lower() in ("none", "", "as-loaded") else s.strip()  # noqa: E731
    return name.strip(), kv.strip(), norm(pre), norm(dec), norm(head[0]) if head else None


class Scorer:
    """Drives one LLM's prefill and decode programs over fixed-shape batches of documents."""

    def __init__(self, llm, n_tokens: int, batch: int, chunk: int):
        import jax

        self.llm, self.batch, self.chunk = llm, batch, chunk
        s = llm.page_size
        self.per_doc = -(-n_tokens // s)
        from jaxserve.executor.buckets import bucket

        self.table = np.zeros((batch, bucket(self.per_doc)), np.int32)
        for i in range(batch):
            self.table[i, : self.per_doc] = 1 + i * self.per_doc + np.arange(self.per_doc)
        if self.table.max() >= llm.num_pages:
            raise ValueError(f"{llm.num_pages} pages cannot hold {batch} x {self.per_doc} pages")
        self._lsm = jax.jit(lambda x: jax.nn.log_softmax(x, axis=-1))

    def _prefill(self, ids: np.ndarray, b: int, start: int) -> np.ndarray:
        """ids [b, chunk] at positions start.. -> log-probs [b, chunk, V] (prefill program)."""
        B, c = self.batch, self.chunk
        tokens = np.zeros((B, c), np.int32)
        tokens[:b] = ids
        cached = np.zeros(B, np.int32)
        cached[:b] = start
        new = np.zeros(B, np.int32)
        new[:b] = c
        logits = self.llm.runner.run(tokens, cached, new, self.table, all_logits=True)
        return np.asarray(self._lsm(logits))[:b]

    def _decode(self, tok: np.ndarray, b: int, pos: int) -> np.ndarray:
        """tok [b] at position pos -> log-probs [b, V] (decode program, KV read from pages)."""
        B = self.batch
        tokens = np.zeros((B, 1), np.int32)
        tokens[:b, 0] = tok
        cached = np.zeros(B, np.int32)
        cached[:b] = pos
        new = np.zeros(B, np.int32)
        new[:b] = 1
        z = np.zeros_like(self.table)
        res = self.llm.runner.step(StepBatch(tokens, cached, new, self.table, z, np.zeros(B, np.int32), phase="decode"))
        if not res.ok[:b].all():
            raise RuntimeError("decode rows failed the page check (quality runs use integrity_check=False)")
        return np.asarray(self._lsm(res.logits))[:b]

    def trace(self, docs: np.ndarray, P: int, C: int) -> np.ndarray:
        """docs [b, >= P + C] -> log-probs [b, P + C, V]: row t predicts token t + 1."""
        b = len(docs)
        out = None
        for start in range(0, P, self.chunk):
            lp = self._prefill(docs[:, start : start + self.chunk], b, start)
            if out is None:
                out = np.empty((b, P + C, lp.shape[-1]), np.float32)
            out[:, start : start + self.chunk] = lp
        for i in range(C):
            out[:, P + i] = self._decode(docs[:, P + i], b, P + i)
        return out

    def sample(self, prompts: np.ndarray, seeds: np.ndarray, G: int, temperature: float, top_p: float) -> np.ndarray:
        """prompts [b, P], seeds [b] -> sampled tokens [b, G] (engine sampler, seeded per row)."""
        from jaxserve.engine.sampler import sample_rows

        b, P = prompts.shape
        B = self.batch
        temp = np.zeros(B, np.float32)
        temp[:b] = temperature
        tp = np.ones(B, np.float32)
        tp[:b] = top_p
        sd = np.zeros(B, np.int32)
        sd[:b] = seeds
        zi, zf = np.zeros(B, np.int32), np.zeros(B, np.float32)
        out = np.zeros((b, G), np.int32)
        lp = None
        for start in range(0, P, self.chunk):
            lp = self._prefill(prompts[:, start : start + self.chunk], b, start)
        last = np.zeros((B, lp.shape[-1]), np.float32)
        last[:b] = lp[:, -1]
        kw = dict(temperature=temp, top_k=zi, top_p=tp, min_p=zf, seeds=sd)
        if "rows" in inspect.signature(sample_rows).parameters:  # newer sampler: logits row per sample
            kw["rows"] = np.arange(B, dtype=np.int32)
        for i in range(G):
            tok, *_ = sample_rows(last, steps=np.full(B, i, np.int32), **kw,
                                  all_greedy=False, penalties=False, num_logprobs=0)
            out[:, i] = np.asarray(tok)[:b]
            if i + 1 < G:
                last[:b] = self._decode(out[:, i], b, P + i)
        return out


def metrics_vs_ref(lp: np.ndarray, ref: np.ndarray, targets: np.ndarray, step: int = 4):
    """lp, ref [b, T, V]; targets [b, T] -> per-token nll, ref nll, kl, top1 [b, T] (float64).

    Computed a few documents at a time (float64 over the vocabulary is large)."""
    outs = []
    for i in range(0, len(lp), step):
        a, r, tg = lp[i : i + step].astype(np.float64), ref[i : i + step].astype(np.float64), targets[i : i + step]
        nll = -np.take_along_axis(a, tg[..., None], -1)[..., 0]
        nll_ref = -np.take_along_axis(r, tg[..., None], -1)[..., 0]
        kl = np.maximum(np.sum(np.exp(r) * (r - a), axis=-1), 0.0)
        top1 = (a.argmax(-1) == r.argmax(-1)).astype(np.float64)
        outs.append((nll, nll_ref, kl, top1))
    return tuple(np.concatenate([o[k] for o in outs]) for k in range(4))
