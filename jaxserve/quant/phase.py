"""Per-phase weight representations: one loaded model, a prefill copy and a decode copy.

``quantize_state`` turns an NNX state's matmul weights into ``PhaseWeight`` leaves in a
chosen format (norms, biases, the router and the embedding stay as loaded: they are small
or, for the embedding, a lookup table). Weights a pre-quantized checkpoint loaded as
PhaseWeights are kept in their own format or converted; a converted checkpoint's
``PhaseSet`` gives the member stored for the phase. The PhaseWeights go into the jitted
programs as they are stored (values + scales) and every matmul reads them through
``jaxserve.quant.linear``, so each phase computes in its own representation.

Weights are viewed as matrices [..., K, N] (K = input): 3-D attention weights
[in, heads, x] become [in, heads * x]; the output projection [heads, v, D] becomes
[heads * v, D]; stacked experts [E, K, N] keep their expert axis.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.quant.formats import get_weight_format
from jaxserve.quant.qweight import QuantizedWeight, record_specs, shardings_for
from jaxserve.sharding import place as place_array

# Parameter paths (as "/"-joined NNX paths) holding matmul weights.
# The DSA indexer's wq_b / wk are matmul weights like q_b; its weights_proj stays float32 (the
# reference keeps it so: it weighs the per-head scores the top-k is chosen from). The MTP block's
# eh_proj and head are matmul weights too (its decoder layer's match the layers' patterns).
_MATMUL = re.compile(
    r"(^lm_head$)|(^mtp/(eh_proj|head)$)"
    r"|(/attn/(q|k|v|o|q_a|q_b|q_proj|kv_a|kv_b)$)|(/mlp/(shared/)?(gate|up|down)$)|(/mlp/w_(gate|up|down)$)"
    r"|(/attn/indexer/(wq_b|wk)$)"
)
_EXPERTS = re.compile(r"/mlp/w_(gate|up|down)$")


TIED_EMBED = "embed"  # a tied model's embedding table [V, D] is also its LM head [D, V]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["qw"], meta_fields=["shape", "transposed"])
@dataclasses.dataclass(frozen=True, eq=False)
class PhaseWeight:
    qw: QuantizedWeight  # the weight as a matrix [..., K, N] in its phase format
    shape: tuple[int, ...]  # the parameter's own shape
    # True for a tied embedding [V, D] stored as the head matrix [D, V] it multiplies as: the
    # head reads it as a matmul weight, the lookup gathers columns (quant.linear.embedding).
    transposed: bool = False

    def dense(self, dtype):
        """The whole weight as a dense array: for conversion and tests, never in a serving program."""
        w = self.qw.dequantize(dtype)
        return (w.T if self.transposed else w).reshape(self.shape)


def phase_weight(path: str, qw: QuantizedWeight, shape) -> "PhaseWeight":
    """The PhaseWeight for parameter ``path`` stored as ``qw`` (its matrix_view)."""
    return PhaseWeight(qw, tuple(shape), transposed=path == TIED_EMBED)


def matrix_view(path: str, shape: tuple[int, ...], axes: tuple) -> tuple[tuple[int, ...], tuple]:
    """-> (matrix shape [..., K, N], its logical axes)."""
    if path == TIED_EMBED:  # [V, D] -> the head [D, V]
        return (shape[1], shape[0]), (axes[1], axes[0])
    if _EXPERTS.search(path) or len(shape) == 2:
        return tuple(shape), tuple(axes)
    if path.endswith("/attn/o"):  # [H, v, D]
        return (shape[0] * shape[1], shape[2]), (axes[0], axes[2])
    return (shape[0], math.prod(shape[1:])), (axes[0], axes[1])  # [in, H, x]


def is_matmul_weight(path: str, tied_head: bool = False) -> bool:
    """A weight some matmul reads; with ``tied_head`` the embedding table is one (the head)."""
    return bool(_MATMUL.search(path)) or (tied_head and path == TIED_EMBED)


def has_tied_head(paths) -> bool:
    """A state with an embedding table and no lm_head of its own ties the head to it."""
    paths = set(paths)
    return TIED_EMBED in paths and "lm_head" not in paths


qw_shardings = shardings_for  # kept as the name the checkpoint code uses


def place(qw: QuantizedWeight, weight_axes, mesh, name: str = "") -> QuantizedWeight:
    """Put a host QuantizedWeight on device: sharded by ``qw_shardings`` under a mesh."""
    if mesh is None:
        return jax.device_put(qw)
    return jax.tree.map(place_array, qw, qw_shardings(qw, weight_axes, mesh, name))


class PhaseSetError(ValueError):
    """A converted checkpoint does not hold the weight representation a phase asks for."""


@functools.partial(jax.tree_util.register_dataclass, data_fields=["members"], meta_fields=["labels"])
@dataclasses.dataclass(frozen=True, eq=False)
class PhaseSet:
    """A converted (jaxserve convert) parameter whose phases store different representations.

    labels[i] names members[i]'s representation: a format name, or None for the weights as
    loaded (the source dtype). Two phases with the same label share one stored value, so
    the labels of a set always differ and a label picks one member. ``quantize_state``
    resolves sets; nothing inside jit ever sees one.
    """

    labels: tuple[str | None, ...]
    members: tuple  # PhaseWeight | array, one per label

    def pick(self, label: str | None):
        if label not in self.labels:
            shown = ", ".join(str(x or "as loaded") for x in self.labels)
            raise PhaseSetError(
                f"the converted checkpoint holds this weight as {shown}, not {label or 'as loaded'}; "
                "ask for the formats it was converted with, or convert again with `jaxserve convert`"
            )
        return self.members[self.labels.index(label)]


def _host_matrix(path: str, value, mshape) -> np.ndarray:
    """A parameter value (array or PhaseWeight) as a float32 host matrix [..., K, N]."""
    if isinstance(value, PhaseWeight):
        value = value.qw.dequantize(jnp.float32)  # already the matrix view
    elif path == TIED_EMBED:
        value = jnp.asarray(value).T
    return np.asarray(jax.device_get(value), np.float32).reshape(mshape)


def phase_value(path: str, value, axes, fmt, mesh=None, tied_head: bool = False):
    """One parameter's value in format `fmt` (a WeightFormat, or None: as it is).

    value: an array, or a PhaseWeight already holding a (pre-quantized checkpoint's) format.
    A PhaseWeight in the wanted format is returned as is; one in another format is
    dequantized (float32, host) and requantized. Non-matmul parameters never change; with
    ``tied_head`` the embedding table is quantized as the head matrix [D, V].
    """
    if fmt is None or not is_matmul_weight(path, tied_head):
        return value
    if isinstance(value, PhaseWeight) and value.qw.format == fmt.name:
        return value
    shape = value.shape if isinstance(value, PhaseWeight) else tuple(value.shape)
    axes = axes or (None,) * len(shape)
    mshape, maxes = matrix_view(path, shape, axes)
    qw = fmt.quantize(_host_matrix(path, value, mshape), name=path)
    return phase_weight(path, place(qw, maxes, mesh, path), shape)


def quantize_state(state, spec: str | None, mesh=None, tied_head: bool | str = False, shared: dict | None = None):
    """Copy of `state` with every matmul weight stored in format `spec`.

    With ``tied_head`` a format spec (e.g. "bf16"), a tied model's embedding table is stored
    as its head [D, V] in that format whatever ``spec`` is, once: ``shared`` (a dict the
    caller passes to each phase's call) keeps the stored head, so phases share one copy.
    With ``tied_head`` True, a tied model's embedding table is stored as its head [D, V] in the
    phase format too (the head is the largest matrix of a small model: 21% of SmolLM2-135M's
    bytes); off by default, since the head's error goes straight into the logits (measured on
    SmolLM2, decode dPPL: int4:g32 +5.6 -> +10.6, fp8 +0.55 -> +1.24 with the head quantized).

    spec None means "as loaded": plain arrays stay, and a Variable that already holds a
    PhaseWeight (a pre-quantized checkpoint, loaded in its own format) is kept. A PhaseWeight
    is also kept when `spec` names its format; only when the phase asks for a different
    format is it dequantized and requantized (once, on the host, at load).

    A PhaseSet (a converted checkpoint's per-phase representations) gives the member whose
    label is `spec`'s format (None: the "as loaded" member); a label it lacks is a
    PhaseSetError, since a converted checkpoint exists to avoid requantizing at load
    (``jaxserve convert`` re-converting one requantizes its largest member instead).
    """
    fmt = get_weight_format(spec) if spec is not None else None
    head_fmt = get_weight_format(tied_head) if isinstance(tied_head, str) else None
    label = fmt.name if fmt is not None else None
    flat = nnx.to_flat_state(state)
    if fmt is None and head_fmt is None and not any(isinstance(v.get_value(), PhaseSet) for _, v in flat):
        return state  # as loaded: nothing to do
    out = []
    shared = {} if shared is None else shared
    tied = bool(tied_head) and has_tied_head("/".join(str(k) for k in p) for p, _ in flat)
    for p, var in flat:
        path = "/".join(str(k) for k in p)
        value = var.get_value()
        if isinstance(value, PhaseSet):
            value = value.pick(label)
        axes = var.get_metadata().get("logical_axes")
        if tied and head_fmt is not None and path == TIED_EMBED:  # one stored head for every phase
            if path not in shared:
                shared[path] = phase_value(path, value, axes, head_fmt, mesh, True)
            new = shared[path]
        else:
            new = phase_value(path, value, axes, fmt, mesh, tied and head_fmt is None)
        out.append((p, var if new is var.get_value() else var.replace(new)))
    return nnx.from_flat_state(out)


def phase_states(state, prefill: str | None, decode: str | None, mesh=None, tied_head: bool | str = False,
                 prefill_from_decode: bool = False, only: str | None = None):
    """-> ({phase: format spec}, {phase: state}) for the prefill and decode programs.

    One copy whenever one suffices: both phases in one format share one state (the same
    object), and with ``prefill_from_decode`` prefill reads the decode copy (an int4 prefill
    then runs on the int4 path: slower than fp8/bf16, half the resident weights).
    ``only="prefill"`` builds the prefill copy alone (a prefill worker: no decode entry).
    ``tied_head``: see ``quantize_state`` (a format spec: one head copy both phases read)."""
    if only == "prefill":
        return {"prefill": prefill}, {"prefill": quantize_state(state, prefill, mesh, tied_head)}
    shared: dict = {}
    if prefill_from_decode:
        if prefill is not None:
            raise ValueError("prefill_from_decode_weights reads the decode copy: leave prefill_weights unset")
        prefill = decode
    canon = [spec and get_weight_format(spec).name for spec in (prefill, decode)]
    dec = quantize_state(state, decode, mesh, tied_head, shared)
    pre = dec if canon[0] == canon[1] else quantize_state(state, prefill, mesh, tied_head, shared)
    return {"prefill": prefill, "decode": decode}, {"prefill": pre, "decode": dec}


def record_phase_specs(states: dict) -> dict:
    """``{phase: state}`` with every PhaseWeight's ``qw.specs`` read from its placed arrays
    (``qweight.record_specs``); phases that shared one state still share one."""
    done: dict[int, object] = {}

    def one(w):
        if not isinstance(w, PhaseWeight):
            return w
        return dataclasses.replace(w, qw=record_specs(w.qw))

    for s in states.values():
        if id(s) not in done:
            done[id(s)] = jax.tree.map(one, s, is_leaf=lambda x: isinstance(x, PhaseWeight))
    return {p: done[id(s)] for p, s in states.items()}


def state_nbytes(state) -> int:
    """Bytes of every array leaf (quantized values and scales included)."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))
