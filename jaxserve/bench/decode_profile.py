"""Where a decode step's time goes, at a given batch size and context.

B requests with C-token prompts are brought to steady decoding; then, over --steps engine
steps, each ``engine.step()`` is timed, and inside it the decode program (a step observer:
the program call returns once its integrity flags are read back), so the host side
(scheduling, input building, host-to-device copies, sampling, stop checks) is the difference.
Three more engine steps then run under the JAX profiler and their XLA ops are grouped by what
they do, using the optimized HLO that XLA dumps at compile time (so this module compiles
afresh: the persistent compile cache is off):

- matmul: dots (projections, MLP, LM head), including fusions that contain one;
- KV gather: ops that read pages through the page table (the paged context, dequantized);
- KV write: scatters of the new token's K/V into pages;
- attention (native kernel): the native backend's paged attention calls;
- attention math / norms / other: the rest.

    python -m jaxserve.bench.decode_profile --batch 1 --batch 32 --json bench/results/decode_profile.json
    python -m jaxserve.bench.decode_profile --batch 8 --max-model-len 0   # the engine's default page-table width

Op times are summed over XLA's worker threads (CPU time) and shown as shares; the wall-clock
attribution is each share times the program's measured time.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

from jaxserve.cli_args import ModelOptions


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m jaxserve.bench.decode_profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ModelOptions(dtype="float32", kv_format="bf16").add_to(ap)
    ap.add_argument("--decode-weights", default=None, help="decode weight format (default: as loaded)")
    ap.add_argument("--batch", type=int, action="append", default=None, help="repeat for several (default 1 and 32)")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="default: context + steps + warm-up, fitted to a power-of-two page count; 0 = engine default")
    ap.add_argument("--num-pages", type=int, default=None, help="KV pool size (default: just enough for the batch)")
    ap.add_argument("--no-integrity-check", action="store_true")
    ap.add_argument("--attention-backend", default=None, help="xla, native, ... (default: the engine's)")
    ap.add_argument("--tied-head-weights", default=None, help="a tied head's format, e.g. bf16 (default: as loaded)")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


# ---------------------------------------------------------------------- HLO op classes
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def parse_hlo_ops(text: str) -> dict[str, str]:
    """Optimized HLO module text -> {instruction name: category}."""
    bodies: dict[str, list[str]] = {}
    current = None
    entry_lines: list[str] = []
    for line in text.splitlines():
        head = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            current = "ENTRY" if head.group(1) else head.group(2)
            bodies[current] = []
            continue
        if line.startswith("}"):
            current = None
            continue
        if current is not None:
            bodies[current].append(line)
            if current == "ENTRY":
                entry_lines.append(line)

    def text_of(name: str, depth: int = 0) -> str:
        lines = bodies.get(name, [])
        out = "\n".join(lines)
        if depth < 3:  # nested fusions / wrapped computations
            for callee in re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", out):
                out += "\n" + text_of(callee, depth + 1)
        return out

    cats = {}
    for line in bodies.get("ENTRY", []):
        m = _INSTR.match(line)
        if not m:
            continue
        name, rhs = m.groups()
        callee = re.search(r"calls=%?([\w.\-]+)", rhs)
        body = rhs + ("\n" + text_of(callee.group(1)) if callee else "")
        cats[name] = classify(name, body)
    return cats


def classify(name: str, body: str) -> str:
    """A category for one optimized-HLO instruction from its name and text (its operands and
    its fused computation). Heuristic, by what the runner's programs contain: KV pools are
    parameters named ``kv_*``, page tables ``*page_table*``; the native kernels are custom calls
    named by their target (``jaxserve_gqa_paged``: attention over pages, the rest matmuls)."""
    target = re.search(r'custom_call_target="(\w+)"', body.split("\n", 1)[0])
    if target and target.group(1) == "jaxserve_gqa_paged":
        return "attention (native kernel)"
    if target and target.group(1).startswith("jaxserve_"):
        return "matmul"
    if name.startswith(("dot", "ynn_fusion", "onednn")) or " dot(" in body or "__onednn$matmul" in body:
        return "matmul"
    if "scatter(" in body or name.startswith(("scatter", "wrapped_scatter")):
        return "KV write (scatter)"
    if "convert" in name and re.search(r"%(kv_[\w.]*|wrapped_scatter[\w.]*)[,)]", body.split("\n", 1)[0]):
        # XLA on CPU scatters bf16 in float32: the whole pool is converted up and back down.
        return "KV write: whole-pool dtype converts"
    if "page_table" in body or " gather(" in body:
        return "KV gather (page table)"
    if "exponential(" in body or "rsqrt(" in body or " reduce(" in body:
        return "attention softmax / norms"
    return "other (elementwise, copies)"


def load_trace_ops(trace_dir: str) -> dict[str, float]:
    """{op name: summed microseconds} of XLA op events in the newest trace under trace_dir."""
    files = sorted(glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.trace.json.gz")))
    if not files:
        return {}
    with gzip.open(files[-1]) as f:
        events = json.load(f)["traceEvents"]
    ops: dict[str, float] = collections.defaultdict(float)
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") == "X" and "hlo_op" in args and args.get("hlo_module", "").startswith("jit_step"):
            ops[args["hlo_op"]] += e.get("dur", 0.0)
    return ops


def newest_dump(dump_dir: str, pattern: str) -> str | None:
    files = sorted(glob.glob(os.path.join(dump_dir, pattern)), key=os.path.getmtime)
    return files[-1] if files else None


# ---------------------------------------------------------------------- measuring
def profile_batch(args, batch: int, dump_dir: str) -> dict:
    from jaxserve.bench.measure import median
    from jaxserve.bench.workload import make_workload
    from jaxserve.engine.sampling_params import SamplingParams

    total = args.context + 2 * args.steps + 8
    llm = _make_llm(args, batch, total)
    engine = llm.engine
    work = make_workload(batch, (args.context, args.context), (1, 1), llm.cfg.vocab_size, seed=batch)
    sp = SamplingParams(max_tokens=total - args.context, ignore_eos=True)
    steps, program, trace_dir = _time_decode(engine, [r.prompt_ids for r in work], sp, args.steps)
    step_s, prog_s = median(steps), median(program)
    ops = load_trace_ops(trace_dir)
    hlo_file = newest_dump(dump_dir, "*jit_step*after_optimizations.txt")
    cats = parse_hlo_ops(open(hlo_file).read()) if hlo_file else {}
    by_cat: dict[str, float] = collections.defaultdict(float)
    for op, us in ops.items():
        by_cat[cats.get(op, classify(op, ""))] += us
    op_total = sum(by_cat.values()) or 1.0
    top_ops = sorted(ops.items(), key=lambda kv: -kv[1])[:8]
    return dict(
        batch=batch, context=args.context, dtype=args.dtype, kv_format=llm.fmt.name, num_pages=llm.num_pages,
        max_model_len=engine.max_model_len, page_table_width=llm.runner.max_pages_per_seq,
        engine_step_s=step_s, decode_program_s=prog_s, host_s=step_s - prog_s,
        decode_tok_s=batch / step_s,
        program_shares={k: v / op_total for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        program_ms_by_category={k: v / op_total * prog_s * 1e3 for k, v in by_cat.items()},
        top_ops=[dict(op=op, category=cats.get(op, classify(op, "")), share=us / op_total) for op, us in top_ops],
        trace_dir=trace_dir, hlo_dump=hlo_file,
        kv_gathered_mb_per_step=_gathered_mb(llm, batch, args.context + args.steps + 5),
    )


def _make_llm(args, batch: int, total: int):
    """An LLM whose pool holds batch requests of total tokens (unless --num-pages says otherwise)."""
    from jaxserve import LLM
    from jaxserve.bench.offline import fitted_max_model_len

    max_len = fitted_max_model_len(total, args.page_size) if args.max_model_len is None else (args.max_model_len or None)
    return LLM(args.model, dtype=args.dtype, kv_format=args.kv_format, page_size=args.page_size,
               num_pages=args.num_pages or batch * -(-total // args.page_size) + 2, max_num_seqs=batch,
               max_prefill_seqs=min(batch, 8), prefill_chunk=128, max_num_batched_tokens=1024, max_model_len=max_len,
               enable_prefix_caching=False, integrity_check=not args.no_integrity_check,
               decode_weights=args.decode_weights, attention_backend=args.attention_backend,
               tied_head_weights=args.tied_head_weights)


def _time_decode(engine, prompts, sp, n_steps: int) -> tuple[list[float], list[float], str]:
    """Bring every prompt to steady decoding, then time n_steps engine steps and the decode
    program inside each; three more steps run under the JAX profiler. Returns (engine-step
    seconds, decode-program seconds, trace directory); the requests are aborted afterwards."""
    import jax

    program = []  # decode program seconds (a step observer: the call returns once the program ran)

    def seen(rec):
        if rec.phase == "decode":
            program.append(rec.seconds)

    remove = engine.add_step_observer(seen)
    rids = [engine.add_request(p, sp) for p in prompts]
    try:
        started = set()
        while len(started) < len(rids):  # prefill (and the first decode steps, which compile)
            started.update(o.request_id for o in engine.step() if o.new_token_ids)
        for _ in range(2):
            engine.step()
        program.clear()
        steps = []
        for _ in range(n_steps):
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
        trace_dir = tempfile.mkdtemp(prefix="jaxserve_trace_")
        jax.profiler.start_trace(trace_dir)
        for _ in range(3):
            engine.step()
        jax.profiler.stop_trace()
    finally:
        remove()
        for rid in rids:
            engine.abort(rid)
        engine.run_until_done()
    return steps, program, trace_dir


def _gathered_mb(llm, batch: int, context: int) -> float:
    """MB of KV pages the decode program gathers per step: whole chunks of pages up to the
    batch's longest context and the step's own token, read back from its page (the whole table
    when one chunk spans it)."""
    from jaxserve.models.attention import gathered_slots

    slots = gathered_slots(llm.runner.max_pages_per_seq, llm.page_size, context + 1)
    per_slot = llm.memory_report()["kv_bytes_per_token"]
    return batch * slots * per_slot / 1e6


def main(argv=None) -> int:
    args = parse_args(argv)
    dump_dir = tempfile.mkdtemp(prefix="jaxserve_hlo_")
    if "jax" in sys.modules:
        print("note: jax already imported; the XLA dump flags may not apply", file=sys.stderr)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_dump_to={dump_dir} --xla_dump_hlo_as_text"
                               " --xla_dump_hlo_module_re=.*jit_step.*").strip()
    from jaxserve.bench.measure import format_table, machine_info, write_json

    if args.model is None:
        from jaxserve.checkpoint.gguf import default_model_dir

        args.model = str(default_model_dir())
    results = []
    for b in args.batch or [1, 32]:
        r = profile_batch(args, b, dump_dir)
        results.append(r)
        rows = [
            ("engine.step()", f"{r['engine_step_s'] * 1e3:.1f} ms ({r['decode_tok_s']:.1f} tok/s)"),
            ("  decode program", f"{r['decode_program_s'] * 1e3:.1f} ms ({r['decode_program_s'] / r['engine_step_s']:.0%})"),
            ("  host side", f"{r['host_s'] * 1e3:.1f} ms ({r['host_s'] / r['engine_step_s']:.0%})"),
        ]
        rows += [(f"    {k}", f"{r['program_ms_by_category'][k]:.1f} ms ({v:.0%} of program)")
                 for k, v in r["program_shares"].items()]
        rows += [("KV gathered per step", f"{r['kv_gathered_mb_per_step']:.1f} MB (page-table width "
                                          f"{r['page_table_width']} pages, max_model_len {r['max_model_len']})"),
                 ("KV pool", f"{r['num_pages']} pages")]
        print(format_table(rows, f"decode profile: batch {b}, context {args.context}, {args.dtype}, kv {r['kv_format']}"))
        print("  top ops: " + ", ".join(f"{o['op']} [{o['category']}] {o['share']:.0%}" for o in r["top_ops"][:5]))
        print(flush=True)
    if args.json:
        write_json(args.json, dict(benchmark="decode_profile", command=" ".join(sys.argv), config=vars(args),
                                   results=results, machine=machine_info()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
