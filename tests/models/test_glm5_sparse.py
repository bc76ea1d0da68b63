"""GLM-5's sparse attention (DSA) on each backend, past index_topk: the Pallas backend's sparse
kernel (interpreted) against the XLA path and transformers, the XLA path's two forms (decode's
gather of the chosen rows, prefill's masked blocks) against each other, and the Pallas decode
and prefill programs on 8 devices lowered for CUDA with the sparse Triton kernel."""
import numpy as np
import pytest

from tests.hf_models import build_glm_moe_dsa, paged_decode_logits, torch_logprobs as ref_logprobs
from jaxserve import LLM
from jaxserve.kv.formats import get_kv_format

PROMPT = [int(x) for x in np.random.RandomState(0).randint(2, 256, size=40)]  # 5x index_topk


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm5_sparse")
    return path, build_glm_moe_dsa(path)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt[0]), dtype="float32", kv_format="float32", num_pages=64, page_size=8)


@pytest.mark.parametrize("kv_format,bound", [("float32", 1e-4), ("bf16", 2e-3)])
def test_pallas_backend_sparse_matches_xla(ckpt, llm, kv_format, bound):
    """Past index_topk the Pallas backend (interpreted) feeds each query's chosen slots to its
    sparse kernel: prefill log-probs and paged decode steps (page table 4x index_topk) equal
    the XLA path's (decode: its gather of the chosen rows; prefill: its masked blocks)."""
    kw = dict(dtype="float32", kv_format=kv_format, num_pages=64, page_size=8)
    pallas = LLM(str(ckpt[0]), attention_backend="pallas_interpret", **kw)
    xla = llm if kv_format == "float32" else LLM(str(ckpt[0]), **kw)
    lp = pallas.logprobs(PROMPT)
    err = np.abs(lp - xla.logprobs(PROMPT)).max()
    prompt, cont = PROMPT[:12], PROMPT[12:22]
    dec = paged_decode_logits(pallas, prompt, cont)
    dec_err = np.abs(dec - paged_decode_logits(xla, prompt, cont)).max()
    print(f"pallas_interpret vs xla, kv={kv_format}: prefill {err:.2e}, decode logits {dec_err:.2e}")
    assert err <= bound and dec_err <= bound
    if kv_format == "float32":
        assert np.abs(lp - ref_logprobs(ckpt[1], PROMPT)).max() <= 1e-4


def target_h200_mesh(n: int):
    """Newer jax reads the target GPU from an abstract mesh (an H200 here) when lowering for CUDA
    on a host without one; shard_map needs its shape to be the model's mesh. Older: nothing."""
    import contextlib

    import jax

    from jaxserve.sharding import MODEL_AXIS

    if not hasattr(jax.sharding, "AbstractDevice"):
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((n,), (MODEL_AXIS,), abstract_device=device))


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_e4m3"])
def test_sparse_decode_on_eight_devices_lowers_for_cuda(ckpt, kv_format):
    """GLM-5 on the Pallas backend over 8 devices, page table wider than index_topk: the decode
    and prefill programs lower for CUDA with the sparse Triton kernel per device (the heads
    split by shard_map), and the dense paged kernel nowhere (no GPU needed)."""
    import re

    llm = LLM(str(ckpt[0]), kv_format=kv_format, num_devices=8, attention_backend="pallas", num_pages=16,
              page_size=16, max_num_seqs=4, max_model_len=64)
    assert llm.runner.max_pages_per_seq * 16 > llm.cfg.index_topk
    for phase, tokens in (("decode", 1), ("prefill", 16)):
        with target_h200_mesh(8):
            text = llm.runner.lower(phase, 4, tokens=tokens, platform="cuda").as_text()
        names = set(re.findall(r'name = "(\w+)"', text))
        assert "__gpu$xla.gpu.triton" in text and "mosaic_gpu" not in text
        assert any(n.startswith("sparse_mla_") for n in names), sorted(names)
        assert not any(n.startswith("paged_mla_") for n in names), sorted(names)
        assert "manual_computation" in text or "{manual}" in text


def test_sparse_gather_equals_masked_blocks():
    """The XLA path's two forms of sparse MLA over the same pages: the gather of each query's
    chosen rows (decode) and the chosen-slot mask over position blocks (prefill), rows of
    unequal length over non-contiguous pages, picks of -1 (on a NaN page), fp8 pages."""
    import jax.numpy as jnp

    from jaxserve.models.attention import mla_attention_paged, mla_attention_selected, selection_mask

    rng = np.random.RandomState(3)
    b, t, h, r, dr, s, k = 2, 2, 4, 16, 8, 4, 6
    fmt = get_kv_format("fp8_e4m3")
    table = np.array([[5, 2, 9, 1, 7], [3, 8, 4, 6, 10]], np.int32)
    cached, new = np.array([9, 17], np.int32), np.array([2, 1], np.int32)
    pools = {}
    for name, width in (("latent", r), ("rope", dr)):
        q, sc = fmt.quantize(jnp.asarray(rng.randn(12, s, width).astype(np.float32)))
        pools[name], pools[name + "_scale"] = q, sc
    in_table = np.isin(np.arange(12), table)[:, None]  # the mask form reads whole pages of the table
    pools["latent_scale"] = jnp.where(jnp.asarray(in_table), pools["latent_scale"], jnp.nan)  # a -1 pick reads page 0
    select = np.full((b, t, k), -1, np.int32)
    for row in range(b):
        for i in range(int(new[row])):
            vis = int(cached[row]) + i + 1
            select[row, i, : min(k, vis)] = rng.permutation(vis)[:k]
    q_lat = jnp.asarray(rng.randn(b, t, h, r), jnp.float32)
    q_rope = jnp.asarray(rng.randn(b, t, h, dr), jnp.float32)
    args = (q_lat, q_rope, pools, fmt, jnp.asarray(table))
    got = np.asarray(mla_attention_selected(*args, jnp.asarray(select), 0.3, s))
    want = np.asarray(mla_attention_paged(*args, jnp.asarray(cached), jnp.asarray(new), 0.3, s, chunk_tokens=4,
                                          select=selection_mask(jnp.asarray(select), table.shape[1] * s)))
    assert np.isfinite(got).all()
    real = np.arange(t)[None, :] < new[:, None]
    np.testing.assert_allclose(got[real], want[real], atol=1e-5, rtol=1e-5)
    assert (got[~real] == 0).all()
