"""Capacity: decode throughput against concurrency under a fixed KV memory budget in bytes.

Each KV format gets as many pages as the budget buys (num_pages = budget // bytes per page,
page 0, the null page, included), so FP8 pages (half the value bytes, plus one float32 scale
per token and KV head) give about 1.9x the pages of BF16 for the same bytes. Concurrency
doubles 1, 2, 4, ... and each format is run up to and including the first level where it runs
out of KV (a request preempted, or fewer admitted than asked), so the last point of each
format is the one where it no longer fits. Levels and formats are interleaved in one process:
at each level, each repeat runs every still-fitting format back to back (alternating which
goes first), so machine noise hits them alike.

Per run: c requests with random prompts of the same length, greedy, fixed output length
(ignore EOS), all submitted at once; the engine may admit them all in one prefill step.
Measured: decode tokens/s over the steps that only decoded (what the article's decode pool
measures), end-to-end output tokens/s (prefill, recompute after preemption and waiting
included), the highest number of sequences running at once (``scheduler.running``), the
mean decode batch and the preemption count.
"""
from __future__ import annotations

import time
from pathlib import Path

from jaxserve.experiments import common, engine_runs

DEFAULT_BUDGET = "6.5MB"
DEFAULT_FORMATS = ("bf16", "fp8_e4m3")


