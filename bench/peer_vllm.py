"""vLLM's CPU build as a bench/peers.py engine, both sides: ``Vllm`` (imported by bench/peers.py)
starts this file under vLLM's own venv (its torch pins differ from jaxserve's), which loads the
model and then answers one JSON line per call.

    VENV/bin/python bench/peer_vllm.py MODEL_DIR DTYPE MAX_BATCH MAX_LEN      (what Vllm runs)
    stdin:  {"prompts": [[ids], ...], "n": N}      one line per call; EOF ends it
    stdout: {"dt": s, "first": s | null, "outputs": [[ids], ...]}   (or {"error": text})

Greedy, EOS ignored, exactly N new tokens per request, all requests in one ``LLM.generate``. For
one request ``first`` is the time of the same call with one new token (vLLM's offline API does
not stream), so bench/peers.py's decode rate is (N - 1) / (dt - first). Only the standard library
and vLLM are imported here: this file never imports jaxserve. Set up the venv with
``bash bench/setup_vllm_cpu.sh``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

VLLM_PYTHON_ENV = "JAXSERVE_VLLM_PYTHON"  # the python of vLLM's venv (bench/peers.py sets it)


class Vllm:
    """The bench/peers.py side: this file run by ``$JAXSERVE_VLLM_PYTHON`` as a child process."""

    def __init__(self, model_dir: str, dtype: str, max_batch: int, max_len: int):
        self.proc = subprocess.Popen([os.environ[VLLM_PYTHON_ENV], __file__, model_dir, dtype, str(max_batch),
                                      str(max_len)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.answer()  # {"ready": seconds}

    def answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"vLLM's process ended (exit code {self.proc.wait()}); its log is above")
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(msg["error"])
        return msg

    def run(self, prompts, n):
        self.proc.stdin.write(json.dumps({"prompts": [list(map(int, p)) for p in prompts], "n": n}) + "\n")
        self.proc.stdin.flush()
        msg = self.answer()
        return msg["dt"], msg["first"], msg["outputs"]

    def close(self) -> None:
        self.proc.stdin.close()  # EOF: main() below returns and vLLM shuts down
        self.proc.wait(timeout=120)


def main(model_dir: str, dtype: str, max_batch: str, max_len: str) -> int:
    out = os.fdopen(os.dup(1), "w")  # the answers' channel; everything else written to fd 1 (vLLM and
    os.dup2(2, 1)                    # its libraries print on import) goes to stderr
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t = time.perf_counter()
    llm = LLM(model=model_dir, dtype=dtype, max_num_seqs=int(max_batch), max_model_len=int(max_len),
              enable_prefix_caching=False, seed=0)
    print(json.dumps({"ready": time.perf_counter() - t}), file=out, flush=True)

    def generate(prompts, n):
        params = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)
        t = time.perf_counter()
        res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t, [list(r.outputs[0].token_ids) for r in res]

    for line in sys.stdin:
        try:
            msg = json.loads(line)
            prompts, n = msg["prompts"], msg["n"]
            first = generate(prompts, 1)[0] if len(prompts) == 1 else None
            dt, outputs = generate(prompts, n)
            answer = {"dt": dt, "first": first, "outputs": outputs}
        except Exception:  # noqa: BLE001 - reported to bench/peers.py, which stops
            answer = {"error": traceback.format_exc()}
        print(json.dumps(answer), file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
