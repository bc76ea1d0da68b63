"""``jaxserve plan``: print a capacity plan as a table or JSON.

    python -m jaxserve.planner --model kimi-k2.6 --compare kv
    python -m jaxserve.planner --model glm-5 --compare weights --kv-format fp8
    python -m jaxserve.planner --model path/to/config.json --devices 8 --device h100 --json
"""
from __future__ import annotations

import argparse
import json
import sys

from .plan import (DEFAULT_KV_SCALE_BYTES, DEFAULT_RESERVE_BYTES, DEFAULT_USABLE_FRACTION, GB, GROUP_LABELS,
                   GROUPS, PlanResult, plan)
from .presets import ARTICLE, DEVICE_PRESETS, MODEL_PRESETS, load_model_config


# --compare weights: (column title, format overrides): int4 on the routed experts, the rest
# (attention, dense/shared MLP) fp8 or bf16. Embeddings stay bf16 in every column.
WEIGHT_VARIANTS = (("fp8", dict(weights="fp8")),
                   ("int4 g128 + fp8", dict(weights="fp8", experts_format="int4:g128")),
                   ("int4 g32 + fp8", dict(weights="fp8", experts_format="int4:g32")),
                   ("int4 g128 + bf16", dict(weights="bf16", experts_format="int4:g128")))


