"""Decode at batch 1 as a fraction of this machine's memory bandwidth.

At batch 1 a decode step must read every weight once (tied embeddings: the table is read once,
as the LM head) plus the KV of the context so far, so the best possible step time is
bytes / bandwidth. This script measures, interleaved in one run:

- copy bandwidth: a jitted jnp ``x + 1`` (in place) and numpy ``copyto`` over a large float32
  array, counted as bytes read + bytes written per second (the STREAM "copy" convention); the
  best of the two is the machine's limit;
- jaxserve decode at batch 1 on the default model (float32 weights, and bfloat16 weights):
  one request, the median time between its tokens (engine.step() calls, sampling and host
  work included), and the device program's share of it;

and reports achieved GB/s = (weight bytes + KV bytes read at the mean decode context) / step
time, and that as a fraction of the copy bandwidth. "KV bytes" is what attention needs (the
context's tokens); the engine gathers whole chunks of pages up to the longest context (or the
whole page table when one chunk spans it), which is reported separately as the gathered bytes.

    .venv/bin/python bench/bandwidth.py --json bench/results/bandwidth.json
    .venv/bin/python bench/bandwidth.py --variants float32 --engine-default-len   # + the engine's default context
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
    ap.add_argument("--variants", default="float32,bfloat16", help="weight dtypes to measure")
    ap.add_argument("--kv-format", default="bf16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=48, help="tokens generated per repetition")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--engine-default-len", action="store_true",
                    help="also measure float32 with the engine's default max_model_len (the model's context)")
    ap.add_argument("--copy-mib", type=int, default=512, help="size of the array copied (MiB)")
    ap.add_argument("--no-integrity-check", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


class CopyBandwidth:
    """GB/s (bytes read + bytes written per second) of streaming over a large float32 array:
    a jitted jnp ``x + 1`` with the input donated (in place, so no fresh pages to fault in
    on each call) and numpy ``copyto`` into a preallocated array."""

    def __init__(self, nbytes: int):
        import jax
        import jax.numpy as jnp

        self.nbytes = nbytes
        n = nbytes // 4
        self._step = jax.jit(lambda a: a + 1.0, donate_argnums=0)
        self._x = self._step(jnp.zeros(n, jnp.float32))
        self._x.block_until_ready()
        self._src = np.arange(n, dtype=np.float32)
        self._dst = np.empty_like(self._src)
        np.copyto(self._dst, self._src)

    def measure(self, repeats: int = 5) -> dict:
        """Best GB/s of each method over `repeats` runs."""
        best = {"jax": 0.0, "numpy": 0.0}
        for _ in range(repeats):
            t = time.perf_counter()
            self._x = self._step(self._x)
            self._x.block_until_ready()
            best["jax"] = max(best["jax"], 2 * self.nbytes / (time.perf_counter() - t) / 1e9)
            t = time.perf_counter()
            np.copyto(self._dst, self._src)
            best["numpy"] = max(best["numpy"], 2 * self.nbytes / (time.perf_counter() - t) / 1e9)
        return best


def weight_bytes(llm) -> int:
    """Bytes of the decode program's parameters (quantization scales included)."""
    return llm.memory_report()["weight_bytes"]["decode"]


def kv_bytes_per_token(llm) -> int:
    """Bytes of K and V (and fp8 scales) one token occupies across all layers."""
    return llm.memory_report()["kv_bytes_per_token"]


def decode_step_times(llm, prompt: list[int], n: int) -> tuple[list[float], list[float]]:
    """Serve one request of n tokens; -> (engine.step() seconds of each decode step, device
    program seconds of each decode step, measured by blocking on its logits)."""
    from jaxserve.engine.sampling_params import SamplingParams

    engine = llm.engine
    program: list[float] = []  # a step observer: each call returns once its program ran

    def seen(rec):
        if rec.phase == "decode":
            program.append(rec.seconds)

    remove = engine.add_step_observer(seen)
    steps = []
    try:
        engine.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
        first = False
        while engine.has_unfinished():
            t = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t
            if first and any(o.new_token_ids for o in outs):
                steps.append(dt)
            first = first or any(o.new_token_ids for o in outs)
    finally:
        remove()
    return steps, program


