"""Weights: decode tokens/s at 1 and several concurrent requests, and prefill tokens/s, for
single-format weight configurations (bf16, fp8, int4) and the phase-aware one (prefill fp8,
decode int4), interleaved in one process.

A configuration is ``NAME=PREFILL/DECODE`` (weight format specs, or ``none`` for the weights
as loaded). The engine has no int4 prefill copy (prefill is compute-bound; the article keeps
FP8 there). To still measure what INT4 costs in prefill, as the article does, an ``int4``
prefill runs the engine's one-copy mode: the prefill program reads the int4 decode copy
(``prefill_from_decode_weights``). Such rows are marked "emulated", as before.

Per configuration and concurrency c: c random prompts of the same length, greedy, fixed
output length, all submitted at once (one prefill step of c rows, then decode steps of c rows).
Prefill tokens/s = prompt tokens / wall time of the steps that only prefilled; decode
tokens/s = tokens / wall time of the steps that only decoded (sampling and host work
included, as a server sees them).
"""
from __future__ import annotations

import time
from pathlib import Path

from jaxserve.experiments import common, engine_runs

DEFAULT_CONFIGS = (
    "float32=none/none",
    "bf16=bf16/bf16",
    "int8=int8/int8",
    "fp8=fp8:block128/fp8:block128",
    "int4=int4:g32/int4:g32",
    "phase-aware=fp8:block128/int4:g32",
)


def parse_config(spec: str) -> tuple[str, str | None, str | None]:
    """'name=prefill/decode' -> (name, prefill spec | None, decode spec | None)."""
    if "=" not in spec or "/" not in spec.split("=", 1)[1]:
        raise ValueError(f"weight config {spec!r} must look like NAME=PREFILL/DECODE (e.g. fp8=fp8:block128/int4:g32)")
    name, rest = spec.split("=", 1)
    pre, dec = rest.split("/", 1)
    norm = lambda s: None if s.strip().lower() in ("none", "", "float32", "as-loaded") else s.strip()  # noqa: E731
    return name.strip(), norm(pre), norm(dec)


def build(model, name, prefill, decode, dtype, kv_format, num_pages, page_size, max_level, prompt_len, max_len,
          matmul_backend="auto", engine_kw: dict | None = None):
    """-> (LLM, emulated_int4_prefill: bool)."""
    from jaxserve import LLM

    emulate = prefill is not None and prefill.lower().startswith("int4")
    kw = dict(dtype=dtype, kv_format=kv_format, num_pages=num_pages, page_size=page_size,
              max_num_seqs=max_level, max_prefill_seqs=max_level, max_num_batched_tokens=max_level * prompt_len,
              prefill_chunk=max(prompt_len, 16), max_model_len=max_len, enable_prefix_caching=False,
              matmul_backend=matmul_backend, strict_compiles=False)  # warmed per level: counted, not raised
    kw.update(engine_kw or {})
    if emulate:  # the prefill program reads the decode copy (the engine's one-copy mode)
        if decode != prefill:
            raise ValueError(f"{name}: an int4 prefill reads the decode copy: the decode format must be {prefill}")
        llm = LLM(model, decode_weights=decode, prefill_from_decode_weights=True, **kw)
    else:
        llm = LLM(model, prefill_weights=prefill, decode_weights=decode, **kw)
    return llm, emulate


def phase_bytes(llm) -> dict:
    w = llm.memory_report()["weight_bytes"]
    return {p: w[p] for p in ("prefill", "decode")}


