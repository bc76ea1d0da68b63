"""GetModelInfo's formats come from what the engine really runs: each phase's weight format
(prefill reading the decode copy included), the loaded dtype, and the one KV pool's format."""
import pytest

from tests.hf_models import build_llama
from jaxserve import LLM
from jaxserve.server.convert import model_info

KW = dict(num_pages=8, page_size=8, max_num_seqs=2, max_model_len=32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("info_llama")
    build_llama(path, seed=2)
    return str(path)


@pytest.mark.parametrize("engine,want", [
    (dict(), ("float32", "float32")),  # as loaded: the loaded dtype
    (dict(prefill_weights="bf16", decode_weights="int8"), ("bf16", "int8")),
    (dict(decode_weights="int8", prefill_from_decode_weights=True), ("int8", "int8")),  # prefill reads decode's copy
])
def test_phase_formats_are_what_runs(tiny, engine, want):
    llm = LLM(tiny, dtype="float32", kv_format="fp8_e4m3", **KW, **engine)
    info = model_info(llm, max_waiting=4, replica_id="r")
    assert info.dtype == "float32"
    assert (info.prefill.weights, info.decode.weights) == want
    assert info.prefill.kv_cache == info.decode.kv_cache == "fp8_e4m3"
    for phase, w in zip((info.prefill, info.decode), want):
        assert phase.matmul_path.startswith("as loaded ->" if w == "float32" else f"{w} ->")
