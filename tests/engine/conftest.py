import pytest

from tests.hf_models import build_deepseek_v3


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """A 2-layer Kimi K2-shaped model (MLA + MoE) with randomised weights, saved by transformers."""
    path = tmp_path_factory.mktemp("engine_dsv3")
    build_deepseek_v3(path, num_hidden_layers=2, seed=5)
    return str(path)