def run(
    model: str | None = None,
    configs=DEFAULT_CONFIGS,
    levels=(1, 8),
    prompt_len: int = 128,
    max_tokens: int = 24,
    reps: int = 3,
    kv_format: str = "bf16",
    page_size: int = 16,
    dtype: str = "float32",
    seed: int = 0,
    out_dir: str | Path = common.DEFAULT_OUT,
    name: str = "weights",
    plots: bool = True,
    log=print,
    baseline: str | None = None,
    matmul_backend: str = "auto",
    engine_kw: dict | None = None,
) -> dict:
    """baseline: the configuration the ratios are taken against (default: float32 if run, else
    the first one). engine_kw: further LLM arguments for every configuration (backends, a KV
    byte budget instead of the page count the levels need)."""
    from jaxserve.engine.sampling_params import SamplingParams

    t_start = time.perf_counter()
    meta = {"command": common.command_line(), "machine": common.machine_info(), "model": common.model_label(model)}
    levels = sorted(set(int(c) for c in levels))
    max_level = max(levels)
    per_req = -(-(prompt_len + max_tokens) // page_size)
    llms, info = _load_configs(model, configs, dtype, kv_format, max_level * per_req + 1, page_size, max_level,
                               prompt_len, per_req * page_size, matmul_backend, engine_kw, log)
    vocab = next(iter(llms.values())).cfg.vocab_size
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    warm = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
    names = list(llms)
    runs = []
    for c in levels:
        runs += _run_level(llms, engine_runs.random_prompts(c, prompt_len, vocab, seed + c), warm, params, reps, log)
    baseline = baseline or ("float32" if "float32" in names else names[0])
    if baseline not in names:
        raise ValueError(f"baseline {baseline!r} is not one of the configurations {names}")
    summary = summarize(runs, names, levels, baseline)
    meta["wall_s"] = time.perf_counter() - t_start
    result = {
        "experiment": "weights", "meta": meta,
        "settings": {"configs": list(configs), "levels": levels, "prompt_len": prompt_len, "max_tokens": max_tokens,
                     "reps": reps, "kv_format": kv_format, "page_size": page_size, "dtype": dtype, "seed": seed,
                     "baseline": baseline, "engine": dict(engine_kw or {})},
        "configs": info, "runs": runs, "summary": summary,
    }
    result["files"] = write(result, Path(out_dir), name, plots)
    return result


def _load_configs(model, configs, dtype, kv_format, num_pages, page_size, max_level, prompt_len, max_len,
                  matmul_backend, engine_kw, log) -> tuple[dict, dict]:
    """Every configuration's LLM, and what it runs (formats, matmul paths, bytes per phase)."""
    llms, info = {}, {}
    for name_, pre, dec in [parse_config(c) for c in configs]:  # every spec checked before loading
        log(f"[weights] loading {name_}: prefill {pre or 'as loaded'}, decode {dec or 'as loaded'}")
        llm, emulated = build(model, name_, pre, dec, dtype, kv_format, num_pages, page_size, max_level,
                              prompt_len, max_len, matmul_backend, engine_kw)
        llms[name_] = llm
        info[name_] = {"prefill_weights": pre or f"as loaded ({dtype})", "decode_weights": dec or f"as loaded ({dtype})",
                       "matmul_paths": llm.runner.weight_paths(), "int4_prefill_emulated": emulated,
                       "weight_bytes": phase_bytes(llm)}
    return llms, info


def _run_level(llms: dict, prompts, warm, params, reps: int, log) -> list[dict]:
    """One concurrency level (c = len(prompts)): warm every configuration, then reps timed runs
    each, the first configuration rotating from repeat to repeat."""
    c, names = len(prompts), list(llms)
    for n in names:  # compiles this level's shapes: prefill [c, prompt] and decode [c]
        t = time.perf_counter()
        engine_runs.run_requests(llms[n], prompts, warm)
        llms[n].engine.mark_warm()
        log(f"[weights] c={c} {n}: warm-up {time.perf_counter() - t:.1f}s")
    rows = []
    for rep in range(reps):
        order = names[rep % len(names):] + names[: rep % len(names)]  # rotate who goes first
        for n in order:
            m = engine_runs.run_requests(llms[n], prompts, params)
            rows.append({"config": n, "concurrency": c, "rep": rep, **m.as_dict()})
            log(f"[weights] c={c} rep={rep} {n}: prefill {m.prefill_tok_s:.1f} tok/s, "
                f"decode {m.decode_tok_s:.1f} tok/s, compiles {m.compiles}")
    return rows


def summarize(runs, names, levels, baseline: str = "fp8") -> dict:
    table = []
    for n in names:
        row = {"config": n}
        for c in levels:
            rows = [r for r in runs if r["config"] == n and r["concurrency"] == c]
            d = engine_runs.median_range([r["decode_tok_s"] for r in rows])
            ms = engine_runs.median_range([r["decode_tok_s_median_step"] for r in rows])
            row[f"decodemed_c{c}"], row[f"decodemed_c{c}_min"], row[f"decodemed_c{c}_max"] = ms
            p = engine_runs.median_range([r["prefill_tok_s"] for r in rows])
            row[f"decode_c{c}"], row[f"decode_c{c}_min"], row[f"decode_c{c}_max"] = d
            row[f"prefill_c{c}"], row[f"prefill_c{c}_min"], row[f"prefill_c{c}_max"] = p
            row[f"compiles_c{c}"] = sum(r["compiles"] for r in rows)
        table.append(row)
    # Paired by repeat: within one repeat the configurations ran back to back, so the ratio to
    # the baseline in the same repeat cancels slow drifts of the machine's load.
    paired = {}
    if baseline in names:
        for n in names:
            for c in levels:
                for key in ("decode_tok_s", "prefill_tok_s"):
                    ratios = []
                    for rep in sorted({r["rep"] for r in runs}):
                        a = [r[key] for r in runs if r["config"] == n and r["concurrency"] == c and r["rep"] == rep]
                        b = [r[key] for r in runs if r["config"] == baseline and r["concurrency"] == c and r["rep"] == rep]
                        if a and b and b[0] > 0:
                            ratios.append(a[0] / b[0])
                    paired.setdefault(n, {})[f"{key.split('_')[0]}_c{c}"] = engine_runs.median_range(ratios)
    base = next((t for t in table if t["config"] == baseline), None)
    gains = {}
    if base is not None:
        for t in table:
            gains[t["config"]] = {k: t[k] / base[k] - 1 for k in t
                                  if k.split("_")[0] in ("decode", "decodemed", "prefill") and k.count("_") == 1}
    return {"baseline": baseline, "table": table, "gain_vs_baseline": gains, "paired_ratio_vs_baseline": paired}


def markdown(result: dict) -> str:
    st, info, summ = result["settings"], result["configs"], result["summary"]
    lv = st["levels"]
    lines = [common.header_md("Weights: decode and prefill tokens/s per weight representation", result["meta"])]
    lines.append(
        f"- workload: c requests at once, prompt {st['prompt_len']} random tokens, {st['max_tokens']} greedy output "
        f"tokens, KV {st['kv_format']}, compute dtype {st['dtype']}, {st['reps']} timed repeats per cell after an "
        "untimed warm-up, configurations interleaved (rotating order)\n\n")
    lines.append(common.md_table(
        ["config", "prefill weights", "decode weights", "prefill bytes", "decode bytes"],
        [[n, v["prefill_weights"] + (" (emulated)" if v["int4_prefill_emulated"] else ""), v["decode_weights"],
          f"{v['weight_bytes']['prefill'] / 1e6:.1f} MB", f"{v['weight_bytes']['decode'] / 1e6:.1f} MB"]
         for n, v in info.items()]))
    base = summ.get("baseline", "fp8")
    g = summ.get("gain_vs_baseline", summ.get("gain_vs_fp8", {}))

    def cell(t, k):
        txt = f"{t[k]:.1f} ({t[k + '_min']:.1f}-{t[k + '_max']:.1f})"
        if t["config"] in g and t["config"] != base and k in g[t["config"]]:
            txt += f" {g[t['config']][k]:+.0%}"
        return txt

    lines.append(f"\nDecode tokens/s (median of repeats, min-max; % vs {base}):\n\n")
    lines.append(common.md_table(["config"] + [f"c={c}" for c in lv],
                                 [[t["config"]] + [cell(t, f"decode_c{c}") for c in lv] for t in summ["table"]]))
    pr = summ.get("paired_ratio_vs_baseline", summ.get("paired_ratio_vs_fp8")) or {}
    if pr:
        lines.append(f"\nRatio to {base} paired by repeat (median of the per-repeat ratios, min-max):\n\n")
        cols = [f"decode_c{c}" for c in lv] + [f"prefill_c{c}" for c in lv]
        lines.append(common.md_table(
            ["config"] + [k.replace("_c", " c=") for k in cols],
            [[n] + [f"{v[k][0]:.2f} ({v[k][1]:.2f}-{v[k][2]:.2f})" for k in cols] for n, v in pr.items()]))
    lines.append("\nDecode tokens/s from the median decode step (robust to other load on a shared machine):\n\n")
    lines.append(common.md_table(["config"] + [f"c={c}" for c in lv],
                                 [[t["config"]] + [cell(t, f"decodemed_c{c}") for c in lv] for t in summ["table"]]))
    lines.append(f"\nPrefill tokens/s (prompt tokens / prefill-only step time; c prompts in one step; % vs {base}):\n\n")
    lines.append(common.md_table(["config"] + [f"c={c} ({c * st['prompt_len']} tokens)" for c in lv],
                                 [[t["config"]] + [cell(t, f"prefill_c{c}") for c in lv] for t in summ["table"]]))
    return "".join(lines)


def write(result: dict, out: Path, name: str, plots: bool) -> dict:
    files = {"json": str(out / f"{name}.json"), "markdown": str(out / f"{name}.md")}
    if plots:
        from jaxserve.experiments import plots as P

        png = P.weights_plot(result, out / f"{name}.png")
        if png:
            files["png"] = str(png)
    result["files"] = files
    common.write_json(out / f"{name}.json", result)
    common.write_text(out / f"{name}.md", markdown(result))
    return files
