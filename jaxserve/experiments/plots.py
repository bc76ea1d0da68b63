"""PNG plots of the experiment results (matplotlib, Agg). Each returns the path written, or
None when matplotlib is not installed (the JSON and markdown are written regardless)."""
from __future__ import annotations

from pathlib import Path


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        return None


def _footer(fig, meta: dict) -> None:
    import textwrap

    m = meta["machine"]
    cmd = "\n".join(textwrap.wrap(meta["command"], 190))
    fig.text(0.01, 0.005, f"{m['nproc']} CPUs {m['cpu_model']}, jax {m['jax_version']}, {m['date_utc']}\n{cmd}",
             fontsize=6, va="bottom", ha="left", color="0.35")


def capacity_plot(result: dict, path: Path) -> Path | None:
    plt = _plt()
    if plt is None:
        return None
    table = result["summary"]["table"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    for ax, key, title in ((axes[0], "decode_tok_s", "decode tokens/s (decode-only steps)"),
                           (axes[1], "output_tok_s", "end-to-end output tokens/s")):
        for fmt in result["formats"]:
            rows = sorted((t for t in table if t["kv_format"] == fmt), key=lambda t: t["concurrency"])
            if not rows:
                continue
            xs = [t["concurrency"] for t in rows]
            ys = [t[key] for t in rows]
            err = [[y - t[key + "_min"] for y, t in zip(ys, rows)], [t[key + "_max"] - y for y, t in zip(ys, rows)]]
            line = ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3,
                               label=f"{fmt} ({result['formats'][fmt]['num_pages']} pages)")
            bad = [t for t in rows if not t["fits"]]
            if bad:
                ax.scatter([t["concurrency"] for t in bad], [t[key] for t in bad], s=140, facecolors="none",
                           edgecolors=line[0].get_color(), linewidths=2)
                for t in bad:
                    ax.annotate("out of KV", (t["concurrency"], t[key]), textcoords="offset points", xytext=(5, -12),
                                fontsize=7, color=line[0].get_color())
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"KV capacity under a fixed budget of {result['settings']['kv_budget_bytes']:,} bytes "
                 "(median of repeats, min-max bars; circled: ran out of KV)", fontsize=10)
    _footer(fig, result["meta"])
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def weights_plot(result: dict, path: Path) -> Path | None:
    plt = _plt()
    if plt is None:
        return None
    import numpy as np

    table = result["summary"]["table"]
    levels = result["settings"]["levels"]
    names = [t["config"] for t in table]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    width = 0.8 / max(len(names), 1)
    for ax, kind, title in ((axes[0], "decode", "decode tokens/s"), (axes[1], "prefill", "prefill tokens/s")):
        x = np.arange(len(levels))
        for i, t in enumerate(table):
            ys = [t[f"{kind}_c{c}"] for c in levels]
            lo = [y - t[f"{kind}_c{c}_min"] for y, c in zip(ys, levels)]
            hi = [t[f"{kind}_c{c}_max"] - y for y, c in zip(ys, levels)]
            emu = result["configs"][t["config"]]["int4_prefill_emulated"] and kind == "prefill"
            ax.bar(x + (i - (len(table) - 1) / 2) * width, ys, width, yerr=[lo, hi], capsize=2,
                   label=t["config"] + (" (int4 prefill emulated)" if emu else ""), hatch="//" if emu else None)
        ax.set_xticks(x, [f"c={c}" for c in levels])
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    fig.suptitle("Weight representations: prefill vs decode throughput (median of repeats, min-max bars)", fontsize=10)
    _footer(fig, result["meta"])
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def quality_plot(result: dict, path: Path) -> Path | None:
    plt = _plt()
    if plt is None:
        return None

    res = {n: r for n, r in result["results"].items() if not r.get("reference")}
    if not res:
        return None
    names = list(res)
    fig, axes = plt.subplots(1, 3, figsize=(13, 0.45 * len(names) + 2.4))
    panels = (("kl", "KL(ref || format), nats/token", 1.0), ("top1_agreement", "top-1 agreement with ref, %", 100.0),
              ("delta_ppl", "perplexity - reference perplexity", 1.0))
    for ax, (key, title, scale) in zip(axes, panels):
        for j, (phase, off, color) in enumerate((("decode", -0.15, "C0"), ("prefill", 0.15, "C1"))):
            ys, xs, lo, hi = [], [], [], []
            for i, n in enumerate(names):
                ci = res[n]["phases"][phase][key]
                ys.append(i + off)
                xs.append(ci["point"] * scale)
                lo.append((ci["point"] - ci["lo"]) * scale)
                hi.append((ci["hi"] - ci["point"]) * scale)
            ax.errorbar(xs, ys, xerr=[lo, hi], fmt="o", color=color, capsize=3, label=f"{phase} phase")
        ax.set_yticks(range(len(names)), names if ax is axes[0] else [""] * len(names), fontsize=8)
        ax.invert_yaxis()
        if key == "kl":
            ax.set_xscale("symlog", linthresh=1e-5)
            ax.set_xlim(left=0)
        if key == "delta_ppl":
            ax.axvline(0, color="0.5", lw=0.8)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Format quality vs float32 reference on {result['settings']['docs']} pydoc topics "
                 "(95% bootstrap CIs over documents)", fontsize=10)
    _footer(fig, result["meta"])
    fig.tight_layout(rect=(0, 0.07, 1, 0.94))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def quality_position_plot(result: dict, path: Path) -> Path | None:
    plt = _plt()
    if plt is None:
        return None

    res = {n: r for n, r in result["results"].items() if "kl_by_position" in r}
    if not res:
        return None
    st = result["settings"]
    fig, ax = plt.subplots(figsize=(9, 4.6))
    for n, r in res.items():
        ax.plot(range(len(r["kl_by_position"])), r["kl_by_position"], label=n, lw=1.2)
    ax.axvline(st["prefix"] - 0.5, color="0.4", ls="--", lw=0.8)
    for c in range(st["chunk"], st["prefix"], st["chunk"]):
        ax.axvline(c - 0.5, color="0.8", ls=":", lw=0.8)
    ax.set_yscale("symlog", linthresh=1e-5)
    ax.set_ylim(bottom=0)
    ax.text(st["prefix"], 0.98, " decode ->", va="top", fontsize=8, transform=ax.get_xaxis_transform())
    ax.text(st["prefix"] - 1, 0.98, "<- prefill ", va="top", ha="right", fontsize=8,
            transform=ax.get_xaxis_transform())
    ax.set_xlabel("position (dotted: prefill chunk boundaries; dashed: prefill -> decode)")
    ax.set_ylabel("mean KL(ref || format), nats")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=3, loc="lower right")
    ax.set_title("Per-position KL divergence from the float32 reference (mean over documents)", fontsize=10)
    _footer(fig, result["meta"])
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
