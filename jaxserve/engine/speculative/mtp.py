"""The MTP proposer: draft tokens from the checkpoint's multi-token-prediction block
(``jaxserve.models.mtp``), computed on the device by the ``draft`` programs.

``propose`` only reserves a request's draft slots (up to k placeholder tokens, so the scheduler
maps their pages like any drafts'); just before the verify call the decoder runs the draft
program over the decode batch (each row: its newest token and the reserved slots, from the
position before it, whose hidden state the last step stored) and puts its tokens in place
(``SpeculativeDecoder.verify``). The drafts are the argmax of each chained step: a function of
the token history, so the draft distribution is a point mass, as the acceptance rule assumes."""
from __future__ import annotations


class MtpProposer:
    on_device = True  # the drafts come from the draft program, not from propose()

    def __init__(self, k: int):
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
        self.k = k

    def propose(self, tokens, limit: int) -> list[int]:
        """min(k, limit) placeholder drafts (the slots the draft program fills)."""
        return [0] * max(0, min(self.k, limit))
