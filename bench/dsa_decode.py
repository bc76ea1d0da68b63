"""GLM-5 decode step time against context length: DeepSeek sparse attention (the lightning
indexer picks ``index_topk`` cached tokens per query) against dense attention, on one tiny
random GLM-5 built here with transformers.

The two engines load the same weights; the dense one's config sets ``index_topk`` to the whole
context, so its layers attend to every cached token (jaxserve attends densely when the page
table holds no more than ``index_topk`` slots). For each context length one request is
prefilled, then decode steps are timed through a step observer (the decode program alone) and
whole ``engine.step()`` calls; medians, both engines interleaved. Sparse selection reads only
the selected tokens' latent but still scores every cached token's index key, so it pays once
the latent reads it saves outweigh the indexer's own work.

    .venv/bin/python bench/dsa_decode.py --contexts 128,512,2048 --json bench/results/dsa_decode.json
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="128,512,2048", help="cached tokens before the timed decode steps")
    p.add_argument("--index-topk", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per context and engine")
    p.add_argument("--kv-format", default="bf16")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def build(tmp: Path, args, max_len: int) -> tuple[str, str]:
    from hf_models import build_glm_moe_dsa

    sparse = tmp / "sparse"
    build_glm_moe_dsa(sparse, hidden_size=args.hidden, num_hidden_layers=args.layers, index_topk=args.index_topk,
                      indexer_types=["full", "shared"] * (args.layers // 2), max_position_embeddings=max_len,
                      intermediate_size=2 * args.hidden, moe_intermediate_size=args.hidden // 2)
    dense = tmp / "dense"
    shutil.copytree(sparse, dense)
    cfg = json.loads((dense / "config.json").read_text())
    cfg["index_topk"] = max_len  # every cached token selected: the dense path
    (dense / "config.json").write_text(json.dumps(cfg))
    return str(sparse), str(dense)


def time_decode(llm, context: int, steps: int, vocab: int) -> dict:
    import numpy as np

    from jaxserve.engine.sampling_params import SamplingParams

    engine = llm.engine
    program = []
    remove = engine.add_step_observer(lambda rec: program.append(rec.seconds) if rec.phase == "decode" else None)
    prompt = [int(x) for x in np.random.default_rng(context).integers(2, vocab, size=context)]
    engine.add_request(prompt, SamplingParams(max_tokens=steps + 3, ignore_eos=True))
    wall = []
    try:
        while engine.has_unfinished():
            t = time.perf_counter()
            outs = engine.step()
            if any(o.new_token_ids for o in outs) and program:
                wall.append(time.perf_counter() - t)
    finally:
        remove()
    return {"program_ms": 1e3 * statistics.median(program[2:]), "step_ms": 1e3 * statistics.median(wall[2:])}


def main(argv=None) -> int:
    args = parse_args(argv)
    contexts = [int(x) for x in args.contexts.split(",")]
    max_len = 1 << (max(contexts) + args.steps + 8 - 1).bit_length()
    from jaxserve import LLM
    from jaxserve.cli_args import enable_compile_cache

    enable_compile_cache()
    tmp = Path(tempfile.mkdtemp(prefix="dsa_bench_"))
    try:
        paths = dict(zip(("sparse", "dense"), build(tmp, args, max_len)))
        llms = {k: LLM(p, kv_format=args.kv_format, max_model_len=max_len, num_pages=max_len // 16 + 4,
                       max_num_seqs=1, prefill_chunk=256, max_num_batched_tokens=256) for k, p in paths.items()}
        rows = []
        for c in contexts:
            for k in ("sparse", "dense"):
                time_decode(llms[k], c, 4, llms[k].cfg.vocab_size)  # compiles this context's shapes
            r = {k: time_decode(llms[k], c, args.steps, llms[k].cfg.vocab_size) for k in ("sparse", "dense")}
            row = {"context": c, **{f"{k}_{m}": v[m] for k, v in r.items() for m in v},
                   "program_ratio_dense_over_sparse": r["dense"]["program_ms"] / r["sparse"]["program_ms"]}
            rows.append(row)
            print(f"context {c:6d}: decode program sparse {row['sparse_program_ms']:.2f} ms, dense "
                  f"{row['dense_program_ms']:.2f} ms (dense/sparse {row['program_ratio_dense_over_sparse']:.2f}x); "
                  f"engine step {row['sparse_step_ms']:.2f} / {row['dense_step_ms']:.2f} ms", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "max_model_len": max_len, "rows": rows}, indent=2))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