def _pages_per_request(prompt_len: int, max_tokens: int, page_size: int) -> int:
    return -(-(prompt_len + max_tokens) // page_size)


def _load_format(model, path: str, fmt: str, kv_budget: int, per_req: int, page_size: int, prompt_len: int, max_level: int,
                 dtype: str, engine_kw: dict, log):
    """One KV format's LLM on the byte budget, checked to hold exactly the pages the budget buys."""
    from jaxserve import LLM

    bpp = common.kv_bytes_per_page(path, fmt, page_size, dtype)
    num_pages = kv_budget // bpp
    if num_pages < per_req + 1:
        raise ValueError(f"a KV budget of {kv_budget} B buys {num_pages} {fmt} pages of {bpp} B; "
                         f"one request needs {per_req} pages plus the null page")
    log(f"[capacity] {fmt}: {bpp} B/page -> {num_pages} pages in {kv_budget} B; loading")
    # The engine sizes its own pool from the byte budget (kv_cache_memory), as a server does.
    llm = LLM(model, dtype=dtype, kv_format=fmt, kv_cache_memory=kv_budget, page_size=page_size,
              max_num_seqs=max_level, max_prefill_seqs=max_level,
              max_num_batched_tokens=max_level * prompt_len, prefill_chunk=max(prompt_len, 16),
              max_model_len=per_req * page_size, enable_prefix_caching=False,
              strict_compiles=False,  # warmed level by level: compilations are counted, not raised
              **engine_kw)
    if llm.num_pages != num_pages:
        raise AssertionError(f"{fmt}: the engine made {llm.num_pages} pages of the budget, expected {num_pages}")
    held = llm.memory_report()["kv_bytes"]
    if held != num_pages * bpp or held > kv_budget:
        raise AssertionError(f"{fmt}: runner holds {held} B of KV, expected {num_pages} x {bpp} <= {kv_budget}")
    return llm, {
        "bytes_per_page": bpp, "bytes_per_token": bpp / page_size, "num_pages": num_pages,
        "kv_bytes_held": held, "usable_pages": num_pages - 1, "token_slots": (num_pages - 1) * page_size,
        "requests_that_fit": (num_pages - 1) // per_req, "weight_formats": llm.runner.weight_formats,
    }


def _run_level(llms: dict, prompts, params, reps: int, log) -> list[dict]:
    """One concurrency level (c = len(prompts)): warm every format, then reps timed runs each, in
    alternating order."""
    c = len(prompts)
    # Warm-up: the same workload once per format (deterministic scheduling, so the timed
    # runs visit exactly the shapes compiled here); then count any compile as a flaw.
    for fmt, llm in llms.items():
        t = time.perf_counter()
        engine_runs.run_requests(llm, prompts, params)
        llm.engine.mark_warm()
        log(f"[capacity] c={c} {fmt}: warm-up {time.perf_counter() - t:.1f}s")
    rows = []
    active = list(llms)
    for rep in range(reps):
        for fmt in active if rep % 2 == 0 else active[::-1]:
            m = engine_runs.run_requests(llms[fmt], prompts, params)
            rows.append({"kv_format": fmt, "concurrency": c, "rep": rep, **m.as_dict()})
            log(f"[capacity] c={c} rep={rep} {fmt}: decode {m.decode_tok_s:.1f} tok/s, "
                f"output {m.output_tok_s:.1f} tok/s, max running {m.max_running}, "
                f"preemptions {m.preemptions}, compiles {m.compiles}")
    return rows


def run(
    model: str | None = None,
    kv_budget: int = 6_500_000,
    kv_formats=DEFAULT_FORMATS,
    levels: list[int] | None = None,
    max_concurrency: int = 64,
    prompt_len: int = 32,
    max_tokens: int = 32,
    reps: int = 2,
    page_size: int = 16,
    dtype: str = "float32",
    seed: int = 0,
    out_dir: str | Path = common.DEFAULT_OUT,
    name: str = "capacity",
    plots: bool = True,
    log=print,
    engine_kw: dict | None = None,
) -> dict:
    """engine_kw: further LLM arguments every format's engine gets (weight formats, backends)."""
    from jaxserve.engine.sampling_params import SamplingParams

    t_start = time.perf_counter()
    meta = {"command": common.command_line(), "machine": common.machine_info(), "model": common.model_label(model)}
    path = common.resolve_model(model)
    per_req = _pages_per_request(prompt_len, max_tokens, page_size)
    max_level = max(levels) if levels else max_concurrency
    llms, formats = {}, {}
    for fmt in kv_formats:
        llms[fmt], formats[fmt] = _load_format(model, path, fmt, kv_budget, per_req, page_size, prompt_len, max_level,
                                               dtype, engine_kw or {}, log)
    vocab = next(iter(llms.values())).cfg.vocab_size
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    if levels is None:
        levels = [2**k for k in range(max(max_concurrency, 0).bit_length())]  # 1, 2, 4, ... <= max_concurrency
    active = list(kv_formats)
    runs = []
    for c in levels:
        if not active:
            break
        prompts = engine_runs.random_prompts(c, prompt_len, vocab, seed + c)
        rows = _run_level({f: llms[f] for f in active}, prompts, params, reps, log)
        runs += rows
        # A format is out of KV at this level once a run preempted or could not run all c at once.
        out_of_kv = {r["kv_format"] for r in rows if r["preemptions"] > 0 or r["max_running"] < c}
        active = [f for f in active if f not in out_of_kv]

    summary = summarize(runs, formats)
    meta["wall_s"] = time.perf_counter() - t_start
    result = {
        "experiment": "capacity", "meta": meta,
        "settings": {"kv_budget_bytes": kv_budget, "kv_formats": list(kv_formats), "levels": levels,
                     "prompt_len": prompt_len, "max_tokens": max_tokens, "reps": reps, "page_size": page_size,
                     "dtype": dtype, "seed": seed, "pages_per_request": per_req,
                     "engine": dict(engine_kw or {})},
        "formats": formats, "runs": runs, "summary": summary,
    }
    out = Path(out_dir)
    result["files"] = write(result, out, name, plots)
    return result


def summarize(runs: list[dict], formats: dict) -> dict:
    table = []
    for fmt in formats:
        for c in sorted({r["concurrency"] for r in runs if r["kv_format"] == fmt}):
            rows = [r for r in runs if r["kv_format"] == fmt and r["concurrency"] == c]
            dec = engine_runs.median_range([r["decode_tok_s"] for r in rows])
            outp = engine_runs.median_range([r["output_tok_s"] for r in rows])
            table.append({
                "kv_format": fmt, "concurrency": c, "reps": len(rows),
                "decode_tok_s": dec[0], "decode_tok_s_min": dec[1], "decode_tok_s_max": dec[2],
                "output_tok_s": outp[0], "output_tok_s_min": outp[1], "output_tok_s_max": outp[2],
                "max_running": max(r["max_running"] for r in rows),
                "mean_decode_batch": sum(r["mean_running_decode"] for r in rows) / len(rows),
                "preemptions": max(r["preemptions"] for r in rows),
                "fits": all(r["preemptions"] == 0 and r["max_running"] >= c for r in rows),
                "compiles_in_timed_runs": sum(r["compiles"] for r in rows),
            })
    per_format = {}
    for fmt in formats:
        rows = [t for t in table if t["kv_format"] == fmt]
        if not rows:
            continue
        fit = [t for t in rows if t["fits"]]
        best = max(fit or rows, key=lambda t: t["decode_tok_s"])
        per_format[fmt] = {
            "highest_admitted_concurrency": max(t["max_running"] for t in rows),
            "highest_concurrency_without_preemption": max((t["concurrency"] for t in fit), default=0),
            "peak_decode_tok_s_fitting": best["decode_tok_s"], "peak_at_concurrency": best["concurrency"],
            "peak_output_tok_s": max(t["output_tok_s"] for t in rows),
        }
    s = {"table": table, "per_format": per_format}
    if "bf16" in per_format and "fp8_e4m3" in per_format:
        a, b = per_format["bf16"], per_format["fp8_e4m3"]
        s["fp8_vs_bf16_peak_decode_gain"] = b["peak_decode_tok_s_fitting"] / a["peak_decode_tok_s_fitting"] - 1
        s["fp8_vs_bf16_peak_output_gain"] = b["peak_output_tok_s"] / a["peak_output_tok_s"] - 1
        same = []
        for ta in table:
            if ta["kv_format"] != "bf16":
                continue
            tb = [t for t in table if t["kv_format"] == "fp8_e4m3" and t["concurrency"] == ta["concurrency"]]
            if tb and ta["fits"] and tb[0]["fits"]:
                same.append({"concurrency": ta["concurrency"],
                             "fp8_over_bf16_decode": tb[0]["decode_tok_s"] / ta["decode_tok_s"]})
        s["equal_concurrency_ratio"] = same
    return s


def markdown(result: dict) -> str:
    st, fm, summ = result["settings"], result["formats"], result["summary"]
    title = "Capacity: decode throughput vs concurrency under a fixed KV byte budget"
    lines = [common.header_md(title, result["meta"])]
    lines.append(
        f"- workload: c requests at once, prompt {st['prompt_len']} random tokens, {st['max_tokens']} greedy output "
        f"tokens (EOS ignored), page size {st['page_size']}, weights/activations {st['dtype']}, "
        f"{st['reps']} timed repeats per cell after one untimed warm-up, formats interleaved\n"
    )
    lines.append(f"- KV budget: {st['kv_budget_bytes']:,} bytes\n\n")
    lines.append(common.md_table(
        ["KV format", "bytes/page", "pages in budget", "token slots", "requests that fit"],
        [[f, f"{v['bytes_per_page']:,}", v["num_pages"], v["token_slots"], v["requests_that_fit"]]
         for f, v in fm.items()]))
    lines.append("\n")
    fmts = list(fm)
    levels = sorted({t["concurrency"] for t in summ["table"]})

    def cell(f, c, key):
        t = [x for x in summ["table"] if x["kv_format"] == f and x["concurrency"] == c]
        if not t:
            return "out of KV (not run)"
        t = t[0]
        txt = f"{t[key]:.1f} ({t[key + '_min']:.1f}-{t[key + '_max']:.1f})"
        if not t["fits"]:
            txt += (f" **out of KV**: max {t['max_running']} running, mean decode batch {t['mean_decode_batch']:.1f}, "
                    f"{t['preemptions']} preemptions")
        return txt

    lines.append("Decode tokens/s (median of repeats, min-max), steps that only decoded:\n\n")
    lines.append(common.md_table(["concurrent requests"] + fmts,
                                 [[c] + [cell(f, c, "decode_tok_s") for f in fmts] for c in levels]))
    lines.append("\nEnd-to-end output tokens/s (whole batch wall time: prefill, recompute and waiting included):\n\n")
    lines.append(common.md_table(["concurrent requests"] + fmts,
                                 [[c] + [cell(f, c, "output_tok_s") for f in fmts] for c in levels]))
    lines.append("\n")
    lines.append(common.md_table(
        ["KV format", "highest admitted concurrency (max running)", "highest without preemption",
         "peak decode tok/s (fitting)", "at c", "peak output tok/s"],
        [[f, v["highest_admitted_concurrency"], v["highest_concurrency_without_preemption"],
          f"{v['peak_decode_tok_s_fitting']:.1f}", v["peak_at_concurrency"], f"{v['peak_output_tok_s']:.1f}"]
         for f, v in summ["per_format"].items()]))
    if "fp8_vs_bf16_peak_decode_gain" in summ:
        lines.append(f"\nFP8 vs BF16 peak decode tok/s (each at its best fitting concurrency): "
                     f"{summ['fp8_vs_bf16_peak_decode_gain']:+.1%}; peak end-to-end output tok/s: "
                     f"{summ['fp8_vs_bf16_peak_output_gain']:+.1%}. At equal concurrency (both fitting), "
                     "FP8/BF16 decode: " + ", ".join(f"c={x['concurrency']}: {x['fp8_over_bf16_decode']:.2f}"
                                                     for x in summ["equal_concurrency_ratio"]) + "\n")
    return "".join(lines)


def write(result: dict, out: Path, name: str, plots: bool) -> dict:
    files = {"json": str(out / f"{name}.json"), "markdown": str(out / f"{name}.md")}
    if plots:
        from jaxserve.experiments import plots as P

        png = P.capacity_plot(result, out / f"{name}.png")
        if png:
            files["png"] = str(png)
    result["files"] = files
    common.write_json(out / f"{name}.json", result)
    common.write_text(out / f"{name}.md", markdown(result))
    return files