def main(argv=None) -> int:
    args = parse_args(argv)
    from jaxserve import LLM
    from jaxserve.models.attention import gathered_slots
    from jaxserve.bench.measure import CompileWatch, machine_info, median, write_json
    from jaxserve.bench.offline import fitted_max_model_len
    from jaxserve.bench.workload import make_workload
    from jaxserve.cli_args import enable_compile_cache

    enable_compile_cache()
    if args.model is None:
        from jaxserve.checkpoint.gguf import default_model_dir

        args.model = str(default_model_dir())
    ctx_len = args.prompt_len + args.decode_tokens
    variants = {}
    for dtype in args.variants.split(","):
        variants[dtype] = dict(dtype=dtype, max_model_len=fitted_max_model_len(ctx_len, args.page_size))
    if args.engine_default_len:
        variants["float32 (engine default max_model_len)"] = dict(dtype="float32", max_model_len=None)
    llms = {}
    for name, v in variants.items():
        t = time.perf_counter()
        llms[name] = LLM(
            args.model, dtype=v["dtype"], kv_format=args.kv_format, page_size=args.page_size,
            num_pages=-(-ctx_len // args.page_size) + 2, max_num_seqs=1, max_prefill_seqs=1,
            prefill_chunk=128, max_num_batched_tokens=128, max_model_len=v["max_model_len"],
            enable_prefix_caching=False, integrity_check=not args.no_integrity_check,
        )
        print(f"loaded {name} in {time.perf_counter() - t:.1f}s", flush=True)
    prompt = make_workload(1, (args.prompt_len, args.prompt_len), (1, 1), llms[next(iter(llms))].cfg.vocab_size,
                           seed=args.seed)[0].prompt_ids
    for name, llm in llms.items():  # warm-up: compile what one request needs
        decode_step_times(llm, prompt, args.decode_tokens)

    copier = CopyBandwidth(args.copy_mib << 20)
    copy_bw = {"jax": [], "numpy": []}
    steps = {name: [] for name in llms}
    program = {name: [] for name in llms}
    with CompileWatch() as compiles:
        for rep in range(args.reps):
            for k, v in copier.measure().items():
                copy_bw[k].append(v)
            order = list(llms) if rep % 2 == 0 else list(llms)[::-1]
            for name in order:
                s, p = decode_step_times(llms[name], prompt, args.decode_tokens)
                steps[name] += s
                program[name] += p
    limit = max(max(v) for v in copy_bw.values())
    mean_ctx = args.prompt_len + (args.decode_tokens + 1) / 2  # context read by the average decode step
    rows = []
    for name, llm in llms.items():
        w = weight_bytes(llm)
        kv_tok = kv_bytes_per_token(llm)
        need = w + kv_tok * mean_ctx
        gathered = w + kv_tok * gathered_slots(llm.runner.max_pages_per_seq, args.page_size, int(mean_ctx))
        step = median(steps[name])
        prog = median(program[name])
        row = dict(
            variant=name, dtype=variants[name]["dtype"], kv_format=llm.fmt.name,
            max_model_len=llm.engine.max_model_len, page_table_width=llm.runner.max_pages_per_seq,
            weight_bytes=w, kv_bytes_per_token=kv_tok, mean_context=mean_ctx,
            bytes_per_step=need, bytes_gathered_per_step=gathered,
            step_s_median=step, decode_tok_s=1.0 / step, device_program_s_median=prog,
            host_share_of_step=1.0 - prog / step,
            achieved_gb_s=need / step / 1e9, fraction_of_copy_bw=need / step / 1e9 / limit,
            device_only_gb_s=need / prog / 1e9, device_only_fraction=need / prog / 1e9 / limit,
            steps_measured=len(steps[name]),
        )
        rows.append(row)
    print(f"copy bandwidth (read + write, best of {args.reps}x5): jnp {max(copy_bw['jax']):.1f} GB/s, "
          f"numpy {max(copy_bw['numpy']):.1f} GB/s -> limit {limit:.1f} GB/s; machine load {os.getloadavg()[0]:.1f}")
    for r in rows:
        print(
            f"{r['variant']}: weights {r['weight_bytes'] / 1e6:.1f} MB + KV {r['kv_bytes_per_token'] * mean_ctx / 1e6:.2f} MB "
            f"(ctx {mean_ctx:.0f}) per step; step {r['step_s_median'] * 1e3:.1f} ms = {r['decode_tok_s']:.1f} tok/s "
            f"(device program {r['device_program_s_median'] * 1e3:.1f} ms); achieved {r['achieved_gb_s']:.2f} GB/s = "
            f"{r['fraction_of_copy_bw']:.1%} of copy bandwidth (device program alone {r['device_only_fraction']:.1%}); "
            f"with the KV gathered in whole chunks (page table {r['page_table_width']} pages wide) it reads "
            f"{r['bytes_gathered_per_step'] / 1e6:.1f} MB/step",
            flush=True,
        )
    print(f"compilations during the timed reps: {compiles.count} {compiles.names}")
    if args.json:
        write_json(args.json, dict(
            benchmark="bandwidth", command=" ".join(["python"] + sys.argv), model=args.model,
            config=vars(args), copy_bandwidth_gb_s=copy_bw, copy_bandwidth_limit_gb_s=limit,
            results=rows, compiles_during_timed_reps=compiles.count, compiled_functions=compiles.names,
            machine=machine_info(),
        ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
