"""The engine's speculative decoder from its configuration (None when speculation is off)."""
from __future__ import annotations

from jaxserve.disagg.role import WorkerRole
from jaxserve.engine.speculative.decoder import SpeculativeDecoder
from jaxserve.engine.speculative.mtp import MtpProposer
from jaxserve.engine.speculative.ngram import NgramProposer


def make_speculative(config, model_cfg, max_model_len: int, block_manager) -> SpeculativeDecoder | None:
    """model_cfg: the loaded model's ModelConfig (``mtp`` needs its MTP block: ``mtp_layers``)."""
    if config.speculative is None or not WorkerRole(config.role).decodes:  # a prefill worker has no decode
        return None
    vocab_size = model_cfg.vocab_size
    if config.speculative == "mtp":
        if not model_cfg.mtp_layers:
            raise ValueError("speculative='mtp' needs a model loaded with its MTP layers (load_model(mtp=True); "
                             f"its config.json num_nextn_predict_layers = {model_cfg.num_nextn_predict_layers})")
        proposer = MtpProposer(config.num_speculative_tokens)
    else:
        proposer = NgramProposer(config.num_speculative_tokens, config.ngram_max, config.ngram_min)
    return SpeculativeDecoder(proposer, vocab_size, max_model_len, block_manager, config.speculative_min_acceptance,
                              config.speculative_policy)


def describe(config) -> str:
    """The speculative configuration in words (GetModelInfo, the startup log)."""
    if config.speculative is None:
        return "off"
    when = ("verifies every batch with a draft" if config.speculative_policy == "always" else
            f"verifies where it pays, pauses below {config.speculative_min_acceptance:g} acceptance")
    if config.speculative == "mtp":
        return f"mtp: k={config.num_speculative_tokens} (the checkpoint's MTP block, chained), {when}"
    return f"{config.speculative}: k={config.num_speculative_tokens}, n={config.ngram_min}..{config.ngram_max}, {when}"
