"""Serve a benchmark workload on an LLM's engine and measure it: arrivals by the workload's
clock, every token timed when the ``engine.step()`` that produced it returns, a step observer
for KV pages and decode / prefill work, compilations counted during the timed run; the
summary figures (tokens/s, TTFT / inter-token / end-to-end latency percentiles) and their
text table. ``offline.py`` is the ``jaxserve bench`` command line around it.
"""
from __future__ import annotations

import dataclasses
import sys
import time

from jaxserve.bench.measure import CompileWatch, fmt, format_table, summary
from jaxserve.bench.workload import BenchRequest, warmup_workload


@dataclasses.dataclass
class _Record:
    submit: float
    token_times: list[float] = dataclasses.field(default_factory=list)
    finish: float | None = None
    completion: object = None


def _observe(engine, probe: dict):
    """A step observer recording, per program call, the KV pages in use (the step's peak:
    pages are allocated when a step is scheduled and freed after its programs ran) and the
    decode / prefill work. Returns the function that removes it."""

    def seen(rec) -> None:
        probe["peak_pages"] = max(probe["peak_pages"], engine.snapshot().kv_pages_used)
        if rec.phase == "decode":
            probe["decode_rows"] += rec.rows
            probe["decode_steps"] += 1
        else:
            probe["prefill_tokens"] += rec.new_tokens
            probe["prefill_steps"] += 1

    return engine.add_step_observer(seen)


def run_workload(llm, workload: list[BenchRequest], sampling: dict, progress: bool = True) -> dict:
    """Serve the workload on llm.engine (arrival-driven) and return the measured figures."""
    from tqdm import tqdm

    from jaxserve.engine.sampling_params import SamplingParams

    engine = llm.engine
    if engine.has_unfinished():
        raise RuntimeError("the engine has requests in flight")
    order = sorted(range(len(workload)), key=lambda i: workload[i].arrival)
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, **sampling) for r in workload]
    records: dict[str, _Record] = {}
    start = engine.snapshot()
    probe = dict(peak_pages=start.kv_pages_used, steps=0, decode_rows=0, decode_steps=0,
                 prefill_tokens=0, prefill_steps=0)
    restore = _observe(engine, probe)
    bar = tqdm(total=len(workload), desc="requests", unit="req", disable=not progress, file=sys.stderr,
               dynamic_ncols=True)
    done = 0
    nxt = 0
    try:
        with CompileWatch() as compiles:
            t0 = time.perf_counter()
            while done < len(workload):
                now = time.perf_counter()
                while nxt < len(order) and workload[order[nxt]].arrival <= now - t0:
                    i = order[nxt]
                    rid = engine.add_request(workload[i].prompt_ids, params[i])
                    records[rid] = _Record(submit=time.perf_counter())
                    nxt += 1
                if not engine.has_unfinished():  # idle until the next arrival
                    time.sleep(max(0.0, workload[order[nxt]].arrival - (time.perf_counter() - t0)))
                    continue
                outs = engine.step()
                probe["steps"] += 1
                t = time.perf_counter()
                for out in outs:
                    rec = records.get(out.request_id)
                    if rec is None:
                        continue
                    rec.token_times.extend([t] * len(out.new_token_ids))
                    if out.finished:
                        rec.finish, rec.completion = t, out.completion
                        done += 1
                        bar.update(1)
            t_end = time.perf_counter()
    finally:
        restore()
        bar.close()
    probe["preemptions"] = engine.snapshot().preemptions - start.preemptions
    return _report(llm, workload, records, probe, t0, t_end, compiles)


