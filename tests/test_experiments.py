"""jaxserve experiment: small configurations of each subcommand on a tiny Llama, the bootstrap
code on synthetic data with known answers, and the JSON / markdown / PNG outputs."""
import json
import subprocess
import sys

import numpy as np
import pytest

from jaxserve.experiments import stats

# ---------------------------------------------------------------- bootstrap (scipy)


def test_mean_ci_point_and_width():
    rng = np.random.default_rng(1)
    x = rng.normal(3.0, 1.0, 400)
    ci = stats.mean_ci(x, n_boot=2000, seed=0)
    assert ci.point == pytest.approx(x.mean())
    assert ci.lo < x.mean() < ci.hi
    # Normal theory: half-width 1.96 * s / sqrt(n).
    assert (ci.hi - ci.lo) / 2 == pytest.approx(1.96 * x.std(ddof=1) / 20, rel=0.15)
    assert ci.n_units == 400 and ci.n_boot == 2000


def test_mean_ci_coverage_on_skewed_data():
    """95% intervals cover the true mean about 95% of the time (exponential, mean 1)."""
    rng = np.random.default_rng(2)
    covered = 0
    trials = 200
    for i in range(trials):
        ci = stats.mean_ci(rng.exponential(1.0, 60), n_boot=400, seed=i)
        covered += ci.lo <= 1.0 <= ci.hi
    assert 0.88 <= covered / trials <= 0.99


def test_ratio_and_paired_difference_known_answers():
    rng = np.random.default_rng(3)
    den = rng.integers(5, 50, 30).astype(float)
    num = den * 2.0  # every unit has ratio exactly 2
    ci = stats.ratio_ci(num, den, n_boot=500)
    assert (ci.point, ci.lo, ci.hi) == pytest.approx((2.0, 2.0, 2.0))
    # exp(mean NLL) of a constant NLL is exact; a constant shift of the NLL gives a fixed ratio.
    nll_b = den * 1.0
    nll_a = nll_b + 0.1 * den
    d = stats.paired_ratio_diff_ci(nll_a, nll_b, den, n_boot=500, transform=np.exp)
    assert (d.point, d.lo, d.hi) == pytest.approx((np.exp(1.1) - np.e,) * 3)
    # Pairing removes unit-to-unit variation that an unpaired interval would carry.
    noise = rng.normal(0, 5, 30) * den
    paired = stats.paired_ratio_diff_ci(nll_b + noise + 0.1 * den, nll_b + noise, den, n_boot=500)
    assert paired.point == pytest.approx(0.1) and paired.hi - paired.lo < 1e-9
    # ratio with unit denominators is the mean, with the same draws
    x = rng.normal(size=30)
    assert stats.ratio_ci(x, np.ones(30), seed=4).as_dict() == stats.mean_ci(x, seed=4).as_dict()


def _numpy_percentile_bootstrap(cols, statistic, n_boot, seed, level=0.95):
    """Independent reference: draw unit indices with numpy, take the percentile interval."""
    rng = np.random.default_rng(seed)
    n = len(cols[0])
    reps = [statistic(*(c[idx] for c in cols)) for idx in rng.integers(0, n, (n_boot, n))]
    alpha = (1 - level) / 2
    return np.percentile(reps, [100 * alpha, 100 * (1 - alpha)])


