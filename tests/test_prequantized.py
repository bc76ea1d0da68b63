"""Pre-quantized Hugging Face checkpoints load in their quantized form.

The test quantizes a tiny random DeepseekV3 (Kimi K2 / DeepSeek-V3 architecture) the way
each format specifies, written here from the format's own definition and independent of
jaxserve's code:
- FP8 block-scaled, as DeepSeek-V3 / GLM FP8 ship (DeepSeek-V3 inference/kernel.py,
  weight_quant / weight_dequant): per 128x128 block of the [out, in] weight,
  s = amax / 448, weight = e4m3(w / s), weight_scale_inv = s, w ~= weight * s. Every Linear
  is FP8; embed, lm_head, norms and the router gate stay unquantized.
- compressed-tensors pack-quantized W4A16, as Kimi K2 ships (compressed_tensors
  calculate_qparams / pack_to_int32): symmetric groups of 32 inputs, scale = amax / 7.5
  (stored bf16), q = round(clamp(w / scale, -8, 7)); q + 8 packed eight to an int32 along
  the input dim, first column in the lowest nibble. Only routed experts are int4.
The reference is transformers on the dequantized weights, saved as a plain checkpoint.
"""
import json
import re
import shutil

import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file, save_file

from tests.hf_models import build_deepseek_v3
from jaxserve import LLM
from jaxserve.config import ConfigError
from jaxserve.loader import CheckpointError, load_config, load_model
from jaxserve.quant.phase import PhaseWeight, quantize_state, state_nbytes

IDS = [5, 17, 99, 3, 250, 42, 7, 8, 9, 10, 11, 200, 13, 60]
KW = dict(kv_format="float32", num_pages=16, page_size=8)

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
CT_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                              "group_size": 32, "actorder": None, "dynamic": False}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None,
}


# ----------------------------------------------------------------------------- the formats, from their specs


def fp8_block_quantize(w: torch.Tensor, b: int = 128):
    """[out, in] -> (e4m3 weight, float32 weight_scale_inv [ceil(out/b), ceil(in/b)], dequantized)."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    s = torch.empty(-(-n // b), -(-k // b), dtype=torch.float32)
    deq = torch.empty(n, k, dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * b:(i + 1) * b, j * b:(j + 1) * b].float()
            sc = blk.abs().max() / 448.0
            qb = (blk / sc).to(torch.float8_e4m3fn)
            q[i * b:(i + 1) * b, j * b:(j + 1) * b] = qb
            s[i, j] = sc
            deq[i * b:(i + 1) * b, j * b:(j + 1) * b] = qb.float() * sc
    return q, s, deq


def ct_int4_quantize(w: torch.Tensor, group: int = 32):
    """[out, in] -> (q int8 [out, in], weight_scale bf16 [out, in/group], dequantized float32)."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    scale = (g.abs().amax(-1) / 7.5).to(torch.bfloat16)  # symmetric: amax / (bit_range / 2), bit_range = 15
    q = torch.round(torch.clamp(g / scale.float()[..., None], -8, 7)).to(torch.int8)
    deq = (q.float() * scale.float()[..., None]).reshape(n, k)
    return q.reshape(n, k), scale, deq


def ct_pack_int32(q: torch.Tensor) -> torch.Tensor:
    """pack_to_int32(q, num_bits=4, packed_dim=1): q + 8, eight per int32, column 8j+i at bits 4i."""
    u = q.to(torch.int64) + 8
    u = torch.nn.functional.pad(u, (0, (-u.shape[1]) % 8)).reshape(u.shape[0], -1, 8)
    packed = (u << (4 * torch.arange(8, dtype=torch.int64))).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # the int32 bit pattern


LINEAR = re.compile(r"(_proj|_proj_with_mqa)\.weight$")


INT4_SCOPE = re.compile(r"\.mlp\.experts\.")  # what Kimi K2 ships in int4


