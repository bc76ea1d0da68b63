"""jaxserve vs Hugging Face transformers ``generate`` on the same model, prompts and output
lengths, side by side in one run.

Both run the same checkpoint in float32 (default: the embedded SmolLM2-135M-Instruct), greedy,
EOS ignored (transformers: ``min_new_tokens = max_new_tokens``), so both produce exactly
batch x output-len tokens. At each batch size (default 1 and 32): one untimed call of each
(warm-up: torch warms its kernels; jaxserve has compiled every serving bucket at load, as a
server does), then
``--reps`` timed repetitions interleaved A B C, C B A, ... so machine noise hits all alike.
Each call's tokens/s = output tokens / wall time of the whole call (prefill included).

transformers runs at several torch thread counts (default: torch's own, one per core, and 1):
on a shared machine, torch's OpenMP threads can stall badly when another process holds a core,
so the ratio is taken against transformers' fastest setting. Reported: the median tokens/s
of each side, jaxserve / best transformers (ratio of medians, and the median of the
per-repetition ratios), and the greedy token agreement between the two.

transformers gets one ``generate`` call over the whole batch with left padding and an
attention mask (its batched path); jaxserve gets the batch through ``LLM.generate`` with
max_num_seqs >= batch, prefix caching off (a repetition must not reuse the previous one's KV).

Serving mixes: ``--output-len-range MIN MAX`` gives each request its own output length (both
sides count only the tokens each request asked for; transformers' generate call still runs every
row to its batch's longest output), and ``--requests N`` serves N requests through B slots
(transformers: consecutive generate calls of B; jaxserve: max_num_seqs = B, freed slots refilled
at once by continuous batching).

    .venv/bin/python bench/vs_transformers.py --json bench/results/vs_transformers.json
    .venv/bin/python bench/vs_transformers.py --batches 1,8,32 --output-len 64 --reps 5
    .venv/bin/python bench/vs_transformers.py --batches 32 --requests 128 --output-len-range 16 128
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF-format checkpoint dir (default: embedded SmolLM2)")
    ap.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(32, 96), metavar=("MIN", "MAX"),
                    help="prompt lengths, uniform per request (random token ids)")
    ap.add_argument("--output-len", type=int, default=64, help="new tokens per request (both sides)")
    ap.add_argument("--output-len-range", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                    help="instead of --output-len: each request its own output length, uniform in [MIN, MAX] "
                         "(a serving mix). transformers' one generate call runs every row to the batch's "
                         "longest output; only each request's own tokens are counted, on both sides")
    ap.add_argument("--requests", type=int, default=0,
                    help="serve this many requests through B slots (one --batches value): transformers runs "
                         "them as consecutive generate calls of B, jaxserve gets all at once with "
                         "max_num_seqs = B (continuous batching refills freed slots). 0: one batch of B")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per side and batch")
    ap.add_argument("--kv-format", default="float32", help="jaxserve KV pages: float32 (as transformers) | bf16 | fp8_e4m3")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-prefill-seqs", type=int, default=8)
    ap.add_argument("--prefill-chunk", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--no-integrity-check", action="store_true")
    ap.add_argument("--torch-threads", default="0,1",
                    help="transformers is run at each of these torch thread counts (0 = torch's default, "
                         "one per core); the ratio is taken against the fastest")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Greedy agreement of two runs over the same prompts: tokens equal position by position,
    the fraction of each output before the first difference, and whole outputs equal."""
    same = total = 0
    prefix = []
    for x, y in zip(a, b):
        n = min(len(x), len(y))
        same += sum(int(p == q) for p, q in zip(x, y))
        total += max(len(x), len(y))
        first = next((i for i in range(n) if x[i] != y[i]), n)
        prefix.append(first / max(len(x), len(y), 1))
    return dict(
        token_match=same / max(total, 1),
        mean_prefix_match=float(np.mean(prefix)),
        identical_outputs=sum(int(list(x) == list(y)) for x, y in zip(a, b)),
        outputs=len(a),
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from transformers import LlamaForCausalLM

    from jaxserve import LLM
    from jaxserve.bench.measure import CompileWatch, machine_info, median, write_json
    from jaxserve.bench.offline import fitted_max_model_len
    from jaxserve.bench.workload import make_workload
    from jaxserve.cli_args import enable_compile_cache
    from jaxserve.engine.sampling_params import SamplingParams

    enable_compile_cache()
    default_threads = torch.get_num_threads()
    thread_counts = list(dict.fromkeys(int(t) or default_threads for t in args.torch_threads.split(",")))
    if args.model is None:
        from jaxserve.checkpoint.gguf import default_model_dir

        args.model = str(default_model_dir())
    batches = [int(b) for b in args.batches.split(",")]
    if args.requests and len(batches) != 1:
        raise SystemExit("--requests takes exactly one --batches value (the number of slots)")
    out_range = tuple(args.output_len_range) if args.output_len_range else (args.output_len, args.output_len)
    n_out = out_range[1]  # the longest output any request asks for
    max_len = fitted_max_model_len(args.prompt_len[1] + n_out, args.page_size)
    pages_per_seq = -(-(args.prompt_len[1] + n_out) // args.page_size)
    t0 = time.perf_counter()
    llm = LLM(
        args.model, dtype="float32", kv_format=args.kv_format, page_size=args.page_size,
        num_pages=max(batches) * pages_per_seq + 1, max_num_seqs=max(batches), max_model_len=max_len,
        max_prefill_seqs=args.max_prefill_seqs, prefill_chunk=args.prefill_chunk,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
        integrity_check=not args.no_integrity_check,
    )
    llm.warmup()  # every serving bucket compiled now, as a server does before taking traffic
    t1 = time.perf_counter()
    hf = LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    t2 = time.perf_counter()
    pad_id = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    print(f"loaded jaxserve in {t1 - t0:.1f}s, transformers in {t2 - t1:.1f}s; torch threads {thread_counts} "
          f"(default {default_threads}), kv {llm.fmt.name}, machine load {os.getloadavg()[0]:.1f}", flush=True)

    # Where jaxserve's time goes in each call: its prefill and decode programs (runner.step
    # already waits for its program: it reads the integrity flags back), and the host rest.
    split: list[dict] = []

    def run_jaxserve(prompts, out_lens):
        sp = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in out_lens]
        spent = {"prefill": 0.0, "decode": 0.0, "decode_steps": 0}

        def seen(rec):
            spent[rec.phase] += rec.seconds
            spent["decode_steps"] += rec.phase == "decode"

        remove = llm.engine.add_step_observer(seen)
        try:
            t = time.perf_counter()
            outs = llm.generate(prompts, sp)
            dt = time.perf_counter() - t
        finally:
            remove()
        assert [len(o) for o in outs] == list(out_lens)
        split.append(dict(spent, host=dt - spent["prefill"] - spent["decode"]))
        return dt, [list(o) for o in outs]

    def run_transformers(prompts, out_lens, threads):
        torch.set_num_threads(threads)
        if len(prompts) > slots:  # consecutive generate calls of `slots` requests each
            t, gen = 0.0, []
            for i in range(0, len(prompts), slots):
                dt, g = run_transformers(prompts[i: i + slots], out_lens[i: i + slots], threads)
                t += dt
                gen += g
            return t, gen
        longest = max(out_lens)  # one generate call: every row runs to the batch's longest output
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        t = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                do_sample=False, pad_token_id=pad_id, top_p=None, top_k=None, temperature=None,
            )
        dt = time.perf_counter() - t
        gen = out[:, width:].tolist()
        assert all(len(g) == longest for g in gen)
        return dt, [g[:n] for g, n in zip(gen, out_lens)]  # each request's own tokens

    sides = {"jaxserve": run_jaxserve}
    for n in thread_counts:
        sides[f"transformers_{n}t"] = lambda prompts, out_lens, n=n: run_transformers(prompts, out_lens, n)
    hf_sides = [name for name in sides if name != "jaxserve"]
    rows = []
    for b in batches:
        slots = b
        n_req = args.requests or b
        work = make_workload(n_req, tuple(args.prompt_len), out_range, llm.cfg.vocab_size, seed=args.seed + b)
        prompts = [r.prompt_ids for r in work]
        out_lens = [r.max_tokens for r in work]
        # untimed: compile / warm up (on the first B requests)
        warm = {name: fn(prompts[:b], out_lens[:b]) for name, fn in sides.items()}
        times = {name: [] for name in sides}
        outputs = {name: warm[name][1] if n_req == b else None for name in sides}
        split.clear()
        with CompileWatch() as compiles:
            for rep in range(args.reps):
                order = list(sides) if rep % 2 == 0 else list(sides)[::-1]  # A B C, C B A, ...
                for name in order:
                    dt, toks = sides[name](prompts, out_lens)
                    times[name].append(dt)
                    if outputs[name] is None:
                        outputs[name] = toks
                    elif toks != outputs[name]:
                        print(f"  note: {name} greedy output changed between repetitions", file=sys.stderr)
        tokens = sum(out_lens)  # useful tokens: what the requests asked for
        tps = {name: [tokens / t for t in ts] for name, ts in times.items()}
        med = {name: median(v) for name, v in tps.items()}
        best = max(hf_sides, key=lambda name: med[name])  # transformers at its best thread count
        paired = [j / h for j, h in zip(tps["jaxserve"], tps[best])]
        agree = agreement(outputs["jaxserve"], outputs[best])
        row = dict(
            batch=b, requests=n_req, output_tokens_per_call=tokens, output_len_range=list(out_range),
            transformers_tokens_computed_per_call=sum(
                len(out_lens[i: i + b]) * max(out_lens[i: i + b]) for i in range(0, n_req, b)),
            prompt_tokens_per_call=sum(len(p) for p in prompts),
            tok_s_median=med, tok_s_all=tps,
            transformers_best=best,
            ratio_vs_best_transformers=med["jaxserve"] / med[best],
            ratio_vs_each={name: med["jaxserve"] / med[name] for name in hf_sides},
            median_paired_ratio_vs_best=median(paired), paired_ratios_vs_best=paired,
            warmup_s={name: w[0] for name, w in warm.items()},
            compiles_during_timed_reps=compiles.count, agreement_vs_best=agree,
            transformers_thread_counts_agree=all(outputs[h] == outputs[best] for h in hf_sides),
            jaxserve_split_s={k: median(x[k] for x in split) for k in ("prefill", "decode", "host", "decode_steps")},
        )
        rows.append(row)
        hf_txt = ", ".join(f"{name} {med[name]:.1f}" for name in hf_sides)
        print(
            f"batch {b:3d}{f' ({n_req} requests)' if n_req != b else ''}: jaxserve {med['jaxserve']:.1f} tok/s | {hf_txt} tok/s | jaxserve / {best} "
            f"{row['ratio_vs_best_transformers']:.2f}x (paired median {row['median_paired_ratio_vs_best']:.2f}x) | "
            f"greedy agreement: tokens {agree['token_match']:.1%}, prefix {agree['mean_prefix_match']:.1%}, "
            f"identical {agree['identical_outputs']}/{agree['outputs']} | compiles in timed reps {compiles.count}",
            flush=True,
        )
        js = row["jaxserve_split_s"]
        print(f"           jaxserve per call: prefill programs {js['prefill']:.2f}s, decode programs {js['decode']:.2f}s "
              f"({js['decode_steps']:.0f} steps, {js['decode'] / max(js['decode_steps'], 1) * 1e3:.1f} ms each), "
              f"host {js['host']:.2f}s", flush=True)
    if args.json:
        write_json(args.json, dict(
            benchmark="vs_transformers", command=" ".join(["python"] + sys.argv), model=args.model,
            config={k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()},
            jaxserve_engine=dict(kv_format=llm.fmt.name, max_model_len=max_len, num_pages=llm.num_pages,
                                 max_num_seqs=max(batches), prefix_caching=False,
                                 integrity_check=not args.no_integrity_check),
            torch=dict(version=torch.__version__, default_threads=default_threads, thread_counts=thread_counts),
            transformers_version=__import__("transformers").__version__,
            results=rows, machine=machine_info(),
        ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
