"""The multi-token-prediction block (``jaxserve.models.mtp``) of the tiny Kimi checkpoint and of a
tiny GLM-5 one against an independent reference of its definition: the block's own arithmetic in
numpy (enorm / hnorm, the concatenation [embedding, hidden], eh_proj, the shared head) around
transformers' decoder layer of the family (DeepseekV3; GlmMoeDsa: a full DSA layer with its
indexer) loaded with the MTP layer's weights, fed the main model's final hidden states as
transformers computes them."""
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.hf_models import add_mtp_layer, build_glm_moe_dsa
from jaxserve.kv.formats import get_kv_format
from jaxserve.loader import load_model
from jaxserve.models.attention_backends import XLA
from jaxserve.models.step import StepInput

KIMI = "checkpoints/tiny-kimi-k2"
PAGE = 4


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


@pytest.fixture(scope="module", params=["kimi", "glm5"])
def checkpoint(request, tmp_path_factory):
    if request.param == "kimi":
        return KIMI
    path = tmp_path_factory.mktemp("glm5_mtp_ref")
    build_glm_moe_dsa(path, num_hidden_layers=2, seed=4, indexer_types=["full", "full"])
    add_mtp_layer(path)
    return str(path)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """(main model, MTP decoder layer as transformers builds it, rotary, the MTP layer's other
    tensors as numpy)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    main = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()
    cfg = AutoConfig.from_pretrained(checkpoint)
    n = cfg.num_hidden_layers
    cfg.num_hidden_layers += 1  # the MTP layer's decoder layer is layer n's tensors
    if getattr(cfg, "indexer_types", None):
        cfg.indexer_types = list(cfg.indexer_types) + ["full"]  # with its own indexer
    if getattr(cfg, "mlp_layer_types", None):
        cfg.mlp_layer_types = list(cfg.mlp_layer_types) + ["sparse"]
    big = AutoModelForCausalLM.from_pretrained(checkpoint, config=cfg, torch_dtype=torch.float32).eval()
    big.config._attn_implementation = "eager"
    p = f"model.layers.{n}."
    t = {k[len(p):]: v.float().numpy() for k, v in load_file(f"{checkpoint}/model.safetensors").items()
         if k.startswith(p)}
    return main, big.model.layers[n], big.model.rotary_emb, t


def mtp_reference(reference, tokens, hiddens, positions):
    """Draft logits [T, V] of the block run at ``positions`` with next tokens ``tokens`` and
    previous hidden states ``hiddens`` [T, D] (causal over these T positions)."""
    main, layer, rotary, t = reference
    eps = main.config.rms_norm_eps
    e = t["embed_tokens.weight"][tokens]
    x = np.concatenate([rms(e, t["enorm.weight"], eps), rms(hiddens, t["hnorm.weight"], eps)], -1)
    x = x @ t["eh_proj.weight"].T  # [T, D]: HF Linear is [out, in]
    xt = torch.tensor(x[None], dtype=torch.float32)
    pos = torch.tensor([positions])
    n = len(positions)
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        g = layer(xt, attention_mask=mask, position_ids=pos, position_embeddings=rotary(xt, pos))
    g = (g[0] if isinstance(g, tuple) else g)[0].numpy()
    return rms(g, t["shared_head.norm.weight"], eps) @ t["shared_head.head.weight"].T, g


def test_mtp_block_matches_the_reference(checkpoint, reference):
    """One prefill writes the block's KV one position behind; then at each position m the draft
    program's two drafts (the block at m, then chained on its own output at m + 1) are the
    reference's argmaxes, and its logits are close."""
    main = reference[0]
    rng = np.random.RandomState(3)
    prompt = [int(x) for x in rng.randint(2, main.config.vocab_size, size=11)]
    with torch.no_grad():
        h = main.model(torch.tensor([prompt])).last_hidden_state[0].numpy()  # after the final norm
    fmt = get_kv_format("float32")
    _, model = load_model(checkpoint, mtp=True)
    kv = model.init_kv(8, PAGE, fmt)
    table = np.array([[1, 2, 3, 4]], np.int32)
    step = StepInput(*(np.asarray(a, np.int32) for a in ([prompt], [0], [len(prompt)], table)))
    _, kv = model(step, kv, fmt, PAGE)
    errs = []
    for m in range(1, len(prompt) - 1):
        ref, g = mtp_reference(reference, prompt[1 : m + 2], h[: m + 1], list(range(m + 1)))
        d1 = int(np.argmax(ref[-1]))
        ref2, _ = mtp_reference(reference, prompt[1 : m + 2] + [d1], np.concatenate([h[: m + 1], g[-1:]]),
                                list(range(m + 2)))
        inp = StepInput(*(np.asarray(a, np.int32) for a in ([[prompt[m + 1], 0, 0]], [m], [3], table)))
        drafts, kv = model.draft(inp, kv, fmt, PAGE, 2)
        assert np.asarray(drafts)[0].tolist() == [d1, int(np.argmax(ref2[-1]))], m
        logits = np.asarray(model.mtp.logits(model.mtp.hidden(
            model.embed_ids(np.array([[prompt[m + 1]]])), h[None, m : m + 1], model.rope_at(np.array([[m]])),
            StepInput(*(np.asarray(a, np.int32) for a in ([[prompt[m + 1]]], [m], [1], table))), kv[-2], fmt,
            PAGE, XLA)[0]))[0, 0]
        errs.append(np.abs(logits - ref[-1]).max())
    print(f"max |draft logit error| vs the reference: {max(errs):.2e}")
    assert max(errs) < 1e-3



@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
def test_planner_counts_the_mtp_kv_the_engine_allocates(checkpoint, fmt):
    """``jaxserve plan --include-mtp`` sizes KV tokens from the config; the engine from the pools
    the model with its MTP block allocates (its layer's latent + rope (+ indexer key on GLM-5)
    and the cached hidden states): they must count the same bytes per token."""
    import json
    import pathlib

    from jaxserve.kv.memory import format_token_bytes, model_token_layout
    from jaxserve.planner import kv_layout

    raw = json.loads((pathlib.Path(checkpoint) / "config.json").read_text())
    f = get_kv_format(fmt)
    _, model = load_model(checkpoint, mtp=True)
    with_mtp, without = kv_layout(raw, include_mtp=True), kv_layout(raw)
    assert format_token_bytes(f, *model_token_layout(model, f)) == format_token_bytes(f, with_mtp.values,
                                                                                       with_mtp.vectors)
    assert with_mtp.values > without.values and with_mtp.vectors > without.vectors