def make_prequantized(base, dst, kind: str, linear=LINEAR, int4_scope=INT4_SCOPE, ct_config=CT_CONFIG):
    """Quantize `base`'s checkpoint into `dst`; the dequantized weights go to dst.parent/<name>_ref.
    fp8: every Linear `linear` matches; int4: those of them `int4_scope` also matches."""
    tensors = load_file(base / "model.safetensors")
    out, plain = {}, {}
    for name, w in tensors.items():
        quantize = linear.search(name) and (kind == "fp8" or int4_scope.search(name))
        if not quantize:
            out[name] = plain[name] = w
            continue
        stem = name[: -len(".weight")]
        if kind == "fp8":
            q, s, plain[name] = fp8_block_quantize(w)
            out[name], out[stem + ".weight_scale_inv"] = q, s
        else:
            q, s, plain[name] = ct_int4_quantize(w)
            out[stem + ".weight_packed"] = ct_pack_int32(q)
            out[stem + ".weight_scale"] = s
            out[stem + ".weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int32)
    raw = json.loads((base / "config.json").read_text())
    ref = dst.parent / (dst.name + "_ref")
    for d, t, qc in ((dst, out, FP8_CONFIG if kind == "fp8" else ct_config), (ref, plain, None)):
        d.mkdir()
        save_file(t, d / "model.safetensors", metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(dict(raw, quantization_config=qc) if qc else raw))
    return dst, ref


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("pq_base")
    build_deepseek_v3(path, num_hidden_layers=2, intermediate_size=192, seed=3)  # 192: a partial 128-block
    return path


@pytest.fixture(scope="module")
def fp8(base, tmp_path_factory):
    return make_prequantized(base, tmp_path_factory.mktemp("pq") / "fp8", "fp8")


@pytest.fixture(scope="module")
def int4(base, tmp_path_factory):
    return make_prequantized(base, tmp_path_factory.mktemp("pq") / "int4", "int4")


def ref_logprobs(ref_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([IDS])).logits[0].float(), -1).numpy()


def flat_values(model):
    _, state = nnx.split(model)
    return {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)}


# ----------------------------------------------------------------------------- loading


@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_logprobs_match_the_dequantized_reference(kind, request, base):
    qdir, ref = request.getfixturevalue(kind)
    llm = LLM(str(qdir), **KW)
    lp = llm.logprobs(IDS)
    err = np.abs(lp - ref_logprobs(ref)).max()
    moved = np.abs(lp - ref_logprobs(base)).max()  # vs the unquantized model: quantization is visible
    print(f"{kind}: max |logprob error| vs transformers on the dequantized weights: {err:.2e} "
          f"(vs the unquantized model: {moved:.2e})")
    # The weights load exactly (tests below); the programs compute in the stored format, whose
    # CPU path rounds activations and weight tiles to bf16 (jaxserve.quant.paths): the same
    # bound as tests/models/test_quantized_programs.py, far below the quantization itself.
    assert err <= 0.04 and moved > 5 * err
    dtypes = {np.dtype(x.dtype).name for x in llm.runner.phase_params["decode"][0]}
    assert ("float8_e4m3fn" if kind == "fp8" else "uint8") in dtypes


