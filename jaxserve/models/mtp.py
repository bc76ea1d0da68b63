"""The multi-token-prediction (MTP) block of DeepSeek-V3-architecture checkpoints (DeepSeek-V3 /
Kimi K2; GLM-5, whose MTP layer is a DSA layer with its own indexer) (``num_nextn_predict_layers``
> 0; the extra layer ``model.layers.{num_hidden_layers}.*``), the draft model of
``--speculative mtp``.

At position p it reads the main model's final hidden state h_p (after the final norm: what
the head reads) and the embedding of the token that follows p, and predicts the token after
that one (two ahead of h_p):

    x = eh_proj([enorm(embed(t_{p+1})), hnorm(h_p)])    (the embedding first, then the hidden)
    g = decoder layer(x) at position p                   (MLA + MoE, its own KV)
    draft logits = shared_head.head(shared_head.norm(g))

The embedding is the main model's (the checkpoints store a copy). Chaining the block on its own
output g (in place of h) drafts further tokens, as the proposers of other engines do.

Its caches are two more KV slots after the main layers' (same pools, page tables and tracker):
its layer's MLA pools, and ``hidden``: h_p of every computed token, stored in the KV format, so a
later step finds h_p of a token an earlier step computed. Every step of the main model also runs
the block one position behind its own tokens (``shifted``: the tokens of a step are the
"next tokens" of the positions just before them), so the block's KV is always written for every
position whose next token is known; the draft program (``CausalLM.draft``) then adds the
position of the newest token and chains.

The block's KV at a position depends on the token after it, so a step starting at c rewrites
position c - 1 with its own next token: after a prefix-cache hit that slot is on a shared page,
and a request sharing it may draft differently afterwards. Only drafts change, never output
tokens (verification decides every token).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.kv import paged
from jaxserve.models.base import WeightSpec, keep, t
from jaxserve.models.layers import RMSNorm, param
from jaxserve.models.step import StepInput
from jaxserve.quant.linear import linear

HIDDEN = "hidden"


class MTPBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: nnx.Module, dtype, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.cfg = cfg
        self.enorm = RMSNorm(d, cfg.rms_norm_eps, dtype, rngs)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps, dtype, rngs)
        self.eh_proj = param(rngs, (2 * d, d), (None, "embed"), dtype)
        self.layer = layer
        self.head_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, rngs)
        self.head = param(rngs, (d, cfg.vocab_rows), ("embed", "vocab"), dtype)

    def hidden(self, embeds, h_prev, rope, step: StepInput, kv, fmt, page_size: int, backend):
        """embeds [B, T, D] (of the next tokens), h_prev [B, T, D] -> (g [B, T, D], the layer's KV)."""
        x = jnp.concatenate([self.enorm(embeds), self.hnorm(h_prev)], axis=-1)
        out = self.layer(linear(x, self.eh_proj).astype(embeds.dtype), rope, step, kv, fmt, page_size, backend)
        return out[0], out[1]  # (a DSA layer also returns its selection)

    def logits(self, g):
        """g [..., D] -> draft logits f32 [..., V] (padded ids cut off)."""
        out = linear(self.head_norm(g), self.head, out_dtype=jnp.float32)
        return out[..., : self.cfg.vocab_size]

    def behind(self, *args, **kw):
        """A main step's part of the block (``run_behind``)."""
        return run_behind(self, *args, **kw)

    def draft(self, *args, **kw):
        """The draft program's part (``run_draft``)."""
        return run_draft(self, *args, **kw)

    def init_kv(self, num_pages: int, page_size: int, fmt) -> tuple[dict, dict]:
        """(its layer's pools, the ``hidden`` pool [P, S, D])."""
        hidden = paged.new_pool(fmt, (num_pages, page_size, self.cfg.hidden_size), HIDDEN)
        return self.layer.init_kv(num_pages, page_size, fmt), hidden


def store_hidden(fmt, pools: dict, h, step: StepInput, page_size: int):
    """Write h [B, T, D] of the step's tokens -> (pools, h as stored: what a later read gives)."""
    page, off = paged.token_slots(step.page_table, step.positions, step.valid, page_size, pools[HIDDEN].shape[0])
    return paged.store(fmt, pools, HIDDEN, h, page, off), paged.as_stored(fmt, h, h.dtype)


def load_hidden(fmt, pools: dict, step: StepInput, positions, page_size: int, dtype):
    """h at one position per row (int32 [B]; a negative one reads zeros) -> [B, D]."""
    page, off, ok = paged.position_slots(step.page_table, positions[:, None, None], page_size, pools[HIDDEN].shape[0])
    h = paged.load_slots(fmt, pools, HIDDEN, page[:, 0, 0], off[:, 0, 0], dtype)
    return jnp.where(ok[:, 0], h, 0)


def shifted(step: StepInput, h, h_before):
    """The block's inputs one position behind a main step: row b's new tokens sit at positions
    c..c+n-1 (c = cached_lens[b]); the block runs at c-1..c+n-2 with those tokens as the next
    tokens and hiddens h_{c-1} (``h_before`` [B, D], from the pool) then h [B, T, D] of the
    step's own tokens. A row at c = 0 has no position before its first token: it starts at 0
    with its second token. -> (StepInput of the block, its hiddens [B, T, D])."""
    c, n = step.cached_lens, step.new_lens
    first = c == 0
    zeros = jnp.zeros_like(step.tokens[:, :1])
    tokens = jnp.where(first[:, None], jnp.concatenate([step.tokens[:, 1:], zeros], 1), step.tokens)
    hid = jnp.where(first[:, None, None], h, jnp.concatenate([h_before[:, None], h[:, :-1]], 1))
    block = StepInput(tokens, jnp.where(first, 0, c - 1), jnp.where(first, jnp.maximum(n - 1, 0), n),
                      step.page_table)
    return block, hid


def mtp_weights(cfg: ModelConfig, layer_specs: list[WeightSpec]) -> list[WeightSpec]:
    """The MTP block's parameters from layer ``num_hidden_layers``'s tensors; ``layer_specs``:
    the family's decoder-layer specs for that index (targets ``layers/{n}/...``)."""
    n = cfg.num_hidden_layers
    hf = f"model.layers.{n}"
    specs = [dataclasses.replace(s, target="mtp/layer/" + s.target.split("/", 2)[2]) for s in layer_specs]
    return specs + [
        WeightSpec("mtp/enorm/scale", (f"{hf}.enorm.weight",), keep),
        WeightSpec("mtp/hnorm/scale", (f"{hf}.hnorm.weight",), keep),
        WeightSpec("mtp/eh_proj", (f"{hf}.eh_proj.weight",), t),
        WeightSpec("mtp/head_norm/scale", (f"{hf}.shared_head.norm.weight",), keep),
        WeightSpec("mtp/head", (f"{hf}.shared_head.head.weight",), t),
    ]


def skip_tensor(cfg: ModelConfig, name: str) -> bool:
    """Checkpoint tensors the model does not read: MTP layers it does not build (all of them
    without ``cfg.mtp_layers``; beyond the first with it), and the MTP layer's copy of the
    embedding (the main model's is read)."""
    if not name.startswith("model.layers."):
        return False
    idx, n = int(name.split(".")[2]), cfg.num_hidden_layers
    if idx < n:
        return False
    return not cfg.mtp_layers or idx >= n + cfg.mtp_layers or name == f"model.layers.{n}.embed_tokens.weight"


def run_behind(block: MTPBlock, h, step: StepInput, kv: tuple, embed, rope, fmt, page_size: int, backend):
    """A main step's part of the block (``shifted``): h [B, T, D] (the main model's final
    hidden states of the step's tokens) stored, the block's KV written one position behind.
    kv: (its layer's pools, the hidden pool); embed(tokens), rope(positions): the main
    model's. -> the new kv (the block's outputs are not needed: XLA drops their computation)."""
    layer_kv, hidden = kv
    before = load_hidden(fmt, hidden, step, step.cached_lens - 1, page_size, h.dtype)
    hidden, h = store_hidden(fmt, hidden, h, step, page_size)
    inp, hid = shifted(step, h, before)
    _, layer_kv = block.hidden(embed(inp.tokens), hid, rope(inp.positions), inp, layer_kv, fmt, page_size, backend)
    return layer_kv, hidden


def run_draft(block: MTPBlock, step: StepInput, kv: tuple, embed, rope, fmt, page_size: int, backend, k: int):
    """The draft program's part: row b's newest token ``tokens[b, 0]`` follows position
    c = cached_lens[b], whose hidden state is in the pool; the block runs at c, then chained on
    its own output at c + 1, ... (the previous draft as the next token), ``new_lens[b] - 1``
    steps writing KV (the drafts the row asked for; the others write nothing).
    -> (drafts int32 [B, k]: the argmax of each step, the new kv)."""
    layer_kv, hidden = kv
    c = step.cached_lens
    g = load_hidden(fmt, hidden, step, c, page_size, embed(step.tokens[:, :1]).dtype)[:, None]
    tok, drafts = step.tokens[:, :1], []
    for j in range(k):
        s = StepInput(tok, c + j, (j < step.new_lens - 1).astype(jnp.int32), step.page_table)
        g, layer_kv = block.hidden(embed(tok), g, rope(s.positions), s, layer_kv, fmt, page_size, backend)
        tok = jnp.argmax(block.logits(g), axis=-1).astype(jnp.int32)  # [B, 1]
        drafts.append(tok[:, 0])
    return jnp.stack(drafts, axis=1), (layer_kv, hidden)
