"""Step time of one replica over 2 processes x 4 CPU devices against 1 process x 8 devices,
and what the step channel costs per step, in one run.

A DeepSeek-V3-shaped MoE (random weights, built once into --model) serves the same fixed
workload (--requests prompts of --prompt-len random ids, --output-len greedy tokens each) in
both layouts. Each layout runs in fresh processes, alternated --rounds times (1x8, 2x4, 1x8,
...) so machine noise hits both; each run generates once untimed (compiles) and once timed.
From the timed pass, per program call (``LLMEngine.add_step_observer``, which on process 0
includes sending the call to process 1 and reading the logits back): median decode and
prefill step time. Process 0 also times its ``StepLeader.send`` per call (encode + sendall)
and counts the bytes, and both processes then time ``multihost_utils.broadcast_one_to_all``
of one decode step's inputs (the collective alternative to the side channel).

    MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 \\
        .venv/bin/python bench/multihost_step.py --rounds 3 --json bench/results/multihost_step.json
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's jaxserve, whatever is installed
ENGINE = dict(num_pages=128, page_size=16, max_num_seqs=8, max_prefill_seqs=2, prefill_chunk=64,
              max_num_batched_tokens=128, max_model_len=256)


def build_model(path: Path) -> None:
    from tests.hf_models import build_deepseek_v3

    build_deepseek_v3(path, num_hidden_layers=4, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                      num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16, vocab_size=4096,
                      kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=32, v_head_dim=32, qk_nope_head_dim=32, seed=1)


def workload(args):
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(2, 4000, args.prompt_len).tolist() for _ in range(args.requests)]


def timed_generate(llm, args) -> dict:
    records = []
    prompts = workload(args)
    kw = dict(max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts, **kw)  # compiles what the timed pass needs
    remove = llm.engine.add_step_observer(records.append)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, **kw)
    wall = time.perf_counter() - t0
    remove()
    by = lambda phase: [r.seconds for r in records if r.phase == phase]  # noqa: E731
    return {"decode_step_ms": 1e3 * statistics.median(by("decode")), "prefill_step_ms": 1e3 * statistics.median(by("prefill")),
            "calls": len(records), "wall_s": wall, "tokens": [list(o) for o in outs]}


def run_single(args) -> dict:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    from jaxserve import LLM

    return timed_generate(LLM(args.model, kv_format="bf16", num_devices=8, **ENGINE), args)


def broadcast_cost(llm, reps: int) -> float:
    """ms per broadcast_one_to_all of one decode step's inputs (8 rows), collective on every process."""
    import numpy as np
    from jax.experimental import multihost_utils

    m = llm.runner.max_pages_per_seq
    step = (np.zeros((8, 1), np.int32), np.zeros(8, np.int32), np.zeros(8, np.int32), np.zeros((8, m), np.int32),
            np.zeros((8, m), np.int32), np.zeros(8, np.int32))
    multihost_utils.broadcast_one_to_all(step)  # compiles
    t0 = time.perf_counter()
    for _ in range(reps):
        multihost_utils.broadcast_one_to_all(step)
    return 1e3 * (time.perf_counter() - t0) / reps


def run_group(args) -> dict | None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    from jaxserve.multihost.channel import StepFollower, StepLeader
    from jaxserve.multihost.follower import follow
    from jaxserve.multihost.launch import group_config, initialize

    group = group_config(args.coordinator, 2, args.process_id, step_port=args.step_port, peer_timeout_s=60)
    initialize(group, init_timeout_s=120)
    from jaxserve import LLM

    llm = LLM(args.model, kv_format="bf16", num_devices=8, **ENGINE)
    if not group.is_leader:
        channel = StepFollower(group, connect_timeout_s=120)
        follow(llm.runner, channel)
        broadcast_cost(llm, args.broadcast_reps)
        channel.close()
        return None
    leader = StepLeader(group, "127.0.0.1", accept_timeout_s=120)
    sends = []

    def mirror(kind, arrays, meta):
        t = time.perf_counter()
        leader.send(kind, arrays, meta)
        sends.append((kind, time.perf_counter() - t))

    llm.runner.set_mirror(mirror)
    out = timed_generate(llm, args)
    step_sends = [s for k, s in sends[-out["calls"]:] if k == "step"] or [s for _, s in sends]
    leader.send("stop")
    out.update(send_us=1e6 * statistics.median(step_sends), bytes_per_call=leader.bytes_sent / max(len(sends), 1),
               broadcast_ms=broadcast_cost(llm, args.broadcast_reps))
    leader.close()
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--model", str(args.model), "--requests", str(args.requests), "--prompt-len",
           str(args.prompt_len), "--output-len", str(args.output_len), "--broadcast-reps", str(args.broadcast_reps)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.Popen(cmd + extra, stdout=subprocess.PIPE, text=True, env=dict(env, JAX_PLATFORMS="cpu"),
                            cwd=ROOT)


def result_of(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"worker failed ({proc.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def drive(args) -> None:
    if not (Path(args.model) / "config.json").exists():
        build_model(Path(args.model))
    rounds = []
    for r in range(args.rounds):
        single = result_of(spawn(args, ["--run", "single"]))
        coord, step = f"127.0.0.1:{free_port()}", free_port()
        procs = [spawn(args, ["--run", "group", "--coordinator", coord, "--step-port", str(step), "--process-id", str(i)])
                 for i in (1, 0)]
        group = result_of(procs[1])
        result_of(procs[0])
        same = single.pop("tokens") == group.pop("tokens")
        rounds.append({"single": single, "group": group, "same_tokens": same})
        print(f"round {r}: 1x8 decode {single['decode_step_ms']:.2f} ms, prefill {single['prefill_step_ms']:.2f} ms | "
              f"2x4 decode {group['decode_step_ms']:.2f} ms, prefill {group['prefill_step_ms']:.2f} ms | "
              f"send {group['send_us']:.0f} us ({group['bytes_per_call']:.0f} B/call), "
              f"broadcast_one_to_all {group['broadcast_ms']:.2f} ms | same tokens {same}", flush=True)
    med = lambda side, key: statistics.median(x[side][key] for x in rounds)  # noqa: E731
    ratio = lambda key: statistics.median(x["group"][key] / x["single"][key] for x in rounds)  # noqa: E731
    summary = {"decode_ratio_2x4_over_1x8": ratio("decode_step_ms"), "prefill_ratio_2x4_over_1x8": ratio("prefill_step_ms"),
               "decode_ms_1x8": med("single", "decode_step_ms"), "decode_ms_2x4": med("group", "decode_step_ms"),
               "prefill_ms_1x8": med("single", "prefill_step_ms"), "prefill_ms_2x4": med("group", "prefill_step_ms"),
               "send_us": med("group", "send_us"), "broadcast_one_to_all_ms": med("group", "broadcast_ms"),
               "bytes_per_call": med("group", "bytes_per_call")}
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "rounds": rounds, "args": vars(args)}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(Path.home() / ".cache/jaxserve/bench/multihost_moe"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--broadcast-reps", type=int, default=50)
    p.add_argument("--json", default=None)
    p.add_argument("--run", choices=["single", "group"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    p.add_argument("--step-port", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run is None:
        return drive(args)
    out = run_single(args) if args.run == "single" else run_group(args)
    if out is not None:
        print(json.dumps(out))
    else:
        print("{}")


if __name__ == "__main__":
    main()
