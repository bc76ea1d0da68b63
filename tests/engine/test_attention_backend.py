"""The attention backend switch: Pallas kernels (interpreted on CPU) vs the XLA path."""
import numpy as np
import pytest

from tests.hf_models import build_glm4_moe
from jaxserve import LLM
from jaxserve.engine.sampling_params import SamplingParams

PROMPTS = [[int(x) for x in np.random.RandomState(4).randint(2, 256, size=n)] for n in (9, 21, 14)]
SP = SamplingParams(max_tokens=8, ignore_eos=True)
KW = dict(num_pages=32, page_size=8, max_num_seqs=4, max_model_len=64)


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_e4m3"])
def test_mla_pallas_interpret_matches_xla(tiny_ckpt, kv_format):
    xla = LLM(tiny_ckpt, kv_format=kv_format, attention_backend="xla", **KW)
    pal = LLM(tiny_ckpt, kv_format=kv_format, attention_backend="pallas_interpret", **KW)
    assert [list(c) for c in pal.generate(PROMPTS, SP)] == [list(c) for c in xla.generate(PROMPTS, SP)]


def test_gqa_pallas_interpret_matches_xla(tmp_path):
    build_glm4_moe(tmp_path, num_hidden_layers=2)
    xla = LLM(str(tmp_path), kv_format="bf16", attention_backend="xla", **KW)
    pal = LLM(str(tmp_path), kv_format="bf16", attention_backend="pallas_interpret", **KW)
    assert [list(c) for c in pal.generate(PROMPTS, SP)] == [list(c) for c in xla.generate(PROMPTS, SP)]


def test_backend_is_validated(tiny_ckpt):
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(tiny_ckpt, attention_backend="cuda_magic", **KW)


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_e4m3"])
def test_engine_decode_program_lowers_for_cuda_with_pallas(tiny_ckpt, kv_format):
    """The whole decode program the engine would run on a GPU (tracker check, MLA kernel,
    int4 decode weights) lowers for CUDA, so a GPU-breaking change fails here without a GPU."""
    import jax
    import jax.numpy as jnp

    from jaxserve.step_batch import StepBatch

    llm = LLM(tiny_ckpt, kv_format=kv_format, attention_backend="pallas", decode_weights="int4:g32", **KW)
    r = llm.runner
    b, m = 4, r.max_pages_per_seq
    z, zm = jnp.zeros((b,), jnp.int32), jnp.zeros((b, m), jnp.int32)
    batch = StepBatch(jnp.zeros((b, 1), jnp.int32), z, z, zm, zm, z, phase="decode")
    lowered = r.step_programs.checked("decode").trace(
        r.phase_params["decode"][0], r.kv, r.generation, batch
    ).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "triton" in text.lower()


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_e4m3"])
def test_gqa_native_matches_xla(tmp_path, kv_format):
    """The native backend's steps (decode and prefill chunks, all on the kernel) give the XLA
    backend's greedy tokens; its decode programs and its prefill programs of short and long
    chunks hold the kernel call, and the XLA backend's do not."""
    from jaxserve import native

    if not native.available():
        pytest.skip(f"native kernels: {native.status().reason}")
    build_glm4_moe(tmp_path, num_hidden_layers=2)
    xla = LLM(str(tmp_path), kv_format=kv_format, attention_backend="xla", **KW)
    nat = LLM(str(tmp_path), kv_format=kv_format, attention_backend="native", **KW)
    assert [list(c) for c in nat.generate(PROMPTS, SP)] == [list(c) for c in xla.generate(PROMPTS, SP)]
    assert "jaxserve_gqa_paged" in nat.runner.lower("decode", 4, tokens=1).as_text()
    assert "jaxserve_gqa_paged" in nat.runner.lower("prefill", 4, tokens=16).as_text()
    assert "jaxserve_gqa_paged" in nat.runner.lower("prefill", 4, tokens=32).as_text()
    assert "jaxserve_gqa_paged" not in xla.runner.lower("prefill", 4, tokens=32).as_text()


def test_default_backend_is_native_on_cpu_where_the_kernels_load(monkeypatch):
    from jaxserve import native
    from jaxserve.models import attention_backends

    assert attention_backends.default_backend() == ("native" if native.available() else "xla")
    monkeypatch.setattr(native, "available", lambda: False)  # a machine without the library
    assert attention_backends.default_backend() == "xla"
    # a named "native" backend without the kernels runs the XLA path, it does not fail
    backend = attention_backends.get_backend("native")
    assert backend.kernel_devices(2, 8) is None
