"""Statistics and reports of the quality experiment: per-document sums with bootstrap
intervals over documents (or over prompts for sampled generation), the markdown tables, and the
JSON / markdown / PNG files.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxserve.experiments import common, stats
from jaxserve.experiments.quality_scoring import DEFAULT_CONFIGS, parse_config


def phase_stats(nll, nll_ref, kl, top1, sl, n_boot, seed) -> dict:
    """Per-document sums over positions `sl`, then bootstrap CIs over documents."""
    n = np.full(nll.shape[0], nll[:, sl].shape[1], np.float64)
    a, r, k, t = (x[:, sl].sum(1) for x in (nll, nll_ref, kl, top1))
    # Same seed, same documents: every interval below is drawn from the same replicates.
    return {
        "tokens": int(n.sum()), "documents": int(len(n)),
        "ppl": stats.ratio_ci(a, n, n_boot, seed, transform=np.exp).as_dict(),
        "ppl_reference": stats.ratio_ci(r, n, n_boot, seed, transform=np.exp).as_dict(),
        "delta_ppl": stats.paired_ratio_diff_ci(a, r, n, n_boot, seed, transform=np.exp).as_dict(),
        "kl": stats.ratio_ci(k, n, n_boot, seed).as_dict(),
        "top1_agreement": stats.ratio_ci(t, n, n_boot, seed).as_dict(),
        "per_doc": {"nll_sum": a.tolist(), "nll_ref_sum": r.tolist(), "kl_sum": k.tolist(),
                    "top1_sum": t.tolist(), "tokens": n.tolist()},
    }


def sample_stats(samples: np.ndarray, ref: np.ndarray, n_prompts: int, n_seeds: int, n_boot: int, seed: int) -> dict:
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