def test_intervals_agree_with_an_independent_numpy_bootstrap():
    """Other draws, same definition: the percentile intervals agree within Monte Carlo noise."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=80)
    lo, hi = _numpy_percentile_bootstrap((x,), np.mean, 8000, seed=11)
    for ci in (stats.mean_ci(x, n_boot=8000), stats.bootstrap_ci(x, np.mean, n_boot=8000, seed=1)):
        assert ci.point == pytest.approx(x.mean())
        assert (ci.lo, ci.hi) == pytest.approx((lo, hi), abs=0.02)
    # perplexity-style ratio and paired difference at the 90% level
    den = rng.integers(5, 50, 40).astype(float)
    a, b = den * rng.gamma(2.0, 0.5, 40), den * rng.gamma(2.0, 0.5, 40)
    lo, hi = _numpy_percentile_bootstrap((a, den), lambda n, d: np.exp(n.sum() / d.sum()), 8000, 12, 0.9)
    ci = stats.ratio_ci(a, den, n_boot=8000, level=0.9, transform=np.exp)
    assert ci.point == pytest.approx(np.exp(a.sum() / den.sum()))
    assert (ci.lo, ci.hi) == pytest.approx((lo, hi), rel=0.01)
    lo, hi = _numpy_percentile_bootstrap((a, b, den), lambda p, q, d: (p.sum() - q.sum()) / d.sum(), 8000, 13)
    d = stats.paired_ratio_diff_ci(a, b, den, n_boot=8000)
    assert (d.lo, d.hi) == pytest.approx((lo, hi), abs=0.01)
    # explicit replicate counts: the interval of exactly those replicates
    w = stats.resample_weights(40, 500, seed=3)
    ci = stats.ratio_ci(a, den, weights=w)
    assert (ci.lo, ci.hi) == pytest.approx(tuple(np.percentile((w @ a) / (w @ den), [2.5, 97.5])))
    # seeded: the same seed gives the same interval, another seed another one
    assert stats.mean_ci(x, seed=7) == stats.mean_ci(x, seed=7) != stats.mean_ci(x, seed=8)
    one = stats.mean_ci([2.5])
    assert (one.point, one.lo, one.hi, one.n_units) == (2.5, 2.5, 2.5, 1)
    with pytest.raises(ValueError):
        stats.mean_ci([])


def test_cli_help_and_sizes():
    from jaxserve.experiments.cli import parse_size, register

    assert parse_size("6.5MB") == 6_500_000 and parse_size("4KiB") == 4096 and parse_size("12") == 12
    import argparse

    p = argparse.ArgumentParser()
    register(p.add_subparsers(dest="command"))
    a = p.parse_args(["experiment", "capacity", "--kv-budget", "1MiB", "--levels", "1,2"])
    assert a.kv_budget == 2**20 and a.levels == [1, 2] and callable(a.func)
    a = p.parse_args(["experiment", "quality", "--configs", "x=fp8_e4m3/none/int4:g32"])
    assert a.configs == ["x=fp8_e4m3/none/int4:g32"]
    out = subprocess.run([sys.executable, "-m", "jaxserve.experiments", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "capacity" in out.stdout and "quality" in out.stdout


def test_cli_engine_flags(capsys):
    """The engine flags serve and generate take reach the experiments; a sweep refuses the ones it sets."""
    from jaxserve.experiments.cli import _engine_kw, build_parser, main

    p = build_parser()
    a = p.parse_args(["capacity", "--preset", "article", "--decode-weights", "int8", "--attention-backend", "xla",
                      "--kv-cache-memory", "4MiB"])
    assert a.kv_budget == 4 * 2**20
    assert _engine_kw(a) == {"preset": "article", "decode_weights": "int8", "attention_backend": "xla"}
    a = p.parse_args(["weights", "--memory-fraction", "0.01", "--matmul-backend", "cpu"])
    assert _engine_kw(a) == {"memory_fraction": 0.01, "matmul_backend": "cpu"}
    assert main(["weights", "--decode-weights", "int8"]) == 2
    assert "sweeps the weight formats" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # quality sizes its pages for the documents: no budget flags
        p.parse_args(["quality", "--kv-cache-memory", "1MiB"])


# ---------------------------------------------------------------- experiments on a tiny model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.hf_models import build_llama

    path = tmp_path_factory.mktemp("exp_llama")
    # head_dim 32, one KV head: fp8 pages (values + f32 scales) are 72/128 of bf16 pages.
    build_llama(path, seed=7, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    return str(path)


def _files_exist(result, kinds):
    """The outputs exist; PNGs only when matplotlib is installed (JSON and markdown always)."""
    import importlib.util
    from pathlib import Path

    if importlib.util.find_spec("matplotlib") is None:
        kinds = [k for k in kinds if not k.startswith("png")]
    for k in kinds:
        assert Path(result["files"][k]).stat().st_size > 0, k
    data = json.loads(Path(result["files"]["json"]).read_text())
    md = Path(result["files"]["markdown"]).read_text()
    assert data["meta"]["machine"]["nproc"] >= 1 and data["meta"]["machine"]["jax_version"]
    assert "command:" in md and "jax" in md and "date" in md
    return data, md


def test_capacity_tiny(tiny_llama, tmp_path):
    from jaxserve.experiments import capacity, common

    bpp = {f: common.kv_bytes_per_page(tiny_llama, f, 16) for f in ("bf16", "fp8_e4m3")}
    budget = 2 * bpp["bf16"] + 100  # bf16: 2 pages (1 request + the null page); fp8: 3 pages (2 requests)
    r = capacity.run(tiny_llama, budget, levels=None, max_concurrency=8, prompt_len=8, max_tokens=6, reps=1,
                     out_dir=tmp_path, log=lambda *a: None, engine_kw={"decode_weights": "int8"})
    data, md = _files_exist(r, ["json", "markdown", "png"])
    f = data["formats"]
    assert f["bf16"]["num_pages"] == budget // bpp["bf16"] == 2 and f["fp8_e4m3"]["num_pages"] == 3
    assert f["bf16"]["kv_bytes_held"] <= budget and f["fp8_e4m3"]["kv_bytes_held"] <= budget
    assert f["bf16"]["weight_formats"]["decode"] == f["fp8_e4m3"]["weight_formats"]["decode"] == "int8"
    per = data["summary"]["per_format"]
    assert per["bf16"]["highest_concurrency_without_preemption"] == 1
    assert per["fp8_e4m3"]["highest_concurrency_without_preemption"] == 2
    assert per["fp8_e4m3"]["highest_admitted_concurrency"] >= 2
    levels = {fmt: sorted(t["concurrency"] for t in data["summary"]["table"] if t["kv_format"] == fmt) for fmt in f}
    assert levels == {"bf16": [1, 2], "fp8_e4m3": [1, 2, 4]}  # each run until it runs out
    last = {t["kv_format"]: t for t in data["summary"]["table"] if t["concurrency"] == levels[t["kv_format"]][-1]}
    assert not last["bf16"]["fits"] and not last["fp8_e4m3"]["fits"]
    assert all(x["compiles"] == 0 for x in data["runs"])  # the warm-up compiled every timed shape
    assert all(x["decode_tok_s"] > 0 for x in data["runs"])
    assert "out of KV" in md and "fp8_e4m3" in md


def test_weights_tiny(tiny_llama, tmp_path):
    from jaxserve.experiments import weights

    cfgs = ["int4=int4:g32/int4:g32", "phase-aware=fp8:block128/int4:g32"]
    r = weights.run(tiny_llama, cfgs, levels=(2,), prompt_len=16, max_tokens=4, reps=1, out_dir=tmp_path,
                    plots=False, log=lambda *a: None)
    data, md = _files_exist(r, ["json", "markdown"])
    assert data["configs"]["int4"]["int4_prefill_emulated"]
    assert not data["configs"]["phase-aware"]["int4_prefill_emulated"]
    wb = data["configs"]
    # The emulated int4 prefill reads the int4 representation (smaller than the fp8 one).
    assert wb["int4"]["weight_bytes"]["prefill"] == wb["int4"]["weight_bytes"]["decode"]
    assert wb["int4"]["weight_bytes"]["prefill"] < wb["phase-aware"]["weight_bytes"]["prefill"]
    assert wb["phase-aware"]["weight_bytes"]["decode"] < wb["phase-aware"]["weight_bytes"]["prefill"]
    for t in data["summary"]["table"]:
        assert t["decode_c2"] > 0 and t["prefill_c2"] > 0
    assert "(emulated)" in md
    with pytest.raises(ValueError, match="NAME=PREFILL/DECODE"):
        weights.parse_config("int4")


def test_quality_tiny(tiny_llama, tmp_path, monkeypatch):
    from jaxserve.experiments import quality

    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    small = dict(docs=6, prefix=32, cont=8, chunk=16, sample_prompts=2, seeds=2, sample_tokens=4, n_boot=200,
                 out_dir=tmp_path, log=lambda *a: None)
    r = quality.run(tiny_llama, ["kv-fp8=fp8_e4m3/none/none"], **small)
    data, md = _files_exist(r, ["json", "markdown", "png", "png_positions"])
    assert data["reference_check"]["max_abs_logprob_diff_vs_full_forward"] < 1e-4
    res = data["results"]
    assert set(res) == {"float32", "kv-fp8"}
    # The reference drawn twice with the same seeds samples the same completions (the sampler is
    # seeded per row); with other seeds, not (a sampler that ignored its seeds would give 1.0).
    assert res["float32"]["sampling"]["identical_rate"]["point"] == 1.0
    assert res["float32"]["sampling_other_seeds"]["identical_rate"]["point"] < 1.0
    assert "KL(ref, fmt)" in md and "identical completions" in md
    # --resume merges another configuration into the same results, reusing the cached reference.
    assert list((tmp_path / "cache" / "experiments").glob("quality-ref-*.npz"))
    r2 = quality.run(tiny_llama, ["w-int4=float32/none/int4:g32", "head-bf16=float32/none/none/bf16"], resume=True,
                     plots=False, **small)
    assert set(r2["results"]) == {"float32", "kv-fp8", "w-int4", "head-bf16"}
    head = r2["results"]["head-bf16"]  # the tied head stored in bf16 (both phases read it): both move, a little
    assert head["spec"].endswith("/bf16") and head["tied_head"] == "bf16"
    assert 0 < head["phases"]["prefill"]["kl"]["point"] < 0.05 and 0 < head["phases"]["decode"]["kl"]["point"] < 0.05
    assert r2["results"]["kv-fp8"] == json.loads(json.dumps(res["kv-fp8"]))
    kv, w4 = res["kv-fp8"], r2["results"]["w-int4"]
    # int4 decode weights: the prefill phase (float32 weights and KV) is exactly the reference.
    assert w4["phases"]["prefill"]["kl"]["point"] == 0.0 and w4["phases"]["prefill"]["top1_agreement"]["point"] == 1.0
    assert w4["phases"]["decode"]["kl"]["point"] > 0
    # fp8 KV: every position attends to K/V as the pages store them, its own chunk's too, so
    # both prefill chunks and decode move away from the reference.
    pos = np.array(kv["kl_by_position"])
    assert pos[:16].mean() > 0 and pos[16:32].mean() > 0 and pos[32:].mean() > 0
    for r_ in (kv, w4):
        for ph in ("prefill", "decode", "all"):
            ci = r_["phases"][ph]["kl"]
            assert ci["lo"] <= ci["point"] <= ci["hi"]
        s = r_["sampling"]
        assert s["completions"] == 4 and 0 <= s["identical_rate"]["point"] <= 1