def test_fp8_loads_as_its_own_bytes(fp8, base):
    _, model = load_model(fp8[0])
    vals = flat_values(model)
    tensors = load_file(fp8[0] / "model.safetensors")
    kv_a = vals["layers/1/attn/kv_a"]
    assert isinstance(kv_a, PhaseWeight) and kv_a.qw.format == "fp8:block128"
    want = tensors["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].T.contiguous()
    assert np.array_equal(np.asarray(kv_a.qw.values).view(np.uint8), want.view(torch.uint8).numpy())
    assert np.array_equal(np.asarray(kv_a.qw.scales),
                          tensors["model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].T.numpy())
    experts = vals["layers/1/mlp/w_gate"]
    assert experts.qw.format == "fp8:block128" and experts.qw.values.shape == (16, 64, 32)
    for key in ("embed", "lm_head", "layers/1/mlp/router", "norm/scale"):
        assert not isinstance(vals[key], PhaseWeight), key
    _, plain = load_model(fp8[1])
    assert state_nbytes(nnx.split(model)[1]) < 0.6 * state_nbytes(nnx.split(plain)[1])


def test_int4_repacks_exactly(int4):
    _, model = load_model(int4[0])
    vals = flat_values(model)
    w = vals["layers/1/mlp/w_up"]
    assert isinstance(w, PhaseWeight) and w.qw.format == "int4:g32" and np.dtype(w.qw.values.dtype) == np.uint8
    ref = load_file(int4[1] / "model.safetensors")
    want = np.stack([ref[f"model.layers.1.mlp.experts.{e}.up_proj.weight"].numpy().T for e in range(16)])
    assert np.array_equal(np.asarray(w.dense(np.float32)), want)  # exact: no requantization
    assert w.qw.scales.dtype == ml_dtypes.bfloat16  # kept as shipped: 0.5 + 2/32 B/param, not 0.625
    assert w.qw.nbytes == w.qw.values.size + 2 * w.qw.scales.size
    for key in ("layers/1/attn/q_b", "layers/1/mlp/shared/up", "layers/0/mlp/gate", "lm_head"):
        assert not isinstance(vals[key], PhaseWeight), key  # Kimi's ignore list keeps these
    _, plain = load_model(int4[1])
    assert state_nbytes(nnx.split(model)[1]) < 0.8 * state_nbytes(nnx.split(plain)[1])


def test_phase_formats_keep_or_convert_the_checkpoint_format(int4):
    _, model = load_model(int4[0])
    _, state = nnx.split(model)
    loaded = flat_values(model)["layers/1/mlp/w_down"]
    same = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(quantize_state(state, "int4:g32"))}
    assert same["layers/1/mlp/w_down"].qw.values is loaded.qw.values  # its own format: kept, not requantized
    assert same["layers/1/attn/q_b"].qw.format == "int4:g32"  # unquantized weights get the phase format
    assert quantize_state(state, None) is state
    other = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(quantize_state(state, "fp8:block128"))}
    assert other["layers/1/mlp/w_down"].qw.format == "fp8:block128"  # asked for another format: converted
    err = np.abs(np.asarray(other["layers/1/mlp/w_down"].dense(np.float32)) - np.asarray(loaded.dense(np.float32)))
    assert err.max() <= np.abs(np.asarray(loaded.dense(np.float32))).max() / 16


def test_sharded_load_places_quantized_leaves(fp8):
    from jaxserve.sharding import make_mesh

    _, model = load_model(fp8[0], mesh=make_mesh(8))
    experts = flat_values(model)["layers/1/mlp/w_up"]
    assert len(experts.qw.values.sharding.device_set) == 8 and not experts.qw.values.sharding.is_fully_replicated
    _, one = load_model(fp8[0])
    assert np.array_equal(np.asarray(experts.qw.values).view(np.uint8),
                          np.asarray(flat_values(one)["layers/1/mlp/w_up"].qw.values).view(np.uint8))


# ----------------------------------------------------------------------------- refusals


def rewrite(src, dst, fn):
    shutil.copytree(src, dst)
    t = load_file(dst / "model.safetensors")
    fn(t)
    save_file(t, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_missing_scale_is_an_error_naming_it(fp8, int4, tmp_path):
    name = "model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"
    path = rewrite(fp8[0], tmp_path / "a", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor.*experts\.2\.down_proj\.weight_scale_inv"):
        load_model(path)
    name = "model.layers.1.mlp.experts.5.gate_proj.weight_scale"
    path = rewrite(int4[0], tmp_path / "b", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor.*experts\.5\.gate_proj\.weight_scale"):
        load_model(path)


def test_unexpected_tensor_is_an_error_naming_it(int4, tmp_path):
    name = "model.layers.1.mlp.experts.0.up_proj.weight_zero_point"
    path = rewrite(int4[0], tmp_path / "c", lambda t: t.__setitem__(name, torch.zeros(4, dtype=torch.int32)))
    with pytest.raises(CheckpointError, match=r"unexpected.*experts\.0\.up_proj\.weight_zero_point"):
        load_model(path)


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "awq", "bits": 4}, "awq"),
    ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [64, 64]}, "weight_block_size"),
    (dict(CT_CONFIG, format="float-quantized"), "float-quantized"),
    (dict(CT_CONFIG, config_groups={"g": {"targets": ["Linear"], "weights": dict(
        CT_CONFIG["config_groups"]["group_0"]["weights"], num_bits=8)}}), "num_bits"),
])
def test_unknown_quantization_configs_are_refused(base, tmp_path, qc, match):
    shutil.copytree(base, tmp_path / "q")
    raw = json.loads((tmp_path / "q" / "config.json").read_text())
    (tmp_path / "q" / "config.json").write_text(json.dumps(dict(raw, quantization_config=qc)))
    with pytest.raises(ConfigError, match=match):
        load_config(tmp_path / "q")


def test_both_shipped_configs_are_accepted(fp8, int4):
    assert load_config(fp8[0]).architecture == load_config(int4[0]).architecture == "DeepseekV3ForCausalLM"
