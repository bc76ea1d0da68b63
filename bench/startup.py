"""Start-up time of a fresh `jaxserve serve` process: to SERVING and to the first token.

    .venv/bin/python bench/startup.py --runs cold,warm --max-num-seqs 64 [--cache-dir DIR]

Each run starts a new server process with ``--profile-startup`` (its log gives the split:
imports, weights, engine set-up, and per program and bucket cache load / trace / lower /
compile), waits for SERVING, then sends one greedy request (8 prompt tokens, 1 new token) and
stops it. ``cold`` empties the program cache first (the default model's conversion stays);
``warm`` reuses what the previous run stored; ``+sww`` (``warm+sww``) adds ``--serve-while-warming``. Reported per run: seconds from process start
to SERVING and to the first token, the process's CPU seconds (on a shared machine, wall time
moves with the load; CPU time much less), and the profile. ``--json`` writes the figures.
"""
import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_once(args, label: str, cache: Path) -> dict:
    if label.startswith("cold"):
        shutil.rmtree(cache / "programs", ignore_errors=True)
    env = dict(os.environ, JAXSERVE_CACHE_DIR=str(cache))
    cmd = [sys.executable, "-m", "jaxserve.server.cli", "serve", "--port", "0", "--metrics-port", "-1",
           "--max-num-seqs", str(args.max_num_seqs), "--drain-timeout", "2"]
    cmd += [] if args.no_profile else ["--profile-startup"]
    cmd += ["--serve-while-warming"] if label.endswith("+sww") else []
    if args.model:
        cmd += ["--model", args.model]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=args.repo, env=env)
    lines, target, serving = [], None, None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("jaxserve: SERVING on"):  # printed after the profile is logged
            serving = time.perf_counter() - t0
            target = line.split("SERVING on ")[1].split()[0]
            break
    if target is None:
        raise RuntimeError("server exited before SERVING:\n" + "".join(lines))
    from jaxserve.client import Client

    client = Client(target, timeout=120)
    client.generate([1, 2, 3, 4, 5, 6, 7, 8], max_tokens=1)
    first = time.perf_counter() - t0
    client.close()
    proc.terminate()
    proc.communicate(timeout=60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    log = "".join(lines)
    profile = log[log.find("start-up profile"):log.find("jaxserve: SERVING on")] if "start-up profile" in log else ""
    return {"run": label, "to_serving_s": round(serving, 2), "to_first_token_s": round(first, 2),
            "cpu_s_whole_process": round(cpu, 2), "profile": profile}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="cold,warm",
                    help="comma-separated: cold | warm, each optionally +sww (with --serve-while-warming)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--cache-dir", default=None, help="JAXSERVE_CACHE_DIR for the servers (default: the usual one)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--repo", default=str(REPO), help="the checkout whose server runs (another branch, for a before/after)")
    ap.add_argument("--no-profile", action="store_true", help="without --profile-startup (a server that lacks it)")
    args = ap.parse_args()
    cache = Path(args.cache_dir or os.environ.get("JAXSERVE_CACHE_DIR") or Path.home() / ".cache" / "jaxserve")
    results = []
    for label in args.runs.split(","):
        r = run_once(args, label, cache)
        results.append(r)
        print(f"{label}: SERVING after {r['to_serving_s']} s, first token after {r['to_first_token_s']} s, "
              f"{r['cpu_s_whole_process']} CPU s (load average {os.getloadavg()[0]:.1f})", flush=True)
        print(r["profile"], flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