def _report(llm, workload, records, probe, t0, t_end, compiles) -> dict:
    wall = t_end - t0
    ttft, itl, tpot, e2e = [], [], [], []
    prompt_tokens = completion_tokens = cached_tokens = 0
    reasons: dict[str, int] = {}
    for rid, rec in records.items():
        c = rec.completion
        reasons[c.finish_reason] = reasons.get(c.finish_reason, 0) + 1
        prompt_tokens += c.usage.prompt_tokens
        completion_tokens += c.usage.completion_tokens
        cached_tokens += c.usage.cached_tokens
        times = rec.token_times
        if times:
            ttft.append(times[0] - rec.submit)
            itl.extend(b - a for a, b in zip(times, times[1:]))
            if len(times) > 1:
                tpot.append((times[-1] - times[0]) / (len(times) - 1))
        e2e.append(rec.finish - rec.submit)
    usable_pages = llm.engine.config.num_pages - 1
    return dict(
        num_requests=len(records),
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        expected_completion_tokens=sum(r.max_tokens for r in workload),
        cached_prompt_tokens=cached_tokens,
        wall_s=wall,
        output_tokens_per_s=completion_tokens / wall,
        total_tokens_per_s=(prompt_tokens + completion_tokens) / wall,
        requests_per_s=len(records) / wall,
        ttft_s=summary(ttft),
        itl_s=summary(itl),
        tpot_s=summary(tpot),
        e2e_latency_s=summary(e2e),
        peak_kv_pages=probe["peak_pages"],
        kv_pages_total=usable_pages,
        peak_kv_fraction=probe["peak_pages"] / usable_pages,
        preemptions=probe["preemptions"],
        finish_reasons=reasons,
        steps=probe["steps"],
        prefill_steps=probe["prefill_steps"],
        decode_steps=probe["decode_steps"],
        mean_decode_batch=probe["decode_rows"] / max(probe["decode_steps"], 1),
        scheduled_prefill_tokens=probe["prefill_tokens"],
        compiles_during_run=compiles.count,
        compile_seconds_during_run=compiles.seconds,
        compiled_functions_during_run=compiles.names,
    )


def warm_up(llm, workload: list[BenchRequest], sampling: dict, seed: int) -> float:
    """Compile every serving bucket, then an untimed pass over every decode batch size."""
    t = time.perf_counter()
    llm.warmup()
    n = min(len(workload), llm.engine.config.max_num_seqs)
    run_workload(llm, warmup_workload(workload, n, llm.cfg.vocab_size, seed), sampling, progress=False)
    return time.perf_counter() - t


def format_report(res: dict, title: str) -> str:
    ms = 1e3

    def lat(name):
        s = res[name]
        return f"p50 {fmt(s['p50'] and s['p50'] * ms)} ms, p95 {fmt(s['p95'] and s['p95'] * ms)} ms, " \
               f"mean {fmt(s['mean'] and s['mean'] * ms)} ms"

    rows = [
        ("requests", f"{res['num_requests']} ({', '.join(f'{k}: {v}' for k, v in sorted(res['finish_reasons'].items()))})"),
        ("prompt / output tokens", f"{res['prompt_tokens']:,} / {res['completion_tokens']:,}"),
        ("wall time", f"{res['wall_s']:.2f} s"),
        ("output tokens/s", fmt(res["output_tokens_per_s"])),
        ("total tokens/s", fmt(res["total_tokens_per_s"])),
        ("requests/s", fmt(res["requests_per_s"], digits=3)),
        ("TTFT", lat("ttft_s")),
        ("inter-token latency", lat("itl_s")),
        ("time per output token", lat("tpot_s")),
        ("end-to-end latency", lat("e2e_latency_s")),
        ("peak KV pages", f"{res['peak_kv_pages']} of {res['kv_pages_total']} ({res['peak_kv_fraction']:.0%})"),
        ("preemptions", str(res["preemptions"])),
        ("steps (prefill / decode)", f"{res['steps']} ({res['prefill_steps']} / {res['decode_steps']}), "
                                     f"mean decode batch {res['mean_decode_batch']:.1f}"),
        ("compilations in run", f"{res['compiles_during_run']} ({res['compile_seconds_during_run']:.1f} s)"
                                + "".join(f", {k} x{v}" for k, v in sorted(res["compiled_functions_during_run"].items()))),
    ]
    return format_table(rows, title)
