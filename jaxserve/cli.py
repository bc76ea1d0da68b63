"""The ``jaxserve`` command line.

Heavy imports (jax, the models) happen inside the subcommands, so ``--help`` is instant and
``--num-devices`` can still configure the CPU device count before jax starts.
"""
from __future__ import annotations

import argparse
import sys
import time

from jaxserve.cli_args import ModelOptions, add_engine_args, engine_kwargs, ensure_cpu_devices, with_default_config


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes integers separated by spaces or commas, got {text!r}")


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text (or token ids) from a model")
    p.add_argument("prompts", nargs="*", help="text prompts (need the model's tokenizer)")
    ModelOptions(dtype="auto", num_devices=1).add_to(p)
    p.add_argument(
        "--prompt-ids", type=_parse_ids, action="append", default=[],
        help="a prompt as token ids ('1,2,3'); repeat for several prompts",
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument(
        "--chat-template", action=argparse.BooleanOptionalAction, default=True,
        help="wrap text prompts in the model's chat template as a user turn (when it has one)",
    )
    p.add_argument("--no-warmup", action="store_true", help="skip the compile warm-up (tokens/s then include it)")
    add_engine_args(p.add_argument_group("engine (EngineConfig)"))
    p.set_defaults(func=run_generate)




def run_generate(args) -> int:
    if not args.prompts and not args.prompt_ids:
        raise ValueError("give at least one text prompt or --prompt-ids")
    ensure_cpu_devices(args.num_devices)
    from jaxserve.cli_args import with_program_cache
    from jaxserve.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, kv_format=args.kv_format, num_devices=args.num_devices,
              **with_program_cache(with_default_config(args, engine_kwargs(args))))
    for phase, path in llm.runner.weight_paths().items():
        print(f"[{phase} matmuls] {path}", file=sys.stderr)
    mem = llm.memory_report()
    print(f"[memory] weights {mem['weight_bytes']['resident']:,} B resident; KV {mem['kv_bytes']:,} B "
          f"({mem['kv_pages']} pages, {mem['max_cached_tokens']:,} tokens, {mem['kv_format']})", file=sys.stderr)
    use_template = args.chat_template and llm.tokenizer is not None and llm.tokenizer.chat_template
    texts = [llm.apply_chat_template(p) if use_template else p for p in args.prompts]
    prompts = texts + args.prompt_ids
    kw = dict(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, ignore_eos=args.ignore_eos,
    )
    t1 = time.perf_counter()
    if not args.no_warmup:  # one untimed run compiles exactly the programs this run needs
        llm.generate(prompts, **kw)
        llm.reset_prefix_cache()  # else the timed run would hit it: other chunk buckets, other work
    t2 = time.perf_counter()
    outs = llm.generate(prompts, **kw)
    shown = list(args.prompts) + [str(p) for p in args.prompt_ids]
    for prompt, out in zip(shown, outs):
        print(f"> {prompt}")
        print(out.text if out.text is not None else list(out))
        print()
    st = llm.stats
    print(
        f"[{llm.cfg.architecture}, {llm.dtype}, kv {llm.fmt.name}] load {t1 - t0:.1f}s, warm-up {t2 - t1:.1f}s; "
        f"prefill {st.prefill_tokens} tok in {st.prefill_seconds:.2f}s "
        f"({st.prefill_tokens / max(st.prefill_seconds, 1e-9):.1f} tok/s); "
        f"decode {st.decode_tokens} tok in {st.decode_seconds:.2f}s "
        f"({st.decode_tokens / max(st.decode_seconds, 1e-9):.1f} tok/s)",
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate(sub)
    from jaxserve.checkpoint.convert import register as add_convert
    from jaxserve.planner.cli import register as add_plan

    from jaxserve.bench.offline import register as add_bench
    from jaxserve.experiments.cli import register as add_experiment
    from jaxserve.router.cli import register_route
    from jaxserve.server.cli import register_client, register_serve

    add_bench(sub)
    add_experiment(sub)
    add_plan(sub)
    add_convert(sub)
    register_serve(sub)
    register_route(sub)
    register_client(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError) as e:  # bad input: a clear message, not a traceback
        print(f"jaxserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
