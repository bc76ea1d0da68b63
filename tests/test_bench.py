"""``jaxserve bench`` (offline serving benchmark) on a tiny Llama: the JSON report has its
keys, the counts add up, percentiles are ordered; the workload is fixed by its seed."""
import json

import pytest

from tests.hf_models import build_llama
from jaxserve.bench.measure import percentile, summary
from jaxserve.bench.offline import fitted_max_model_len, main, run_workload
from jaxserve.bench.workload import make_workload, warmup_workload

ENGINE = ["--num-pages", "48", "--page-size", "8", "--max-num-seqs", "4", "--max-prefill-seqs", "2",
          "--prefill-chunk", "32", "--max-num-batched-tokens", "64"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench_llama")
    build_llama(path, seed=3)
    return str(path)


@pytest.fixture(scope="module")
def report(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_out") / "offline.json"
    argv = ["--model", tiny_llama, *ENGINE, "--num-requests", "10", "--prompt-len", "3", "30",
            "--output-len", "1", "9", "--seed", "7", "--json", str(out), "--no-progress"]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_report_has_the_keys_and_counts_add_up(report):
    res = report["results"]
    for key in ("output_tokens_per_s", "total_tokens_per_s", "ttft_s", "itl_s", "tpot_s", "e2e_latency_s",
                "peak_kv_pages", "kv_pages_total", "preemptions", "wall_s", "compiles_during_run"):
        assert key in res, key
    assert report["config"]["num_requests"] == res["num_requests"] == 10
    assert res["finish_reasons"] == {"length": 10}  # EOS ignored: every request runs to its length
    assert res["completion_tokens"] == res["expected_completion_tokens"]
    workload = make_workload(10, (3, 30), (1, 9), 256, seed=7)
    assert res["completion_tokens"] == sum(r.max_tokens for r in workload)
    assert res["prompt_tokens"] == sum(len(r.prompt_ids) for r in workload)
    assert res["output_tokens_per_s"] == pytest.approx(res["completion_tokens"] / res["wall_s"])
    assert res["total_tokens_per_s"] > res["output_tokens_per_s"] > 0
    assert 0 < res["peak_kv_pages"] <= res["kv_pages_total"] == 47
    # At most 4 requests run at once, each needing at most ceil((30 + 9) / 8) = 5 pages: 20 of the
    # 47 pages. Nothing ever has to give way, so a preemption here would be a miscount.
    assert res["preemptions"] == 0
    for name in ("ttft_s", "itl_s", "tpot_s", "e2e_latency_s"):
        s = res[name]
        assert 0 <= s["p50"] <= s["p95"] <= s["max"], (name, s)
    assert res["ttft_s"]["p95"] <= res["e2e_latency_s"]["max"]
    # The engine's page-table width is a power of two, so warm-up compiled every serving program.
    assert "step" not in "".join(res["compiled_functions_during_run"])


def test_poisson_arrivals_and_preemption_lose_nothing(tiny_llama):
    from jaxserve import LLM

    # 13 usable pages of 8 tokens for 4 running requests of up to 40 tokens: preemption likely.
    llm = LLM(tiny_llama, num_pages=14, page_size=8, max_num_seqs=4, max_prefill_seqs=2, prefill_chunk=32,
              max_num_batched_tokens=64, max_model_len=fitted_max_model_len(40, 8))
    work = make_workload(8, (10, 30), (4, 10), 256, seed=1, request_rate=200.0)
    assert work[0].arrival == 0 and all(a.arrival <= b.arrival for a, b in zip(work, work[1:]))
    res = run_workload(llm, work, dict(temperature=0.0), progress=False)
    assert res["completion_tokens"] == sum(r.max_tokens for r in work)
    assert res["num_requests"] == 8 and res["peak_kv_pages"] <= 13
    assert res["preemptions"] == llm.engine.snapshot().preemptions
    assert llm.engine.snapshot().kv_pages_used == 0


def test_forced_preemption_is_counted(tiny_llama):
    """Two requests of 16 prompt + 9 output tokens need 4 pages of 8 each at the end: 8 pages,
    but there are 5. Both prompts (2 pages each) are admitted together, so one of them must be
    preempted while the other grows, and recomputed later: its prompt and the tokens it had
    generated are prefilled again (prefix caching is off, so nothing comes back for free)."""
    from jaxserve import LLM
    from jaxserve.bench.workload import BenchRequest

    llm = LLM(tiny_llama, num_pages=6, page_size=8, max_num_seqs=2, max_prefill_seqs=2, prefill_chunk=32,
              max_num_batched_tokens=64, max_model_len=32, enable_prefix_caching=False)
    work = [BenchRequest(list(range(20 + 16 * i, 36 + 16 * i)), 9, 0.0) for i in range(2)]
    res = run_workload(llm, work, dict(temperature=0.0), progress=False)
    assert res["completion_tokens"] == 18 and res["prompt_tokens"] == 32
    assert res["preemptions"] >= 1
    assert res["scheduled_prefill_tokens"] > res["prompt_tokens"]  # the recomputation


def test_workload_is_fixed_by_its_seed():
    a = make_workload(16, (4, 12), (2, 5), 49152, seed=3)
    assert a == make_workload(16, (4, 12), (2, 5), 49152, seed=3)
    assert a != make_workload(16, (4, 12), (2, 5), 49152, seed=4)
    assert all(4 <= len(r.prompt_ids) <= 12 and 2 <= r.max_tokens <= 5 and r.arrival == 0 for r in a)
    assert all(768 <= t < 49152 for r in a for t in r.prompt_ids)  # clear of special token ids
    warm = warmup_workload(a, 4, 49152, seed=3)
    assert [r.max_tokens for r in warm] == [1, 2, 3, 4]
    assert not {tuple(r.prompt_ids) for r in warm} & {tuple(r.prompt_ids) for r in a}
    with pytest.raises(ValueError):
        make_workload(4, (5, 3), (1, 2), 256)


def test_percentiles_and_page_fitting():
    assert percentile([], 50) is None and summary([])["p95"] is None
    assert percentile([3, 1, 2], 50) == 2 and percentile([1, 2], 95) == pytest.approx(1.95)
    # linear interpolation between order statistics, worked by hand: position 0.25 * 3 = 0.75
    assert percentile([40, 10, 30, 20], 25) == pytest.approx(17.5) and percentile([5.0], 99) == 5.0
    assert fitted_max_model_len(52, 8) == 64 and fitted_max_model_len(64, 8) == 64 and fitted_max_model_len(65, 8) == 128


def test_decode_profile_classifies_hlo_ops():
    from jaxserve.bench.decode_profile import parse_hlo_ops

    hlo = """HloModule jit_step

%fused_computation.1 (param_0: f32[2,4], param_1: f32[4,8]) -> f32[2,8] {
  %param_0 = f32[2,4]{1,0} parameter(0)
  %param_1 = f32[4,8]{1,0} parameter(1)
  ROOT %dot.1 = f32[2,8]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_computation.2 (param_0: bf16[3,8,4], param_1: s32[2,2]) -> f32[2,2,4] {
  %param_0 = bf16[3,8,4]{2,1,0} parameter(0)
  ROOT %g = f32[2,2,4]{2,1,0} gather(%param_0, %param_1), offset_dims={2}
}

ENTRY %main.9 (params_0_.1: f32[4,8], kv_0___k__.1: bf16[3,8,4], inp_page_table.1: s32[2,2]) -> f32[2,8] {
  %params_0_.1 = f32[4,8]{1,0} parameter(0)
  %kv_0___k__.1 = bf16[3,8,4]{2,1,0} parameter(1)
  %inp_page_table.1 = s32[2,2]{1,0} parameter(2)
  %wrapped_convert.3 = f32[3,8,4]{2,1,0} fusion(%kv_0___k__.1), kind=kLoop, calls=%wrapped_convert_computation.3
  %gather_fusion = f32[2,2,4]{2,1,0} fusion(%kv_0___k__.1, %inp_page_table.1), kind=kLoop, calls=%fused_computation.2
  %ynn_fusion = f32[2,8]{1,0} fusion(%x, %params_0_.1), kind=kCustom, calls=%fused_computation.1
  ROOT %exponential_fusion = f32[2,8]{1,0} fusion(%ynn_fusion), kind=kLoop, calls=%fused_computation.9
}
"""
    cats = parse_hlo_ops(hlo)
    assert cats["ynn_fusion"] == "matmul"
    assert cats["gather_fusion"] == "KV gather (page table)"
    assert cats["wrapped_convert.3"] == "KV write: whole-pool dtype converts"
    assert cats["params_0_.1"].startswith("other")
