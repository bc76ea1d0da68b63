"""Shared pieces of the format experiments: machine description, result files, the text
corpus and KV bytes per page (the instrumented engine runs are in ``engine_runs.py``).

Everything here imports jax lazily, so ``--help`` stays instant.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_OUT = Path("bench/results/experiments")

# The command line as typed (set by the CLI entry points; recorded in every result).
INVOCATION: list[str] = []


def command_line() -> str:
    if INVOCATION:
        return shlex.join(INVOCATION)
    argv0 = sys.argv[0]
    prog = "python -m jaxserve.experiments" if argv0.endswith("__main__.py") else os.path.basename(argv0)
    return " ".join([prog, shlex.join(sys.argv[1:])]).strip()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    import jax
    import jaxlib

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        affinity = os.cpu_count()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "nproc": affinity,
        "cpu_model": cpu_model(),
        "jax_version": jax.__version__,
        "jaxlib_version": jaxlib.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "load_average_at_start": load,
        "git_commit": commit,
    }


def header_md(title: str, meta: dict[str, Any]) -> str:
    m = meta["machine"]
    cmds = meta.get("commands") or [meta["command"]]
    return (
        f"## {title}\n\n"
        + "".join(f"- command: `{c}`\n" for c in cmds) +
        f"- machine: {m['nproc']} CPUs ({m['cpu_model']}), backend {m['backend']}, "
        f"load average at start {m['load_average_at_start']}\n"
        f"- jax {m['jax_version']} (jaxlib {m['jaxlib_version']}), Python {m['python']}, commit {m['git_commit']}\n"
        f"- date: {m['date_utc']}; wall time {meta.get('wall_s', 0):.0f} s\n"
        f"- model: {meta.get('model', '?')}\n"
    )


def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _jsonable(dataclasses.asdict(x))
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


def write_json(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(_jsonable(data), f, indent=1)
        f.write("\n")
    return path


def write_text(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def resolve_model(model: str | None) -> str:
    if model is None:
        from jaxserve.checkpoint.gguf import default_model_dir

        return str(default_model_dir())
    return str(model)


def model_label(model: str | None) -> str:
    return "SmolLM2-135M-Instruct (embedded; float32 weights dequantized from Q4_1)" if model is None else str(model)


# ---------------------------------------------------------------- KV bytes
def kv_bytes_per_page(model_path: str, kv_format: str, page_size: int, dtype: str = "float32") -> int:
    """Bytes of one KV page over all layers (values + fp8 scales), from the shapes of the pools
    the model allocates (nothing is loaded or allocated), by the engine's own function."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve.kv.formats import get_kv_format
    from jaxserve.kv.memory import format_token_bytes, model_token_layout
    from jaxserve.loader import load_config
    from jaxserve.models import get_architecture

    cfg = load_config(model_path)
    arch = get_architecture(cfg)
    dt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]
    abstract = nnx.eval_shape(lambda: arch.build(cfg, dt, nnx.Rngs(0)))
    fmt = get_kv_format(kv_format)
    return format_token_bytes(fmt, *model_token_layout(abstract, fmt)) * page_size


def corpus_texts() -> list[tuple[str, str]]:
    """(topic, text) from CPython's pydoc_data.topics: the Python documentation text that ships
    with the interpreter, written by the CPython documentation authors. Sorted by topic."""
    from pydoc_data.topics import topics

    return sorted(topics.items())


def tokenize_fn(llm):
    """text -> ids: the model's tokenizer, or UTF-8 bytes folded into the vocabulary for test
    models without one."""
    if llm.tokenizer is not None:
        return llm.tokenizer.encode
    v = llm.cfg.vocab_size
    return lambda text: [b % v for b in text.encode("utf-8")]


def corpus_documents(tokenize, length: int, max_docs: int) -> list[tuple[str, list[int]]]:
    """Up to max_docs (topic, first `length` token ids) from the topics at least `length` tokens
    long; when more qualify, an evenly spaced subset (by topic name order) is taken."""
    docs = []
    for key, text in corpus_texts():
        ids = tokenize(text)
        if len(ids) >= length:
            docs.append((key, list(ids[:length])))
    if len(docs) > max_docs:
        idx = np.linspace(0, len(docs) - 1, max_docs).round().astype(int)
        docs = [docs[i] for i in idx]
    return docs
