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
   (``runner.step("decode", ...)``, teacher forcing the document's tokens). Every step reads
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
"""
from __future__ import annotations

import hashlib
import inspect
import json
import time
from pathlib import Path

import numpy as np

from jaxserve.experiments import common, stats

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
    """'name=kv/prefill/decode' -> (name, kv format, prefill weights | None, decode weights | None)."""
    if "=" not in spec or spec.split("=", 1)[1].count("/") != 2:
        raise ValueError(f"quality config {spec!r} must look like NAME=KV/PREFILL/DECODE "
                         "(e.g. kv-fp8=fp8_e4m3/none/none or article=fp8_e4m3/fp8:block128/int4:g32)")
    name, rest = spec.split("=", 1)
    kv, pre, dec = rest.split("/")
    norm = lambda s: None if s.strip().lower() in ("none", "", "as-loaded") else s.strip()  # noqa: E731
    return name.strip(), kv.strip(), norm(pre), norm(dec)


class _Scorer:
    """Drives one LLM's prefill and decode programs over fixed-shape batches of documents."""

    def __init__(self, llm, n_tokens: int, batch: int, chunk: int):
        import jax

        self.llm, self.batch, self.chunk = llm, batch, chunk
        s = llm.page_size
        self.per_doc = -(-n_tokens // s)
        from jaxserve.runner import bucket

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
        res = self.llm.runner.step("decode", tokens, cached, new, self.table, z, np.zeros(B, np.int32))
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


def _metrics_vs_ref(lp: np.ndarray, ref: np.ndarray, targets: np.ndarray, step: int = 4):
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


def _phase_stats(nll, nll_ref, kl, top1, sl, n_boot, seed) -> dict:
    """Per-document sums over positions `sl`, then bootstrap CIs over documents."""
    n = np.full(nll.shape[0], nll[:, sl].shape[1], np.float64)
    a, r, k, t = (x[:, sl].sum(1) for x in (nll, nll_ref, kl, top1))
    w = stats.resample_weights(len(n), n_boot, seed)
    return {
        "tokens": int(n.sum()), "documents": int(len(n)),
        "ppl": stats.ratio_ci(a, n, transform=np.exp, weights=w).as_dict(),
        "ppl_reference": stats.ratio_ci(r, n, transform=np.exp, weights=w).as_dict(),
        "delta_ppl": stats.paired_ratio_diff_ci(a, r, n, n_boot, seed, transform=np.exp).as_dict(),
        "kl": stats.ratio_ci(k, n, weights=w).as_dict(),
        "top1_agreement": stats.ratio_ci(t, n, weights=w).as_dict(),
        "per_doc": {"nll_sum": a.tolist(), "nll_ref_sum": r.tolist(), "kl_sum": k.tolist(),
                    "top1_sum": t.tolist(), "tokens": n.tolist()},
    }


def _sample_stats(samples: np.ndarray, ref: np.ndarray, n_prompts: int, n_seeds: int, n_boot: int, seed: int) -> dict:
    """samples, ref [n_prompts * n_seeds, G] (prompt-major) -> agreement with CIs over prompts."""
    G = samples.shape[1]
    same = samples == ref
    first_diff = np.where(same.all(1), G, np.argmin(same, axis=1)).astype(np.float64)
    ident = same.all(1).astype(np.float64)
    first_tok = same[:, 0].astype(np.float64)
    per = lambda x: x.reshape(n_prompts, n_seeds).mean(1)  # noqa: E731
    return {
        "completions": int(len(samples)), "prompts": n_prompts, "seeds": n_seeds, "tokens_each": G,
        "identical_rate": stats.mean_ci(per(ident), n_boot, seed).as_dict(),
        "tokens_before_first_difference": stats.mean_ci(per(first_diff), n_boot, seed).as_dict(),
        "first_token_agreement": stats.mean_ci(per(first_tok), n_boot, seed).as_dict(),
    }


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
    from jaxserve import LLM

    t_start = time.perf_counter()
    out = Path(out_dir)
    if prefix % chunk:
        raise ValueError(f"--prefix ({prefix}) must be a multiple of --chunk ({chunk})")
    if sample_tokens > cont:
        raise ValueError("--sample-tokens must be <= --cont (the pages are sized for P + C tokens)")
    meta = {"command": common.command_line(), "machine": common.machine_info(), "model": common.model_label(model)}
    parsed = [parse_config(c) for c in configs]
    ref_name, ref_kv, _, _ = parse_config(REFERENCE)
    N = prefix + cont + 1
    path = common.resolve_model(model)

    def make(kv, pre, dec):
        n_docs_pages = batch_size * (-(-N // page_size)) + 1
        return LLM(model, dtype="float32", kv_format=kv, num_pages=n_docs_pages, page_size=page_size,
                   prefill_weights=pre, decode_weights=dec, integrity_check=False, enable_prefix_caching=False,
                   max_model_len=-(-N // page_size) * page_size, max_num_seqs=4, **(engine_kw or {}))

    batch_size = batch or max(min(docs, 32), sample_prompts * seeds)
    if sample_prompts * seeds > batch_size:
        raise ValueError(f"sample_prompts x seeds ({sample_prompts * seeds}) must fit one batch ({batch_size})")
    t = time.perf_counter()
    ref_llm = make(ref_kv, None, None)
    tokenize = common.tokenize_fn(ref_llm)
    documents = common.corpus_documents(tokenize, N, docs)
    if len(documents) < 2:
        raise ValueError(f"only {len(documents)} pydoc topics have {N} tokens; lower --prefix/--cont")
    doc_ids = np.array([d[1] for d in documents], np.int32)
    D = len(doc_ids)
    n_prompts = min(sample_prompts, D)
    settings = {"docs": D, "topics": [d[0] for d in documents], "prefix": prefix, "cont": cont, "chunk": chunk,
                "batch": batch_size, "page_size": page_size, "sample_prompts": n_prompts, "seeds": seeds,
                "sample_tokens": sample_tokens, "temperature": temperature, "top_p": top_p, "n_boot": n_boot,
                "seed": seed, "model_path": path, "reference": REFERENCE}
    key = hashlib.sha256(json.dumps({**settings, "ids": doc_ids.tolist()}, sort_keys=True).encode()).hexdigest()[:16]
    settings["key"] = key
    prompts = np.repeat(doc_ids[:n_prompts, :prefix], seeds, axis=0)
    seed_list = np.tile(np.arange(seeds) + 1000 * seed, n_prompts).astype(np.int32)
    log(f"[quality] {D} documents x ({prefix} prefill + {cont} decode) tokens, batch {batch_size}; "
        f"loaded reference in {time.perf_counter() - t:.1f}s")

    def trace_all(llm):
        sc = _Scorer(llm, N, batch_size, chunk)
        return sc, [sc.trace(doc_ids[i : i + batch_size], prefix, cont) for i in range(0, D, batch_size)]

    # ---- reference (cached on disk by settings key, so --resume runs can add formats)
    cache = _cache_dir() / f"quality-ref-{key}.npz"
    if resume and cache.exists() and "again" in np.load(cache).files:
        z = np.load(cache)
        ref_lp, ref_samples, ref_other, ref_again = z["lp"], z["samples"], z["other"], z["again"]
        ref_check = json.loads(str(z["check"]))
        log(f"[quality] reference from {cache}")
    else:
        t = time.perf_counter()
        sc, parts = trace_all(ref_llm)
        ref_lp = np.concatenate(parts)
        ref_samples = sc.sample(prompts, seed_list, sample_tokens, temperature, top_p)
        ref_other = sc.sample(prompts, seed_list + 7919, sample_tokens, temperature, top_p)
        ref_again = sc.sample(prompts, seed_list, sample_tokens, temperature, top_p)  # a second draw
        ref_check = {}
        if reference_check:  # paged float32 scoring vs one unpaged full forward of each document
            k = min(4, D)
            diffs = [np.abs(ref_llm.logprobs(doc_ids[i, : prefix + cont].tolist()) - ref_lp[i]).max() for i in range(k)]
            ref_check = {"documents": k, "max_abs_logprob_diff_vs_full_forward": float(max(diffs))}
            log(f"[quality] reference check: paged scoring vs full forward max |dlogp| = {max(diffs):.2e}")
        cache.parent.mkdir(parents=True, exist_ok=True)
        np.savez(cache, lp=ref_lp, samples=ref_samples, other=ref_other, again=ref_again, check=json.dumps(ref_check))
        log(f"[quality] reference scored in {time.perf_counter() - t:.1f}s")
    del ref_llm

    targets = doc_ids[:, 1 : prefix + cont + 1]
    phases = {"prefill": slice(0, prefix), "decode": slice(prefix, prefix + cont), "all": slice(0, prefix + cont)}
    previous, commands = {}, []
    jpath = out / f"{name}.json"
    if resume and jpath.exists():
        old = json.loads(jpath.read_text())
        if old.get("settings", {}).get("key") == key:
            previous = old.get("results", {})
            commands = old["meta"].get("commands", [old["meta"]["command"]])
            log(f"[quality] resuming: {len(previous)} configurations already in {jpath}")
    meta["commands"] = commands + [meta["command"]]
    results = dict(previous)
    results[ref_name] = {
        "spec": REFERENCE, "kv_format": "float32", "prefill_weights": "float32", "decode_weights": "float32",
        "reference": True,
        "phases": {p: _phase_stats(*_metrics_vs_ref(ref_lp[:, sl], ref_lp[:, sl], targets[:, sl]), slice(None),
                                   n_boot, seed) for p, sl in phases.items()},
        "sampling": _sample_stats(ref_again, ref_samples, n_prompts, seeds, n_boot, seed),
        "sampling_other_seeds": _sample_stats(ref_other, ref_samples, n_prompts, seeds, n_boot, seed),
    }
    for cname, kv, pre, dec in parsed:
        t = time.perf_counter()
        llm = make(kv, pre, dec)
        sc, parts = trace_all(llm)
        samples = sc.sample(prompts, seed_list, sample_tokens, temperature, top_p)
        del llm, sc
        per = [_metrics_vs_ref(lp, ref_lp[i * batch_size : i * batch_size + len(lp)],
                               targets[i * batch_size : i * batch_size + len(lp)]) for i, lp in enumerate(parts)]
        del parts
        m = tuple(np.concatenate([x[k] for x in per]) for k in range(4))
        res = {
            "spec": f"{cname}={kv}/{pre or 'none'}/{dec or 'none'}", "kv_format": kv,
            "prefill_weights": pre or "float32", "decode_weights": dec or "float32",
            "phases": {p: _phase_stats(*m, sl, n_boot, seed) for p, sl in phases.items()},
            "kl_by_position": m[2].mean(0).tolist(),
            "sampling": _sample_stats(samples, ref_samples, n_prompts, seeds, n_boot, seed),
            "seconds": time.perf_counter() - t, "command": meta["command"], "date_utc": meta["machine"]["date_utc"],
        }
        results[cname] = res
        d = res["phases"]["decode"]
        log(f"[quality] {cname}: decode KL {d['kl']['point']:.2e}, top-1 {d['top1_agreement']['point']:.3f}, "
            f"dPPL {d['delta_ppl']['point']:+.3f}; identical samples {res['sampling']['identical_rate']['point']:.2f} "
            f"({res['seconds']:.0f}s)")
    meta["wall_s"] = time.perf_counter() - t_start
    result = {"experiment": "quality", "meta": meta, "settings": settings, "reference_check": ref_check,
              "results": results}
    result["files"] = write(result, out, name, plots)
    return result


def ordered(results: dict) -> dict:
    """Reference first, then the default configurations in their order, then any others."""
    rank = {parse_config(c)[0]: i for i, c in enumerate(DEFAULT_CONFIGS)}
    keys = sorted(results, key=lambda n: (not results[n].get("reference"), rank.get(n, len(rank)), n))
    return {k: results[k] for k in keys}


def markdown(result: dict) -> str:
    st, res = result["settings"], ordered(result["results"])
    lines = [common.header_md("Quality: KV and weight formats vs the float32 reference on pydoc text", result["meta"])]
    lines.append(
        f"- corpus: CPython `pydoc_data.topics`, {st['docs']} topics, first {st['prefix'] + st['cont'] + 1} tokens "
        f"each; {st['prefix']} positions scored through the prefill program (chunks of {st['chunk']}, later chunks "
        f"read earlier ones from KV pages), {st['cont']} through the decode program (one token per step, all context "
        f"from KV pages)\n"
        f"- reference: float32 weights + float32 KV, scored the same way"
        + (f"; paged reference vs one full forward: max |d logprob| = "
           f"{result['reference_check']['max_abs_logprob_diff_vs_full_forward']:.1e}"
           if result.get("reference_check") else "") + "\n"
        f"- 95% bootstrap intervals ({st['n_boot']} replicates) over documents; dPPL paired with the reference\n"
        f"- sampling: {st['sample_prompts']} prompts ({st['prefix']} tokens) x {st['seeds']} seeds x "
        f"{st['sample_tokens']} tokens, temperature {st['temperature']}, top-p {st['top_p']}; same seeds as the "
        "reference; intervals over prompts\n\n")
    for phase, title in (("decode", "Decode phase (KV read from pages; decode weights)"),
                         ("prefill", "Prefill phase (chunked; prefill weights)")):
        lines.append(f"{title}:\n\n")
        rows = []
        for n, r in res.items():
            p = r["phases"][phase]
            rows.append([n, r["kv_format"], r["prefill_weights"], r["decode_weights"], stats.CI(**p["ppl"]).fmt(3),
                         "-" if r.get("reference") else stats.CI(**p["delta_ppl"]).fmt(3, signed=True),
                         "-" if r.get("reference") else stats.CI(**p["kl"]).fmt(2, kind="e"),
                         "-" if r.get("reference") else stats.CI(**p["top1_agreement"]).fmt(1, scale=100)])
        lines.append(common.md_table(
            ["config", "KV", "prefill w", "decode w", "perplexity", "dPPL vs ref", "KL(ref, fmt) nats/token",
             "top-1 agreement %"], rows))
        lines.append("\n")
    lines.append("Sampled generation, same seeds as the reference:\n\n")
    rows = []
    for n, r in res.items():
        key = "sampling_other_seeds" if r.get("reference") else "sampling"
        s = r[key]
        rows.append([n + (" (other seeds: the floor)" if r.get("reference") else ""),
                     stats.CI(**s["identical_rate"]).fmt(1, scale=100),
                     stats.CI(**s["tokens_before_first_difference"]).fmt(1),
                     stats.CI(**s["first_token_agreement"]).fmt(1, scale=100)])
    lines.append(common.md_table(["config", "identical completions %", "tokens before first difference",
                                  "first token same %"], rows))
    return "".join(lines)


def write(result: dict, out: Path, name: str, plots: bool) -> dict:
    files = {"json": str(out / f"{name}.json"), "markdown": str(out / f"{name}.md")}
    if plots:
        from jaxserve.experiments import plots as P

        shown = dict(result, results=ordered(result["results"]))  # the plots draw in the tables' order
        for tag, fn in (("png", P.quality_plot), ("png_positions", P.quality_position_plot)):
            png = fn(shown, out / (f"{name}.png" if tag == "png" else f"{name}_kl_by_position.png"))
            if png:
                files[tag] = str(png)
    result["files"] = files
    common.write_json(out / f"{name}.json", result)
    common.write_text(out / f"{name}.md", markdown(result))
    return files
