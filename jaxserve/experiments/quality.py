"""Quality of KV and weight formats against the float32 reference, on real text.

Corpus: CPython's ``pydoc_data.topics`` (the Python language reference topics that ship with
the interpreter; nobody here wrote them). Each document is the first P + C + 1 tokens of one
topic; D documents are spread evenly over the topics long enough.

How each format is really exercised. A configuration is a KV format plus a prefill and a
decode weight representation (``NAME=KV/PREFILL/DECODE``). For a batch of documents:

1. prefill phase: the first P tokens go through the engine's *prefill* program in chunks of
   ``chunk`` tokens (``runner.run``, all logits). A chunk writes its tokens' KV into the pages
   and attends to them and to every earlier chunk through the pages, i.e. as stored in the KV
   format and dequantized on read (as every step does, so a token's numbers do not depend on
   where chunks split). It computes with the prefill weights, and writes the prefix's KV pages.
2. decode phase: the next C tokens are fed one per step through the engine's *decode* program
   (``runner.step(StepBatch(..., phase="decode"))``, teacher forcing the document's tokens). Every step reads
   the whole context back from the pages (the prefix written by prefill, the rest by earlier
   decode steps) and computes with the decode weights.

Scored: the log-probabilities of every next token, P from the prefill phase and C from the
decode phase, against the same positions of the reference (float32 weights, float32 KV, run
the same way; paged float32 KV is exact, see ``reference_check``). Metrics per token:
negative log-likelihood of the document's next token (-> perplexity), KL(reference || format)
over the whole vocabulary, and whether the argmax (top-1) agrees. Bootstrap 95% intervals
resample documents (tokens of one document share its topic and context, so the document is
the independent unit); differences against the reference are paired (same draws).

Sampled generation, repeated seeds: for the first ``sample_prompts`` documents, the first P
tokens are a prompt and G tokens are sampled (temperature/top-p, the engine's own seeded
sampler ``sample_rows``: key = fold_in(key(seed), step)) through the same prefill and decode
programs, once per seed. Same seed = same random draws, so the reference and a format sample
identical text until their distributions first differ enough to flip a draw. Reported per
format: the share of (prompt, seed) completions identical to the reference's, and the mean
number of tokens before the first difference, with bootstrap intervals over prompts (seeds
averaged within a prompt). The reference against itself with other seeds gives the floor
(what two unrelated samples share); the reference drawn a second time with the same seeds
is its own ``sampling`` entry (reproducibility: every completion identical).

This module runs the experiment; the scorer and the per-token comparison are in
``quality_scoring.py``, the per-document statistics and the tables in ``quality_report.py``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

import numpy as np

from jaxserve.experiments import common
from jaxserve.experiments.quality_report import markdown, ordered, phase_stats, sample_stats, write
from jaxserve.experiments.quality_scoring import (DEFAULT_CONFIGS, REFERENCE, Scorer, config_parts, metrics_vs_ref,
                                                  parse_config)


def _cache_dir() -> Path:
    from jaxserve.checkpoint.gguf import cache_root

    return cache_root() / "experiments"


def run(
    model: str | None = None,
    configs=DEFAULT_CONFIGS,
    docs: int = 24,
    prefix: int = 32,
    cont: int = 32,
    chunk: int = 16,
    batch: int | None = None,
    page_size: int = 16,
    sample_prompts: int = 8,
    seeds: int = 3,
    sample_tokens: int = 24,
    temperature: float = 0.8,
    top_p: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
    resume: bool = False,
    reference_check: bool = True,
    out_dir: str | Path = common.DEFAULT_OUT,
    name: str = "quality",
    plots: bool = True,
    log=print,
    engine_kw: dict | None = None,
) -> dict:
    """engine_kw: further LLM arguments for every configuration (the matmul and attention backends)."""
    t_start = time.perf_counter()
    out = Path(out_dir)
    if prefix % chunk:
        raise ValueError(f"--prefix ({prefix}) must be a multiple of --chunk ({chunk})")
    if sample_tokens > cont:
        raise ValueError("--sample-tokens must be <= --cont (the pages are sized for P + C tokens)")
    meta = {"command": common.command_line(), "machine": common.machine_info(), "model": common.model_label(model)}
    parsed = [config_parts(c) for c in configs]
    ref_name, ref_kv, _, _ = parse_config(REFERENCE)
    batch_size = batch or max(min(docs, 32), sample_prompts * seeds)
    if sample_prompts * seeds > batch_size:
        raise ValueError(f"sample_prompts x seeds ({sample_prompts * seeds}) must fit one batch ({batch_size})")
    t = time.perf_counter()
    run_ = _Run(model, engine_kw or {}, prefix, cont, chunk, batch_size, page_size, sample_tokens, temperature,
                top_p, n_boot, seed, seeds)
    ref_llm = run_.make(ref_kv, None, None)
    settings = run_.pick_documents(ref_llm, docs, sample_prompts)
    log(f"[quality] {len(run_.doc_ids)} documents x ({prefix} prefill + {cont} decode) tokens, batch {batch_size}; "
        f"loaded reference in {time.perf_counter() - t:.1f}s")
    ref = _reference(run_, ref_llm, _cache_dir() / f"quality-ref-{settings['key']}.npz", resume, reference_check, log)
    del ref_llm
    previous, commands = _previous(out / f"{name}.json", settings["key"], resume, log)
    meta["commands"] = commands + [meta["command"]]
    results = {**previous, ref_name: run_.reference_entry(ref)}
    for cname, kv, pre, dec, head in parsed:
        res = results[cname] = run_.score_config(cname, kv, pre, dec, ref, meta, head)
        d = res["phases"]["decode"]
        log(f"[quality] {cname}: decode KL {d['kl']['point']:.2e}, top-1 {d['top1_agreement']['point']:.3f}, "
            f"dPPL {d['delta_ppl']['point']:+.3f}; identical samples {res['sampling']['identical_rate']['point']:.2f} "
            f"({res['seconds']:.0f}s)")
    meta["wall_s"] = time.perf_counter() - t_start
    result = {"experiment": "quality", "meta": meta, "settings": settings, "reference_check": ref["check"],
              "results": results}
    result["files"] = write(result, out, name, plots)
    return result


@dataclasses.dataclass
class _Run:
    """One quality run's fixed settings, its documents and prompts, and how it scores an LLM."""

    model: str | None
    engine_kw: dict
    prefix: int
    cont: int
    chunk: int
    batch: int
    page_size: int
    sample_tokens: int
    temperature: float
    top_p: float
    n_boot: int
    seed: int
    seeds: int
    # set by pick_documents:
    doc_ids: np.ndarray | None = None  # [D, P + C + 1]
    n_prompts: int = 0
    prompts: np.ndarray | None = None  # [n_prompts * seeds, P], prompt-major
    seed_list: np.ndarray | None = None  # [n_prompts * seeds]

    @property
    def n_tokens(self) -> int:
        return self.prefix + self.cont + 1

    def make(self, kv, pre, dec, head=None):
        from jaxserve import LLM

        pages_per_doc = -(-self.n_tokens // self.page_size)
        return LLM(self.model, dtype="float32", kv_format=kv, num_pages=self.batch * pages_per_doc + 1,
                   page_size=self.page_size, prefill_weights=pre, decode_weights=dec, integrity_check=False,
                   enable_prefix_caching=False, max_model_len=pages_per_doc * self.page_size, max_num_seqs=4,
                   **({"tied_head_weights": head} if head else {}), **self.engine_kw)

    def pick_documents(self, ref_llm, docs: int, sample_prompts: int) -> dict:
        """Tokenize the corpus; set doc_ids, the prompts and their seeds; return the settings (with their key)."""
        N = self.n_tokens
        documents = common.corpus_documents(common.tokenize_fn(ref_llm), N, docs)
        if len(documents) < 2:
            raise ValueError(f"only {len(documents)} pydoc topics have {N} tokens; lower --prefix/--cont")
        self.doc_ids = np.array([d[1] for d in documents], np.int32)
        D = len(self.doc_ids)
        self.n_prompts = min(sample_prompts, D)
        settings = {"docs": D, "topics": [d[0] for d in documents], "prefix": self.prefix, "cont": self.cont,
                    "chunk": self.chunk, "batch": self.batch, "page_size": self.page_size,
                    "sample_prompts": self.n_prompts, "seeds": self.seeds, "sample_tokens": self.sample_tokens,
                    "temperature": self.temperature, "top_p": self.top_p, "n_boot": self.n_boot, "seed": self.seed,
                    "model_path": common.resolve_model(self.model), "reference": REFERENCE}
        blob = json.dumps({**settings, "ids": self.doc_ids.tolist()}, sort_keys=True).encode()
        settings["key"] = hashlib.sha256(blob).hexdigest()[:16]
        self.prompts = np.repeat(self.doc_ids[: self.n_prompts, : self.prefix], self.seeds, axis=0)
        self.seed_list = np.tile(np.arange(self.seeds) + 1000 * self.seed, self.n_prompts).astype(np.int32)
        return settings

    def trace_all(self, llm):
        sc = Scorer(llm, self.n_tokens, self.batch, self.chunk)
        b = self.batch
        return sc, [sc.trace(self.doc_ids[i : i + b], self.prefix, self.cont) for i in range(0, len(self.doc_ids), b)]

    def sample(self, sc, offset: int = 0) -> np.ndarray:
        return sc.sample(self.prompts, self.seed_list + offset, self.sample_tokens, self.temperature, self.top_p)

    @property
    def phases(self) -> dict:
        P, C = self.prefix, self.cont
        return {"prefill": slice(0, P), "decode": slice(P, P + C), "all": slice(0, P + C)}

    @property
    def targets(self) -> np.ndarray:
        return self.doc_ids[:, 1 : self.prefix + self.cont + 1]

    def _sampling(self, samples, ref_samples) -> dict:
        return sample_stats(samples, ref_samples, self.n_prompts, self.seeds, self.n_boot, self.seed)

    def reference_entry(self, ref: dict) -> dict:
        lp, tg = ref["lp"], self.targets
        return {
            "spec": REFERENCE, "kv_format": "float32", "prefill_weights": "float32", "decode_weights": "float32",
            "reference": True,
            "phases": {p: phase_stats(*metrics_vs_ref(lp[:, sl], lp[:, sl], tg[:, sl]), slice(None),
                                      self.n_boot, self.seed) for p, sl in self.phases.items()},
            "sampling": self._sampling(ref["again"], ref["samples"]),
            "sampling_other_seeds": self._sampling(ref["other"], ref["samples"]),
        }

    def score_config(self, cname: str, kv, pre, dec, ref: dict, meta: dict, head: str | None = None) -> dict:
        t = time.perf_counter()
        llm = self.make(kv, pre, dec, head)
        sc, parts = self.trace_all(llm)
        samples = self.sample(sc)
        del llm, sc
        b, ref_lp, targets = self.batch, ref["lp"], self.targets
        per = [metrics_vs_ref(lp, ref_lp[i * b : i * b + len(lp)], targets[i * b : i * b + len(lp)])
               for i, lp in enumerate(parts)]
        del parts
        m = tuple(np.concatenate([x[k] for x in per]) for k in range(4))
        return {
            "spec": f"{cname}={kv}/{pre or 'none'}/{dec or 'none'}" + (f"/{head}" if head else ""), "kv_format": kv,
            "prefill_weights": pre or "float32", "decode_weights": dec or "float32", "tied_head": head or "as loaded",
            "phases": {p: phase_stats(*m, sl, self.n_boot, self.seed) for p, sl in self.phases.items()},
            "kl_by_position": m[2].mean(0).tolist(),
            "sampling": self._sampling(samples, ref["samples"]),
            "seconds": time.perf_counter() - t, "command": meta["command"], "date_utc": meta["machine"]["date_utc"],
        }


def _reference(run_: _Run, ref_llm, cache: Path, resume: bool, reference_check: bool, log) -> dict:
    """The reference's log-probs and samples, cached on disk by settings key so --resume runs can add formats."""
    if resume and cache.exists() and "again" in np.load(cache).files:
        z = np.load(cache)
        log(f"[quality] reference from {cache}")
        return {"lp": z["lp"], "samples": z["samples"], "other": z["other"], "again": z["again"],
                "check": json.loads(str(z["check"]))}
    t = time.perf_counter()
    sc, parts = run_.trace_all(ref_llm)
    ref = {"lp": np.concatenate(parts), "samples": run_.sample(sc), "other": run_.sample(sc, 7919)}
    ref["again"] = run_.sample(sc)  # a second draw
    ref["check"] = {}
    if reference_check:  # paged float32 scoring vs one unpaged full forward of each document
        k, n = min(4, len(run_.doc_ids)), run_.prefix + run_.cont
        diffs = [np.abs(ref_llm.logprobs(run_.doc_ids[i, :n].tolist()) - ref["lp"][i]).max() for i in range(k)]
        ref["check"] = {"documents": k, "max_abs_logprob_diff_vs_full_forward": float(max(diffs))}
        log(f"[quality] reference check: paged scoring vs full forward max |dlogp| = {max(diffs):.2e}")
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.savez(cache, lp=ref["lp"], samples=ref["samples"], other=ref["other"], again=ref["again"],
             check=json.dumps(ref["check"]))
    log(f"[quality] reference scored in {time.perf_counter() - t:.1f}s")
    return ref


def _previous(jpath: Path, key: str, resume: bool, log) -> tuple[dict, list]:
    """--resume: the results and commands of an earlier run with the same settings key, else none."""
    if resume and jpath.exists():
        old = json.loads(jpath.read_text())
        if old.get("settings", {}).get("key") == key:
            log(f"[quality] resuming: {len(old.get('results', {}))} configurations already in {jpath}")
            return old.get("results", {}), old["meta"].get("commands", [old["meta"]["command"]])
    return {}, []


__all__ = ["DEFAULT_CONFIGS", "REFERENCE", "markdown", "ordered", "parse_config", "run", "write"]
