"""Building blocks shared by the model families: norms, MLPs, MoE, rotary embeddings.

Einsum letters: B batch, T new tokens, S context slots, D model width, H heads,
K key/value heads, E experts, I intermediate width, R latent rank, N tokens (flattened).

Every parameter carries ``logical_axes`` metadata (one name or None per dim); the
sharding rules in ``jaxserve.sharding`` map those names onto the device mesh.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig, RopeConfig
from jaxserve.quant.linear import by_row_tiles, expert_linear, linear


def param(rngs: nnx.Rngs, shape, axes, dtype, init: str = "normal") -> nnx.Param:
    assert len(shape) == len(axes), (shape, axes)
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = (0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=tuple(axes))


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = param(rngs, (dim,), (None,), dtype, "ones")

    def __call__(self, x):
        # Row tiles in batch-invariant mode: a row reduction's last bits depend on the row count.
        return by_row_tiles(self._norm, x.reshape(-1, x.shape[-1])).reshape(x.shape)

    def _norm(self, x):
        # Normalise in float32 and cast back before the scale, as the reference does.
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * y.astype(x.dtype)


def activation(name: str):
    if name == "silu":
        return jax.nn.silu
    if name in ("gelu", "gelu_pytorch_tanh"):
        return lambda x: jax.nn.gelu(x, approximate=name != "gelu")
    raise ValueError(f"unsupported hidden_act {name!r}")


class DenseMLP(nnx.Module):
    """Gated MLP: down(act(x @ gate) * (x @ up)). gate/up [D, I], down [I, D]."""

    def __init__(self, dim: int, hidden: int, act: str, dtype, rngs: nnx.Rngs):
        self.act = activation(act)
        self.gate = param(rngs, (dim, hidden), ("embed", "mlp"), dtype)
        self.up = param(rngs, (dim, hidden), ("embed", "mlp"), dtype)
        self.down = param(rngs, (hidden, dim), ("mlp", "embed"), dtype)

    def __call__(self, x):
        h = self.act(linear(x, self.gate)) * linear(x, self.up)
        return linear(h, self.down)


class MoE(nnx.Module):
    """DeepSeek-V3 style MoE: sigmoid routing with correction bias, group-limited top-k,
    normalised weights times routed_scaling_factor, plus shared experts.

    Routed experts run as sorted dispatch: the N*k (token, expert) pairs are sorted by
    expert and three ``lax.ragged_dot`` calls compute every expert's slice in one go,
    so the work is proportional to k, not to the number of experts.
    """

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        d, e, i = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        if e % cfg.n_group:
            raise ValueError(f"n_routed_experts={e} is not divisible by n_group={cfg.n_group}")
        self.cfg = cfg
        self.act = activation(cfg.hidden_act)
        # Router stays float32 whatever the model dtype (the reference keeps it in fp32).
        self.router = param(rngs, (d, e), ("embed", None), jnp.float32)
        self.router_bias = param(rngs, (e,), (None,), jnp.float32, "zeros")
        self.w_gate = param(rngs, (e, d, i), ("expert", "embed", None), dtype)
        self.w_up = param(rngs, (e, d, i), ("expert", "embed", None), dtype)
        self.w_down = param(rngs, (e, i, d), ("expert", None, "embed"), dtype)
        self.shared = (
            DenseMLP(d, i * cfg.n_shared_experts, cfg.hidden_act, dtype, rngs) if cfg.n_shared_experts else None
        )

    def route(self, x):
        """x [N, D] -> (weights [N, k] f32, experts [N, k] int32)."""
        cfg = self.cfg
        n = x.shape[0]
        e, g = cfg.n_routed_experts, cfg.n_group
        scores = jax.nn.sigmoid(linear(x.astype(jnp.float32), self.router[...], out_dtype=jnp.float32))  # [N, E]
        choice = scores + self.router_bias[...]
        if g > 1:
            grouped = choice.reshape(n, g, e // g)
            group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [N, G]: sum of each group's top-2
            _, top_groups = jax.lax.top_k(group_score, cfg.topk_group)
            keep = jnp.zeros((n, g), bool).at[jnp.arange(n)[:, None], top_groups].set(True)
            choice = jnp.where(jnp.repeat(keep, e // g, axis=1), choice, -jnp.inf)
        _, experts = jax.lax.top_k(choice, cfg.num_experts_per_tok)
        weights = jnp.take_along_axis(scores, experts, axis=1)  # unbiased scores
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, experts.astype(jnp.int32)

    def experts(self, x, weights, experts):
        """x [N, D], weights/experts [N, k] -> [N, D] via sorted ragged matmuls."""
        n, k = experts.shape
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        token = order // k
        sizes = jnp.bincount(flat, length=self.cfg.n_routed_experts).astype(jnp.int32)
        xs = x[token]  # [N*k, D] grouped by expert
        h = self.act(expert_linear(xs, self.w_gate, sizes)) * expert_linear(xs, self.w_up, sizes)
        y = expert_linear(h.astype(x.dtype), self.w_down, sizes)  # [N*k, D]
        y = y.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
        return jnp.zeros((n, x.shape[1]), jnp.float32).at[token].add(y).astype(x.dtype)

    def __call__(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, experts = by_row_tiles(self.route, flat)
        out = self.experts(flat, weights, experts)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.reshape(shape)


# ----------------------------------------------------------------------------- rotary


def rope_inv_freq(rope: RopeConfig, dim: int) -> tuple[jnp.ndarray, float]:
    """Inverse frequencies [dim/2] and the cos/sin scale (yarn's attention factor)."""
    base = rope.theta
    exps = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
    inv = 1.0 / (base**exps)
    if rope.kind == "default":
        return inv, 1.0
    if rope.kind == "llama3":
        lo_wl = rope.original_max_position_embeddings / rope.low_freq_factor
        hi_wl = rope.original_max_position_embeddings / rope.high_freq_factor
        wl = 2 * math.pi / inv
        scaled = jnp.where(wl > lo_wl, inv / rope.factor, inv)
        smooth = (rope.original_max_position_embeddings / wl - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        mid = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_mid = (wl >= hi_wl) & (wl <= lo_wl)
        return jnp.where(is_mid, mid, scaled), 1.0
    # yarn
    from jaxserve.config import yarn_mscale

    factor = rope.factor
    if rope.attention_factor is not None:
        attn = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attn = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attn = yarn_mscale(factor)
    omax = rope.original_max_position_embeddings

    def corr_dim(rot):
        return dim * math.log(omax / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(rope.beta_fast), corr_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    extrap = 1 - ramp
    inv = (inv / factor) * (1 - extrap) + inv * extrap
    return inv, float(attn)


def rope_cos_sin(positions, inv_freq, scale: float):
    """positions [B, T] -> cos, sin [B, T, dim/2] (float32)."""
    ang = positions.astype(jnp.float32)[..., None] * inv_freq
    return _computed_once(jnp.cos(ang) * scale), _computed_once(jnp.sin(ang) * scale)


def _computed_once(table):
    """``table`` read back through an identity row gather. XLA fuses a producer into each of its
    consumers, duplicating it, unless it is expensive and the consumer reuses its elements; left
    as they are, cos and sin were fused into every layer's q and k rotation and evaluated there
    per element and head (XLA:CPU, SmolLM2 prefill: a sixth of the non-matmul time; an
    optimization barrier does not stop it). A gather reuses elements, so the table is computed
    once and each rotation fuses only the row loads."""
    rows = table.reshape(-1, table.shape[-1])
    idx = jax.lax.iota(jnp.int32, rows.shape[0])
    return jnp.take(rows, idx, axis=0, unique_indices=True, indices_are_sorted=True, mode="clip").reshape(table.shape)


def apply_rope(x, cos, sin, interleaved: bool):
    """x [B, T, ..., dim] rotated by cos/sin [B, T, dim/2].

    interleaved (DeepSeek/Kimi): pairs (x0, x1), (x2, x3)...; the output keeps the
    reference's layout (rotated evens then rotated odds). Non-interleaved (Llama/GLM):
    the first and second halves are the pairs.
    """
    extra = x.ndim - cos.ndim
    c = cos.reshape(cos.shape[:2] + (1,) * extra + cos.shape[2:])
    s = sin.reshape(c.shape)
    xf = x.astype(jnp.float32)
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)
