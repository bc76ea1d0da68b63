"""ModelConfig parsing (both config.json forms) and the loader's refusal to guess."""
import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.hf_models import build_deepseek_v3
from jaxserve.config import ConfigError
from jaxserve.models import config_from_dict
from jaxserve.loader import CheckpointError, load_model

IDS = [5, 17, 99, 3, 250, 42, 7, 8, 9, 10, 11]

# The form real Kimi K2 checkpoints ship: model_type kimi_k2, rope_theta + rope_scaling{type: yarn}, torch_dtype.
LEGACY_KEYS = {
    "model_type": "kimi_k2",
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1,
    },
    "torch_dtype": "float32",
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv3_loader")
    model = build_deepseek_v3(path, num_hidden_layers=2)
    return path, model


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def legacy_config(new_form: dict) -> dict:
    raw = {k: v for k, v in new_form.items() if k not in ("rope_parameters", "dtype")}
    raw.update(LEGACY_KEYS)
    return raw


def test_both_config_forms_give_the_same_model_config(ckpt):
    new = json.loads((ckpt[0] / "config.json").read_text())
    a = config_from_dict(new)
    b = config_from_dict(legacy_config(new))
    assert a.rope == b.rope and a.rope.kind == "yarn" and a.rope.factor == 4.0
    assert a.softmax_scale == b.softmax_scale
    assert b.model_type == "kimi_k2" and b.torch_dtype == "float32"
    assert dict(vars(a), model_type=None) == dict(vars(b), model_type=None)


def test_real_style_legacy_checkpoint_loads_and_matches(ckpt, tmp_path):
    import torch
    from jaxserve import LLM

    path = copy_ckpt(ckpt[0], tmp_path / "kimi")
    raw = legacy_config(json.loads((path / "config.json").read_text()))
    (path / "config.json").write_text(json.dumps(raw))
    lp = LLM(str(path), kv_format="float32", num_pages=8, page_size=8).logprobs(IDS)  # the reference KV precision
    with torch.no_grad():
        ref = torch.log_softmax(ckpt[1](torch.tensor([IDS])).logits[0], -1).numpy()
    assert np.abs(lp - ref).max() <= 1e-4


def test_unknown_architecture_is_named():
    with pytest.raises(ConfigError, match="MysteryForCausalLM"):
        config_from_dict({"architectures": ["MysteryForCausalLM"], "model_type": "mystery"})


def test_missing_field_is_named(ckpt):
    raw = json.loads((ckpt[0] / "config.json").read_text())
    del raw["kv_lora_rank"]
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        config_from_dict(raw)


def test_unsupported_routing_is_refused(ckpt):
    raw = json.loads((ckpt[0] / "config.json").read_text())
    with pytest.raises(ConfigError, match="softmax"):
        config_from_dict(dict(raw, scoring_func="softmax"))


def rewrite_tensors(path, fn):
    f = path / "model.safetensors"
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def test_missing_tensor_is_an_error_naming_it(ckpt, tmp_path):
    path = copy_ckpt(ckpt[0], tmp_path / "missing")
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    rewrite_tensors(path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor.*experts\.3\.up_proj"):
        load_model(path)


def test_unexpected_tensor_is_an_error_naming_it(ckpt, tmp_path):
    path = copy_ckpt(ckpt[0], tmp_path / "extra")
    rewrite_tensors(path, lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight", np.zeros((4, 4), np.float32)))
    with pytest.raises(CheckpointError, match=r"unexpected.*self_attn\.k_proj"):
        load_model(path)


def test_wrong_shape_is_an_error(ckpt, tmp_path):
    path = copy_ckpt(ckpt[0], tmp_path / "shape")
    rewrite_tensors(path, lambda t: t.__setitem__("model.norm.weight", np.ones(3, np.float32)))
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        load_model(path)


def test_mtp_layer_is_skipped_and_sharded_index_is_read(ckpt, tmp_path):
    """Real checkpoints carry an extra multi-token-prediction layer and ship sharded."""
    path = copy_ckpt(ckpt[0], tmp_path / "sharded")
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    tensors["model.layers.2.eh_proj.weight"] = np.zeros((64, 128), np.float32)  # MTP layer (index = num layers)
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fn, ns in shards.items():
        save_file({n: tensors[n] for n in ns}, path / fn, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: fn for fn, ns in shards.items() for n in ns}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    _, a = load_model(path)
    _, b = load_model(ckpt[0])
    assert np.array_equal(np.asarray(a.layers[1].mlp.w_up[...]), np.asarray(b.layers[1].mlp.w_up[...]))


def test_prequantized_checkpoint_is_refused_clearly(ckpt, tmp_path):
    path = copy_ckpt(ckpt[0], tmp_path / "fp8")
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="fp8"):
        load_model(path)


@pytest.mark.parametrize("devices", [1, 4])
def test_weights_reach_the_devices_in_one_transfer(ckpt, monkeypatch, devices):
    """One transfer call for all the plain weights of a small model (not one per tensor), on
    one device or over a mesh, and each arrives with its checkpoint's values and placement."""
    import jax
    from flax import nnx

    from jaxserve.sharding import make_mesh

    mesh = make_mesh(devices) if devices > 1 else None
    calls = []
    real = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, *a, **k: calls.append(len(jax.tree.leaves(x))) or real(x, *a, **k))
    cfg, model = load_model(ckpt[0], mesh=mesh)
    monkeypatch.undo()
    params = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(model))]
    assert calls == [len(params)]
    assert all(isinstance(p, jax.Array) for p in params)
    if mesh is not None:  # the attention projections are split over the mesh
        assert any(len(p.sharding.device_set) == devices and not p.sharding.is_fully_replicated for p in params)
    stored = load_file(str(ckpt[0] / "model.safetensors"))["model.embed_tokens.weight"]
    np.testing.assert_array_equal(np.asarray(model.embed[...])[: stored.shape[0]], stored)
