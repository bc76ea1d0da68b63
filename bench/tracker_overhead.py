"""Decode-step time with the page-integrity check on vs off, interleaved in one run.

Two runners share one set of weights (same arrays): one with PageTracker, one with
NoOpTracker. Steps alternate on/off so machine noise hits both alike; we report the
median step time of each, the overhead of the medians, and the median of the paired
per-step differences (with a bootstrap 95% interval), at several batch sizes.

    .venv/bin/python bench/tracker_overhead.py                      # the default SmolLM2 model
    .venv/bin/python bench/tracker_overhead.py --model checkpoints/tiny-kimi-k2 --steps 400
"""
import argparse
import json
import time

import numpy as np
import scipy.stats


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint dir (default: embedded SmolLM2)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=256, help="tokens already cached per row")
    ap.add_argument("--steps", type=int, default=60, help="measured steps per config (each on and off)")
    ap.add_argument("--kv-format", default="fp8_e4m3")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import jax

    from jaxserve.engine.block_manager import BlockManager
    from jaxserve.kv.page_tracker import NoOpTracker, PageTracker
    from jaxserve.kv.formats import get_kv_format
    from jaxserve.loader import load_model
    from jaxserve.step_batch import StepBatch
    from jaxserve.executor.runner import ModelRunner

    if args.model is None:
        from jaxserve.checkpoint.gguf import default_model_dir

        args.model = str(default_model_dir())
    cfg, model = load_model(args.model)
    fmt = get_kv_format(args.kv_format)
    batches = [int(b) for b in args.batches.split(",")]
    s = args.page_size
    per_seq = -(-(args.context + 1) // s)
    num_pages = max(batches) * per_seq + 2
    runners = {
        "on": ModelRunner(model, fmt, num_pages, s, tracker=PageTracker(), max_pages_per_seq=per_seq),
        "off": ModelRunner(model, fmt, num_pages, s, tracker=NoOpTracker(), max_pages_per_seq=per_seq),
    }
    results = []
    rng = np.random.default_rng(0)
    for b in batches:
        bm = BlockManager(num_pages, s, enable_prefix_caching=False)
        for i in range(b):
            bm.allocate_prompt(i, list(rng.integers(0, cfg.vocab_size, args.context + 1)))
        on_runner = runners["on"]
        on_runner.generation = on_runner.tracker.init(num_pages)
        on_runner.apply_generation_updates(*bm.take_generation_updates())
        m = runners["on"].max_pages_per_seq
        table = np.zeros((b, m), np.int32)
        expected = np.zeros((b, m), np.int32)
        for i in range(b):
            table[i, :per_seq] = bm.page_table(i)
            expected[i, :per_seq] = bm.expected_generations(i)
        tokens = rng.integers(0, cfg.vocab_size, (b, 1)).astype(np.int32)
        cached = np.full(b, args.context, np.int32)
        new = np.ones(b, np.int32)
        used = np.full(b, per_seq, np.int32)

        def run(name):
            t0 = time.perf_counter()
            res = runners[name].step(StepBatch(tokens, cached, new, table, expected, used, phase="decode"))
            res.logits.block_until_ready()
            assert res.ok[:b].all(), (name, res.cause)
            return time.perf_counter() - t0

        for _ in range(3):  # compile and settle
            run("on"), run("off")
        on, off = [], []
        for i in range(args.steps):
            order = ("on", "off") if i % 2 == 0 else ("off", "on")
            t = {n: run(n) for n in order}
            on.append(t["on"])
            off.append(t["off"])
        on, off = np.array(on), np.array(off)
        diff = on - off
        # Percentile bootstrap over steps of the median paired difference, as % of the median off step.
        ci = scipy.stats.bootstrap((diff,), lambda d, axis=-1: np.median(d, axis=axis) / np.median(off) * 100,
                                   n_resamples=2000, method="percentile", rng=rng).confidence_interval
        row = dict(
            batch=b, context=args.context, step_ms_on=float(np.median(on) * 1e3), step_ms_off=float(np.median(off) * 1e3),
            overhead_pct_medians=float((np.median(on) / np.median(off) - 1) * 100),
            overhead_pct_paired=float(np.median(diff) / np.median(off) * 100),
            paired_ci95=[float(ci.low), float(ci.high)],
        )
        results.append(row)
        print(
            f"batch {b:3d}: step {row['step_ms_off']:.2f} ms off / {row['step_ms_on']:.2f} ms on; overhead "
            f"{row['overhead_pct_medians']:+.2f}% (medians), {row['overhead_pct_paired']:+.2f}% paired "
            f"[95% CI {row['paired_ci95'][0]:+.2f}, {row['paired_ci95'][1]:+.2f}]",
            flush=True,
        )
    # The check op alone, for scale.
    tr = PageTracker()
    gen = runners["on"].generation
    check = jax.jit(tr.check)
    args_ = (gen, jax.numpy.asarray(table), jax.numpy.asarray(expected), jax.numpy.asarray(used))
    check(*args_)[0].block_until_ready()
    t0 = time.perf_counter()
    for _ in range(200):
        check(*args_)[0].block_until_ready()
    print(f"check op alone (batch {batches[-1]}, {m} pages/row, dispatched separately): "
          f"{(time.perf_counter() - t0) / 200 * 1e6:.0f} us per call")
    print(f"model {cfg.architecture}, kv {fmt.name}, jax {jax.__version__}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, kv_format=fmt.name, results=results), f, indent=2)


if __name__ == "__main__":
    main()
