"""The ``jaxserve`` command line.

Heavy imports (jax, the models) happen inside the subcommands, so ``--help`` is instant and
``--num-devices`` can still configure the CPU device count before jax starts.
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes integers separated by spaces or commas, got {text!r}")


def _ensure_cpu_devices(n: int) -> None:
    """Ask XLA's host platform for n devices (no effect on GPU). Must run before jax import."""
    flags = os.environ.get("XLA_FLAGS", "")
    if n > 1 and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate from a checkpoint directory")
    p.add_argument("--model", required=True, help="Hugging Face-format checkpoint directory (config.json + safetensors)")
    p.add_argument(
        "--prompt-ids", type=_parse_ids, action="append", required=True,
        help="a prompt as token ids ('1,2,3'); repeat for several prompts",
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--kv-format", default="bf16", help="bf16 | fp8_e4m3 | float32")
    p.add_argument("--num-devices", type=int, default=1)
    p.add_argument("--num-pages", type=int, default=256)
    p.add_argument("--page-size", type=int, default=16)
    p.set_defaults(func=run_generate)


def run_generate(args) -> int:
    _ensure_cpu_devices(args.num_devices)
    from jaxserve.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(
        args.model, dtype=args.dtype, kv_format=args.kv_format, num_devices=args.num_devices,
        num_pages=args.num_pages, page_size=args.page_size,
    )
    t1 = time.perf_counter()
    outs = llm.generate(
        args.prompt_ids, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    t2 = time.perf_counter()
    for prompt, out in zip(args.prompt_ids, outs):
        print(f"prompt {prompt} -> {out}")
    n = sum(len(o) for o in outs)
    print(
        f"{llm.cfg.architecture}: loaded in {t1 - t0:.2f}s; {n} tokens in {t2 - t1:.2f}s "
        f"({n / (t2 - t1):.1f} tok/s, first call includes compilation)",
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate(sub)
    from jaxserve.planner.cli import register as add_plan

    add_plan(sub)
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
