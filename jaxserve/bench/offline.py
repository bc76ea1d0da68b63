"""``jaxserve bench``: a fixed-seed offline serving benchmark.

N requests with random prompt token ids and random output lengths (uniform in given
ranges, EOS ignored so every request produces exactly its length) arrive all at t=0, or
as a Poisson process (--request-rate); the engine serves them with continuous batching.
Reported: output and total tokens/s, time to first token and inter-token latency
(p50/p95), peak KV pages in use, preemptions, wall time, and XLA compilations inside the
timed run (0 when the warm-up covered every shape).

    jaxserve bench                                    # the default SmolLM2 model, 128 requests
    python -m jaxserve.bench --num-requests 64 --prompt-len 32 128 --output-len 16 64 \\
        --max-num-seqs 32 --json bench/results/offline.json
    jaxserve bench --model checkpoints/tiny-kimi-k2 --request-rate 4

Timing is client-side: a token's time is when the ``engine.step()`` that produced it returns;
TTFT is from the request's submission. Before timing, every serving bucket is compiled
(``LLM.warmup``) and a short untimed pass visits every decode batch size (sampler shapes).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from jaxserve.bench.measure import CompileWatch, fmt, format_table, machine_info, summary, write_json
from jaxserve.bench.workload import BenchRequest, make_workload, warmup_workload
from jaxserve import cli_args
from jaxserve.cli_args import add_engine_args


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


# ---------------------------------------------------------------------- command line
def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help="checkpoint directory (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    g = p.add_argument_group("engine (EngineConfig)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="default: the workload's longest prompt + output, rounded up to a power-of-two "
                        "number of pages (every step's page-table width follows it); 0 = the engine's "
                        "default (the model's whole context)")
    add_engine_args(g, skip=("--max-model-len",))
    g = p.add_argument_group("workload")
    g.add_argument("--num-requests", type=int, default=128)
    g.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    g.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second (default inf: all at t=0)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--seed", type=int, default=0, help="workload and sampling seed")
    g = p.add_argument_group("output")
    g.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    g.add_argument("--no-progress", action="store_true")
    g.add_argument("--no-warmup", action="store_true", help="time compilation too (reported as compilations in run)")


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to an argparse subparsers object."""
    p = subparsers.add_parser("bench", help="offline serving benchmark (tokens/s, TTFT, inter-token latency)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def fitted_max_model_len(tokens: int, page_size: int) -> int:
    """The smallest context >= tokens whose page count is a power of two.

    Why a power of two: the engine fills page tables as wide as max_model_len / page_size,
    but warm-up compiles them at that width rounded up to a power of two; any other width
    recompiles every serving program on first use, inside the timed run.
    """
    pages = -(-tokens // page_size)
    return page_size * (1 << (pages - 1).bit_length())


def engine_kwargs(args) -> dict:
    """The engine flags given, and max_model_len fitted to the workload unless given."""
    from jaxserve.engine.config import EngineConfig

    kw = cli_args.engine_kwargs(args)
    page_size = kw.get("page_size", EngineConfig.page_size)
    if args.max_model_len is None:
        kw["max_model_len"] = fitted_max_model_len(args.prompt_len[1] + args.output_len[1], page_size)
    else:
        kw["max_model_len"] = args.max_model_len or None
    return kw


def run(args) -> int:
    from jaxserve.cli_args import enable_compile_cache
    from jaxserve.llm import LLM

    enable_compile_cache()
    t = time.perf_counter()
    kw = engine_kwargs(args)
    llm = LLM(args.model, dtype=args.dtype, kv_format=args.kv_format, **kw)
    load_s = time.perf_counter() - t
    workload = make_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len),
                             llm.cfg.vocab_size, args.seed, args.request_rate)
    sampling = dict(temperature=args.temperature, seed=args.seed)
    warm_s = 0.0 if args.no_warmup else warm_up(llm, workload, sampling, args.seed)
    res = run_workload(llm, workload, sampling, progress=not args.no_progress)
    title = (f"jaxserve bench: {llm.cfg.architecture} {args.dtype}, kv {llm.fmt.name}, "
             f"{args.num_requests} requests, prompt {args.prompt_len[0]}-{args.prompt_len[1]}, "
             f"output {args.output_len[0]}-{args.output_len[1]}, rate {args.request_rate}/s")
    print(format_report(res, title))
    print(f"(load {load_s:.1f} s, warm-up {warm_s:.1f} s)", file=sys.stderr)
    if args.json:
        config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items() if k != "func"}
        config["request_rate"] = str(args.request_rate) if args.request_rate == float("inf") else args.request_rate
        write_json(args.json, dict(
            benchmark="offline", command=_command_line(), config=config,
            engine=dict(kw, model_path=llm.model_path, architecture=llm.cfg.architecture,
                        max_model_len=llm.engine.max_model_len, decode_page_table_width=llm.runner.max_pages_per_seq),
            load_s=load_s, warmup_s=warm_s, results=res, machine=machine_info(),
        ))
    return 0


def _command_line() -> str:
    argv = list(sys.argv)
    if argv and argv[0].endswith("__main__.py"):
        argv[0] = "python -m jaxserve.bench"
    return " ".join(argv)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jaxserve bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
