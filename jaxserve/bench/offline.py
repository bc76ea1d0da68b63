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
# This module is the command line (the docstring above is its --help); serving a workload and
# measuring it is serving.py.
from __future__ import annotations

import argparse
import sys
import time

from jaxserve import cli_args
from jaxserve.bench.measure import machine_info, write_json
from jaxserve.bench.serving import format_report, run_workload, warm_up
from jaxserve.bench.workload import make_workload
from jaxserve.cli_args import ModelOptions, add_engine_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    ModelOptions(dtype="float32").add_to(g)
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
