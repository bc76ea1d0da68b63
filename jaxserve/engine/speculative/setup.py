"""The engine's speculative decoder from its configuration (None when speculation is off)."""
from __future__ import annotations

from jaxserve.disagg.role import WorkerRole
from jaxserve.engine.speculative.decoder import SpeculativeDecoder
from jaxserve.engine.speculative.ngram import NgramProposer


def make_speculative(config, vocab_size: int, max_model_len: int, block_manager) -> SpeculativeDecoder | None:
    if config.speculative is None or not WorkerRole(config.role).decodes:  # a prefill worker has no decode
        return None
    proposer = NgramProposer(config.num_speculative_tokens, config.ngram_max, config.ngram_min)
    return SpeculativeDecoder(proposer, vocab_size, max_model_len, block_manager, config.speculative_min_acceptance)


def describe(config) -> str:
    """The speculative configuration in words (GetModelInfo, the startup log)."""
    if config.speculative is None:
        return "off"
    return (f"{config.speculative}: k={config.num_speculative_tokens}, n={config.ngram_min}..{config.ngram_max}, "
            f"pauses below {config.speculative_min_acceptance:g} acceptance")
