"""GLM-5 decode step time against context length: DeepSeek sparse attention (the lightning
indexer picks ``index_topk`` cached tokens per query) against dense attention, on one tiny
random GLM-5 built here with transformers.

The two engines load the same weights; the dense one's config sets ``index_topk`` to the whole
context, so its layers attend to every cached token (jaxserve attends densely when the page
table holds no more than ``index_topk`` slots). For each context length one request is
prefilled in each engine, then decode steps are timed through a step observer (the decode
program alone) and as whole ``engine.step()`` calls (wall and process CPU time), the two
engines' steps alternating. Sparse decode reads only the ``index_topk`` selected tokens' latent
and rope rows (a gather) but still scores every cached token's index key, so it pays once the
latent reads it saves outweigh the indexer's own work; the dense engine runs no scoring (its table is no wider than its ``index_topk``).

    .venv/bin/python bench/dsa_decode.py --contexts 128,512,2048 --json bench/results/dsa_decode.json
    # GLM-5's own proportions (attention 16 heads x (256 + 32) per token against 8 x 64 indexer):
    .venv/bin/python bench/dsa_decode.py --heads 16 --kv-lora-rank 256 --rope-dim 32 --index-heads 8 \
        --index-dim 64 --index-topk 256 --contexts 256,1024,2048,4096,8192
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="128,512,2048", help="cached tokens before the timed decode steps")
    p.add_argument("--index-topk", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8, help="attention heads")
    p.add_argument("--kv-lora-rank", type=int, default=32, help="MLA latent width")
    p.add_argument("--rope-dim", type=int, default=16, help="MLA rope key width (qk_rope_head_dim)")
    p.add_argument("--index-heads", type=int, default=16)
    p.add_argument("--index-dim", type=int, default=32)
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per context and engine")
    p.add_argument("--kv-format", default="bf16")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def build(tmp: Path, args, max_len: int) -> tuple[str, str]:
    from tests.hf_models import build_glm_moe_dsa

    sparse = tmp / "sparse"
    build_glm_moe_dsa(sparse, hidden_size=args.hidden, num_hidden_layers=args.layers, index_topk=args.index_topk,
                      indexer_types=["full", "shared"] * (args.layers // 2), max_position_embeddings=max_len,
                      intermediate_size=2 * args.hidden, moe_intermediate_size=args.hidden // 2,
                      num_attention_heads=args.heads, num_key_value_heads=args.heads, kv_lora_rank=args.kv_lora_rank,
                      qk_rope_head_dim=args.rope_dim, index_n_heads=args.index_heads, index_head_dim=args.index_dim)
    dense = tmp / "dense"
    shutil.copytree(sparse, dense)
    cfg = json.loads((dense / "config.json").read_text())
    cfg["index_topk"] = max_len  # every cached token selected: the dense path
    (dense / "config.json").write_text(json.dumps(cfg))
    return str(sparse), str(dense)


def time_pair(llms: dict, context: int, steps: int, vocab: int) -> dict:
    """One request of ``context`` prompt tokens per engine, then ``steps`` decode steps each, the
    engines' steps alternating (so both see the same background load). Per engine: the decode
    program's wall time (median and minimum: the minimum is the least disturbed by other
    processes on a shared machine) and the process CPU time of each decode ``engine.step()``."""
    import numpy as np

    from jaxserve.engine.sampling_params import SamplingParams

    prompt = [int(x) for x in np.random.default_rng(context).integers(2, vocab, size=context)]
    got = {k: {"program": [], "step": [], "cpu": []} for k in llms}
    removes = []
    for k, llm in llms.items():
        keep = got[k]["program"]
        removes.append(llm.engine.add_step_observer(
            lambda rec, keep=keep: keep.append(rec.seconds) if rec.phase == "decode" else None))
        llm.engine.add_request(prompt, SamplingParams(max_tokens=steps + 3, ignore_eos=True))
    try:
        while any(llm.engine.has_unfinished() for llm in llms.values()):
            for k, llm in llms.items():
                if not llm.engine.has_unfinished():
                    continue
                before, t, c = len(got[k]["program"]), time.perf_counter(), time.process_time()
                llm.engine.step()
                if len(got[k]["program"]) > before:  # a decode step ran
                    got[k]["step"].append(time.perf_counter() - t)
                    got[k]["cpu"].append(time.process_time() - c)
    finally:
        for remove in removes:
            remove()
    ms = lambda xs, f: 1e3 * f(xs[2:])  # noqa: E731  (the first steps may still compile)
    return {k: {"program_ms": ms(v["program"], statistics.median), "program_min_ms": ms(v["program"], min),
                "step_ms": ms(v["step"], statistics.median), "cpu_ms": ms(v["cpu"], statistics.median)}
            for k, v in got.items()}


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
            time_pair(llms, c, 4, llms["sparse"].cfg.vocab_size)  # compiles this context's shapes
            r = time_pair(llms, c, args.steps, llms["sparse"].cfg.vocab_size)
            row = {"context": c, **{f"{k}_{m}": v[m] for k, v in r.items() for m in v}}
            for m in ("program_ms", "program_min_ms", "cpu_ms"):
                row[f"{m}_dense_over_sparse"] = r["dense"][m] / r["sparse"][m]
            rows.append(row)
            print(f"context {c:6d}: decode program median sparse {row['sparse_program_ms']:.2f} / dense "
                  f"{row['dense_program_ms']:.2f} ms ({row['program_ms_dense_over_sparse']:.2f}x), min "
                  f"{row['sparse_program_min_ms']:.2f} / {row['dense_program_min_ms']:.2f} ms "
                  f"({row['program_min_ms_dense_over_sparse']:.2f}x); CPU per step {row['sparse_cpu_ms']:.2f} / "
                  f"{row['dense_cpu_ms']:.2f} ms ({row['cpu_ms_dense_over_sparse']:.2f}x)", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "max_model_len": max_len, "rows": rows}, indent=2))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