def parse_size(s: str) -> int:
    """'11GB' -> 11e9, '10GiB' -> 10 * 2**30, '123' -> 123 bytes (jaxserve.kv.memory.parse_size)."""
    from jaxserve.kv.memory import parse_size as parse

    try:
        return parse(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, except None/False ones, whose help text says what they mean."""

    def _get_help_string(self, action):
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="kimi-k2.6",
                   help=f"preset ({', '.join(MODEL_PRESETS)}) or a config.json file / checkpoint directory")
    p.add_argument("--device", default="h200", choices=sorted(DEVICE_PRESETS),
                   help="accelerator; memory as the driver reports it (h200: 143,771 MiB, h100: 81,559 MiB)")
    p.add_argument("--devices", type=int, default=8, help="devices in the deployment")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default: --devices)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel degree (default: --devices)")
    p.add_argument("--weights", default=None,
                   help="format for experts, attention and MLP: bf16, fp8 (=fp8:block128), fp8:channel, "
                        "int4:g32, int4:g128 (default: as the checkpoint ships)")
    p.add_argument("--experts-format", default=None, help="routed experts format (overrides --weights)")
    p.add_argument("--rest-format", default=None, help="attention + dense/shared MLP format (overrides --weights)")
    p.add_argument("--attention-format", default=None, help="attention format (overrides --rest-format)")
    p.add_argument("--mlp-format", default=None, help="dense + shared-expert MLP format (overrides --rest-format)")
    p.add_argument("--embed-format", default=None, help="embeddings + lm_head format (default: as shipped, bf16)")
    p.add_argument("--kv-format", default="bf16", help="KV cache: bf16 or fp8 (fp8_e4m3)")
    p.add_argument("--kv-scale-bytes", type=int, default=DEFAULT_KV_SCALE_BYTES,
                   help="fp8 KV: scale bytes per cached vector per token (4 = float32; 0 = ignore scales, "
                        "as the article's 35,136 B/token does)")
    p.add_argument("--context-len", type=int, default=None,
                   help="sequence length for the concurrent-sequences figure (default: max_position_embeddings)")
    p.add_argument("--usable-fraction", type=float, default=DEFAULT_USABLE_FRACTION,
                   help="fraction of device memory for weights + KV")
    p.add_argument("--reserve", type=parse_size, default=f"{DEFAULT_RESERVE_BYTES / GB:g}GB",
                   help="per device, kept for activations/workspace/MoE buffers/CUDA graphs: 11GB, 10GiB, 0")
    p.add_argument("--include-mtp", action="store_true", help="count multi-token-prediction layers")
    p.add_argument("--compare", choices=("kv", "weights"), default=None,
                   help="kv: bf16 vs fp8 KV side by side; weights: fp8 vs int4 weight variants")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to an argparse subparsers object."""
    p = subparsers.add_parser("plan", help="capacity planner: weights, KV bytes/token, KV tokens",
                              description=__doc__, formatter_class=_HelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def _plan_kwargs(a: argparse.Namespace) -> dict:
    return dict(devices=a.devices, device=a.device, weights=a.weights, experts_format=a.experts_format,
                attention_format=a.attention_format or a.rest_format, mlp_format=a.mlp_format or a.rest_format,
                embed_format=a.embed_format, kv_format=a.kv_format, kv_scale_bytes=a.kv_scale_bytes, tp=a.tp,
                ep=a.ep, context_len=a.context_len, usable_fraction=a.usable_fraction, reserve_bytes=a.reserve,
                include_mtp=a.include_mtp)


def _variants(a: argparse.Namespace, config: dict, name: str) -> list[tuple[str, PlanResult]]:
    kw = _plan_kwargs(a) | {"name": name}
    if a.compare == "kv":
        return [("bf16 KV", plan(config, **kw | {"kv_format": "bf16"})),
                ("fp8 KV", plan(config, **kw | {"kv_format": "fp8"})),
                ("fp8 KV, no scales", plan(config, **kw | {"kv_format": "fp8", "kv_scale_bytes": 0}))]
    if a.compare == "weights":
        base = {k: None for k in ("weights", "experts_format", "attention_format", "mlp_format")}
        return [(t, plan(config, **kw | base | v)) for t, v in WEIGHT_VARIANTS]
    return [(name, plan(config, **kw))]


def _gb(b: float) -> str:
    return f"{b / GB:,.2f} GB"


def _rows(r: PlanResult, first: PlanResult | None) -> list[tuple[str, str]]:
    rows = [(f"format: {GROUP_LABELS[g]}", r.formats[g]) for g in ("experts", "attention", "mlp", "embed")]
    rows += [("parameters", f"{r.params['total'] / 1e9:,.2f} B")]
    rows += [(f"  {GROUP_LABELS[g]}", f"{r.params[g] / 1e9:,.2f} B = {_gb(r.checkpoint_bytes_by_group[g])}")
             for g in GROUPS]
    rows += [("checkpoint (one copy)", _gb(r.checkpoint_bytes)),
             (f"  checkpoint / {r.devices}", _gb(r.checkpoint_bytes / r.devices)),
             ("weights / device (replicated parts counted)", _gb(r.weights_bytes_per_device))]
    if first is not None:
        freed = first.weights_bytes_per_device - r.weights_bytes_per_device
        tokens = max(freed, 0) // r.kv_bytes_per_token_per_device
        rows.append(("  freed vs first column", f"{_gb(freed)} = {tokens:,} tok"))
    rows += [("device memory", _gb(r.device_memory_bytes)),
             (f"usable (x{r.usable_fraction:g} - reserve {r.reserve_bytes / GB:g} GB)", _gb(r.usable_bytes_per_device)),
             ("KV budget / device", _gb(r.kv_budget_bytes_per_device) + ("" if r.fits else "  (WEIGHTS DO NOT FIT)")),
             ("KV format", r.kv_format),
             ("KV bytes / token (one copy)", f"{r.kv_bytes_per_token:,} B (scales {r.kv_scale_bytes_per_token:,} B)"),
             ("KV bytes / token / device", f"{r.kv_bytes_per_token_per_device:,} B"),
             ("KV tokens / device", f"{r.kv_tokens_per_device:,}"),
             (f"KV tokens (aggregate, dp={r.dp})", f"{r.kv_tokens:,}"),
             (f"concurrent seqs @ {r.context_len:,} tokens", f"{r.concurrent_sequences:,}")]
    return rows


def _article_lines(name: str, cols: list[tuple[str, PlanResult]], compare: str | None) -> list[str]:
    art = ARTICLE.get(name)
    if not art:
        return []
    lines = [f"article ({art['setup']}):"]
    if "kv_tokens" in art:
        t = art["kv_tokens"]
        lines.append(f"  KV tokens {t['bf16']:,} (bf16) -> {t['fp8_e4m3']:,} (fp8), "
                     f"{art['kv_bytes_per_token']['bf16']:,} / {art['kv_bytes_per_token']['fp8_e4m3']:,} B/token "
                     f"(no scales), ~{art['kv_gb_per_device']} GB KV per GPU")
        if compare == "kv":
            b, f = cols[0][1], cols[1][1]
            lines.append(f"  here: {b.kv_tokens:,} -> {f.kv_tokens:,} (x{f.kv_tokens / b.kv_tokens:.3f}; "
                         f"{b.kv_tokens / t['bf16'] - 1:+.1%} / {f.kv_tokens / t['fp8_e4m3'] - 1:+.1%} vs article)")
    if "checkpoint_gb" in art:
        c, w = art["checkpoint_gb"], art["weights_gb_per_device"]
        lines.append(f"  checkpoint {c['fp8']} GB (fp8) -> {c['int4']} GB (int4), x{c['int4'] / c['fp8']:.3f}; "
                     f"per GPU {w['fp8']} -> {w['int4']} GB; freed space holds ~{art['freed_kv_tokens']:,} KV tokens")
        if compare == "weights":
            f = cols[0][1]
            lines += [f"  here: {t}: x{r.checkpoint_bytes / f.checkpoint_bytes:.3f} of fp8" for t, r in cols[1:]]
    return lines


def format_table(cols: list[tuple[str, PlanResult]], name: str, compare: str | None = None) -> str:
    r0 = cols[0][1]
    head = (f"{name}: {r0.architecture} ({r0.attention.upper()}) on {r0.devices} x {r0.device} "
            f"(tp={r0.tp} ep={r0.ep} dp={r0.dp})")
    first = r0 if compare == "weights" else None
    table = [[label] + [v] for label, v in _rows(r0, first)]
    for _, r in cols[1:]:
        for row, (_, v) in zip(table, _rows(r, first), strict=True):
            row.append(v)
    titles = [""] + [t for t, _ in cols]
    widths = [max(len(x[i]) for x in table + [titles]) for i in range(len(titles))]

    def fmt(row: list[str]) -> str:
        return "  ".join(x.rjust(w) if i else x.ljust(w) for i, (x, w) in enumerate(zip(row, widths, strict=True)))

    lines = [head] + ([fmt(titles)] if len(cols) > 1 else []) + [fmt(row) for row in table] + [""]
    lines += _article_lines(name, cols, compare)
    lines += ["assumptions:"] + [f"  {k}: {v}" for k, v in r0.assumptions.items()]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        name, config = load_model_config(args.model)
        cols = _variants(args, config, name)
    except ValueError as e:
        print(f"jaxserve plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = ({"compare": args.compare, "plans": {t: r.to_dict() for t, r in cols}} if args.compare
               else cols[0][1].to_dict())
        if name in ARTICLE:
            out["article"] = ARTICLE[name]
        print(json.dumps(out, indent=2))
    else:
        print(format_table(cols, name, args.compare))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jaxserve plan", description=__doc__,
                                formatter_class=_HelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
