"""``jaxserve experiment``: format trade-off experiments, written as JSON, markdown and PNG.

    jaxserve experiment capacity --kv-budget 6.5MB          # BF16 vs FP8 KV under one byte budget
    jaxserve experiment weights --levels 1,8                # bf16 / fp8 / int4 / phase-aware weights
    jaxserve experiment quality --docs 24                   # perplexity, KL, top-1 vs float32, with CIs
    python -m jaxserve.experiments quality --configs kv-fp8=fp8_e4m3/none/none --resume

Results go to bench/results/experiments/ (``--out``) as NAME.json, NAME.md and NAME*.png.
"""
from __future__ import annotations

import argparse
import sys

from jaxserve.cli_args import OMIT, ModelOptions, add_format_args, enable_compile_cache, format_kwargs
from jaxserve.experiments import common

# Flags a sweep over weight formats sets itself (weights, quality).
SWEPT = ("--prefill-weights", "--decode-weights", "--prefill-from-decode-weights", "--preset")


def parse_size(s: str) -> int:
    """'6.5MB' -> 6500000, '4MiB' -> 4194304, '123' -> 123 (bytes; jaxserve.kv.memory.parse_size)."""
    from jaxserve.kv.memory import parse_size as parse

    try:
        return parse(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {s!r}")


def _list(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _configs(s: str) -> list[str]:
    # Specs contain ':' and '/', never ','; split on commas.
    return _list(s)


def _common(p: argparse.ArgumentParser, name: str) -> None:
    ModelOptions(dtype=OMIT).add_to(p)
    p.add_argument("--out", default=str(common.DEFAULT_OUT), help="output folder")
    p.add_argument("--name", default=name, help="file name stem of the outputs")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--seed", type=int, default=0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="experiment", required=True)
    _add_capacity(sub)
    _add_weights(sub)
    _add_quality(sub)
    r = sub.add_parser("render", help="rewrite the markdown and PNGs of saved result JSON files (no measuring)")
    r.add_argument("json", nargs="+", help="result files written by capacity / weights / quality")
    r.add_argument("--no-plots", action="store_true")
    r.set_defaults(func=_run_render)


def _add_capacity(sub) -> None:
    c = sub.add_parser("capacity", help="decode tok/s vs concurrency under a fixed KV byte budget (bf16 vs fp8 KV)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _common(c, "capacity")
    c.add_argument("--kv-cache-memory", "--kv-budget", dest="kv_budget", type=parse_size, default=None,
                   help="KV memory budget in bytes (48GiB-style sizes): each format's engine gets the pages it buys "
                        "(default: 6.5MB, or --memory-fraction of the free memory, read once before loading)")
    c.add_argument("--kv-formats", type=_list, default=["bf16", "fp8_e4m3"])
    c.add_argument("--levels", type=_ints, default=None,
                   help="concurrency levels (default: 1, 2, 4, ... until every format runs out of KV)")
    c.add_argument("--max-concurrency", type=int, default=64)
    c.add_argument("--prompt-len", type=int, default=32)
    c.add_argument("--max-tokens", type=int, default=32)
    c.add_argument("--reps", type=int, default=2, help="timed repeats per cell (after one untimed warm-up)")
    c.add_argument("--page-size", type=int, default=16)
    ModelOptions(model=OMIT, dtype="float32").add_to(c)
    add_format_args(c, skip=("--kv-cache-memory",))  # the KV formats are swept; the rest applies to each engine
    c.set_defaults(func=_run_capacity)


def _add_weights(sub) -> None:
    w = sub.add_parser("weights", help="decode and prefill tok/s per weight representation (bf16/fp8/int4/phase-aware)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _common(w, "weights")
    from jaxserve.experiments.weights import DEFAULT_CONFIGS as WCONF

    w.add_argument("--configs", type=_configs, default=list(WCONF),
                   help="NAME=PREFILL/DECODE weight specs (none = as loaded; an int4 prefill is emulated)")
    w.add_argument("--levels", type=_ints, default=[1, 8], help="concurrent requests")
    w.add_argument("--prompt-len", type=int, default=128)
    w.add_argument("--max-tokens", type=int, default=24)
    w.add_argument("--reps", type=int, default=3)
    ModelOptions(model=OMIT, dtype="float32", kv_format="bf16").add_to(w)
    w.add_argument("--page-size", type=int, default=16)
    w.add_argument("--baseline", default=None, help="config the ratios are taken against (default: float32 if run)")
    add_format_args(w)  # weight formats are swept by --configs: only the backends and the KV budget apply
    w.set_defaults(func=_run_weights)


def _add_quality(sub) -> None:
    q = sub.add_parser("quality", help="perplexity / KL / top-1 vs the float32 reference on pydoc text, with CIs",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _common(q, "quality")
    from jaxserve.experiments.quality import DEFAULT_CONFIGS as QCONF

    q.add_argument("--configs", type=_configs, default=list(QCONF),
                   help="NAME=KV/PREFILL/DECODE[/HEAD] specs (HEAD: a tied head stored once in that format), compared "
                        "with float32=float32/none/none")
    q.add_argument("--docs", type=int, default=24, help="pydoc topics (documents)")
    q.add_argument("--prefix", type=int, default=32, help="tokens scored through the prefill program")
    q.add_argument("--cont", type=int, default=32, help="tokens scored through the decode program")
    q.add_argument("--chunk", type=int, default=16, help="prefill chunk (later chunks read earlier ones from pages)")
    q.add_argument("--batch", type=int, default=None, help="documents per program call (default: all, up to 32)")
    q.add_argument("--page-size", type=int, default=16)
    q.add_argument("--sample-prompts", type=int, default=8)
    q.add_argument("--seeds", type=int, default=3)
    q.add_argument("--sample-tokens", type=int, default=24)
    q.add_argument("--temperature", type=float, default=0.8)
    q.add_argument("--top-p", type=float, default=0.95)
    q.add_argument("--n-boot", type=int, default=2000)
    q.add_argument("--resume", action="store_true",
                   help="reuse the cached reference and merge into an existing NAME.json with the same settings")
    q.add_argument("--no-reference-check", action="store_true")
    add_format_args(q, skip=SWEPT + ("--kv-cache-memory", "--memory-fraction"))  # pages are sized for the documents
    q.set_defaults(func=_run_quality)


def register(subparsers) -> None:
    """Add ``experiment`` to a ``jaxserve`` subparsers object."""
    p = subparsers.add_parser("experiment", help="format experiments: capacity, weights, quality (tables + plots)",
                              description=__doc__.splitlines()[0])
    add_arguments(p)


def _print_files(result: dict) -> int:
    for kind, path in result["files"].items():
        print(f"wrote {kind}: {path}")
    return 0


def _engine_kw(args, swept: tuple[str, ...] = ()) -> dict:
    """The shared engine flags of an experiment, refusing those its sweep sets itself."""
    kw = {k: v for k, v in format_kwargs(args).items() if v not in (None, False)}
    given = [f for f in swept if kw.get(f.lstrip("-").replace("-", "_"))]
    if given:
        raise ValueError(f"{args.experiment} sweeps the weight formats (--configs); drop {', '.join(given)}")
    return kw


def _run_capacity(args) -> int:
    from jaxserve.experiments import capacity
    from jaxserve.kv.memory import kv_budget

    enable_compile_cache()
    kw = _engine_kw(args)
    budget = args.kv_budget
    if budget is None:
        budget = kv_budget(None, kw.pop("memory_fraction", None)) or parse_size("6.5MB")
    elif "memory_fraction" in kw:
        raise ValueError("give --kv-cache-memory or --memory-fraction, not both")
    r = capacity.run(args.model, budget, args.kv_formats, args.levels, args.max_concurrency, args.prompt_len,
                     args.max_tokens, args.reps, args.page_size, args.dtype, args.seed, args.out, args.name,
                     not args.no_plots, engine_kw=kw)
    print(capacity.markdown(r))
    return _print_files(r)


def _run_weights(args) -> int:
    from jaxserve.experiments import weights

    enable_compile_cache()
    r = weights.run(args.model, args.configs, args.levels, args.prompt_len, args.max_tokens, args.reps,
                    args.kv_format, args.page_size, args.dtype, args.seed, args.out, args.name, not args.no_plots,
                    baseline=args.baseline, engine_kw=_engine_kw(args, SWEPT))
    print(weights.markdown(r))
    return _print_files(r)


def _run_quality(args) -> int:
    from jaxserve.experiments import quality

    enable_compile_cache()
    r = quality.run(args.model, args.configs, args.docs, args.prefix, args.cont, args.chunk, args.batch,
                    args.page_size, args.sample_prompts, args.seeds, args.sample_tokens, args.temperature, args.top_p,
                    args.n_boot, args.seed, args.resume, not args.no_reference_check, args.out, args.name,
                    not args.no_plots, engine_kw=_engine_kw(args))
    print(quality.markdown(r))
    return _print_files(r)


def _run_render(args) -> int:
    import importlib
    import json
    from pathlib import Path

    for fn in args.json:
        path = Path(fn)
        result = json.loads(path.read_text())
        kind = result.get("experiment")
        if kind not in ("capacity", "weights", "quality"):
            raise ValueError(f"{fn} is not a result file of jaxserve experiment (experiment={kind!r})")
        mod = importlib.import_module(f"jaxserve.experiments.{kind}")
        _print_files({"files": mod.write(result, path.parent, path.stem, not args.no_plots)})
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxserve.experiments", description=__doc__.splitlines()[0])
    add_arguments(p)
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    common.INVOCATION[:] = ["python", "-m", "jaxserve.experiments"] + argv
    try:
        return args.func(args) or 0
    except ValueError as e:
        print(f"jaxserve experiment {args.experiment}: error: {e}", file=sys.stderr)
        return 2
