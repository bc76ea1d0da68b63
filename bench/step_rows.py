"""Decode step time by rows on the tiny text model (the abuse bench's model): one LLM, greedy,
20-token random prompts, 64 tokens each; ms per step = the timed generate's wall time / 64.

    python bench/step_rows.py
"""
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.server.tiny_model import build_tiny_text_model  # noqa: E402

from jaxserve import LLM  # noqa: E402
from jaxserve.engine.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    llm = LLM(build_tiny_text_model(Path(tempfile.mkdtemp()) / "tiny"), num_pages=512, page_size=16,
              kv_format="bfloat16", max_num_seqs=16)
    rng, sp = np.random.default_rng(0), SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)

    def prompts(n):
        return [[int(x) for x in rng.integers(100, 40000, 20)] for _ in range(n)]

    for rows in (1, 2, 4, 8, 16):
        llm.generate(prompts(rows), sp)  # builds this row count's programs
        t = time.perf_counter()
        llm.generate(prompts(rows), sp)
        print(f"{rows:2d} rows: {(time.perf_counter() - t) * 1000 / 64:.2f} ms/step")


if __name__ == "__main__":
    main()
