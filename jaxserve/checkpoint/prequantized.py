"""Pre-quantized Hugging Face checkpoints, loaded in their quantized form (no round trip).

Two formats, as real checkpoints ship them.

**FP8 block-scaled** (DeepSeek-V3, GLM FP8)::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                            "weight_block_size": [128, 128], "activation_scheme": "dynamic"}

Each quantized Linear ``X`` has ``X.weight`` float8_e4m3fn [out, in] and
``X.weight_scale_inv`` float32 [ceil(out/128), ceil(in/128)]. Despite its name the stored
value is the dequantization multiplier: DeepSeek-V3 ``inference/kernel.py`` computes
``weight_quant: s = amax / 448, y = x / s`` and ``weight_dequant: y = x * s`` per 128x128
block. The config does not list which Linears are quantized; a Linear is FP8 iff it ships
a ``weight_scale_inv`` (DeepSeek keeps embed, lm_head, norms and the router gate in BF16;
q_a/kv_a projections are FP8). Loaded as our ``fp8:block128``: the same e4m3 bytes and
float32 scales, transposed to our [in, out] orientation.

**compressed-tensors pack-quantized W4A16** (Kimi K2.x)::

    "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4,
            "type": "int", "symmetric": true, "strategy": "group", "group_size": 32}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", ...]}

A Linear is quantized iff a group targets it ("Linear", an exact name, or ``re:`` + a
regex applied with ``re.match``, as ``compressed_tensors.utils.match.match_name`` does) and
no ``ignore`` entry matches it; it then ships ``X.weight_packed`` int32 [out, ceil(in/8)],
``X.weight_scale`` [out, ceil(in/group)] (model dtype, bf16) and ``X.weight_shape`` [2] =
[out, in]. Packing (``compressed_tensors/compressors/quantized_compressors/
pack_quantized.py``, ``pack_to_int32(packed_dim=1)``): q int8 in [-8, 7] is stored as
q + 8 in [0, 15]; along each row, input column ``8*j + i`` goes to bits [4i, 4i+4) of
word ``j`` (first column in the lowest nibble), the row zero-padded to a multiple of 8.
Scales (``calculate_qparams``, symmetric): ``scale = amax / 7.5`` per group of
``group_size`` input columns, ``q = round(clamp(w / scale, -8, 7))``, ``w ~= q * scale``:
the convention of our ``int4:g<G>`` (quant/int4.py), so values and scales carry over
exactly and only the nibble layout changes. One arithmetic difference: compressed-tensors'
own dequantize multiplies in the scale's dtype (bf16), rounding ``q * scale`` to bf16; we
multiply in float32, which is exact (a 4-bit q times an 8-bit mantissa).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

import ml_dtypes
import numpy as np

from jaxserve.config import ConfigError
from jaxserve.quant.formats import get_weight_format
from jaxserve.quant.int4 import pack_int4
from jaxserve.quant.phase import is_matmul_weight
from jaxserve.quant.qweight import QuantizedWeight


class CheckpointError(ValueError):
    """The checkpoint's tensors do not match what the model needs (re-exported by jaxserve.loader)."""


SUPPORTED = ("'fp8' (e4m3 weights with 128x128 block weight_scale_inv, as DeepSeek-V3/GLM FP8 ship) and "
             "'compressed-tensors' pack-quantized symmetric int4 group weights (as Kimi K2 ships)")


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """A checkpoint's quantization_config, reduced to what loading needs."""

    method: str  # "fp8" | "compressed-tensors"
    weight_format: str  # our format the quantized tensors load into: "fp8:block128" | "int4:g<G>"
    targets: tuple[str, ...] = ()  # compressed-tensors only
    ignore: tuple[str, ...] = ()

    @property
    def group(self) -> int:
        return get_weight_format(self.weight_format).group

    def targeted(self, module: str, stored: str | None = None) -> bool:
        """compressed-tensors: is Linear `module` (HF name without .weight) quantized? `stored`:
        the module's name in the checkpoint when it differs (a multimodal wrapper's text model,
        whose config may name either form); a target or ignore entry may match either name."""

        def match(name, target):
            if target == "Linear":  # class-name target: every module asked about is a Linear
                return True
            if target.startswith("re:"):
                return re.match(target[3:], name) is not None
            return target == name

        names = (module,) if stored is None else (module, stored)
        return (any(match(n, t) for n in names for t in self.targets)
                and not any(match(n, t) for n in names for t in self.ignore))


def parse_quantization_config(q) -> QuantScheme | None:
    """quantization_config dict -> QuantScheme (None: not quantized); ConfigError if unsupported."""
    if not q:
        return None
    if not isinstance(q, dict):
        raise ConfigError(f"quantization_config must be an object, got {type(q).__name__}")
    method = q.get("quant_method")
    if method == "fp8":
        return _parse_fp8(q)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(q)
    raise ConfigError(f"quantization_config quant_method={method!r} is not supported; jaxserve loads {SUPPORTED}")


def _refuse(what: str, value) -> ConfigError:
    return ConfigError(f"quantization_config: {what}={value!r} is not supported; jaxserve loads {SUPPORTED}")


def _parse_fp8(q: dict) -> QuantScheme:
    if q.get("fmt", "e4m3") != "e4m3":
        raise _refuse("fp8 fmt", q.get("fmt"))
    if list(q.get("weight_block_size") or []) != [128, 128]:
        raise _refuse("fp8 weight_block_size", q.get("weight_block_size"))
    if q.get("activation_scheme", "dynamic") != "dynamic":  # static ships input_scale tensors
        raise _refuse("fp8 activation_scheme", q.get("activation_scheme"))
    return QuantScheme("fp8", "fp8:block128")


def _parse_compressed_tensors(q: dict) -> QuantScheme:
    if q.get("format") != "pack-quantized":
        raise _refuse("compressed-tensors format", q.get("format"))
    if q.get("quantization_status", "compressed") != "compressed":
        raise _refuse("compressed-tensors quantization_status", q.get("quantization_status"))
    if q.get("kv_cache_scheme"):
        raise _refuse("compressed-tensors kv_cache_scheme", q.get("kv_cache_scheme"))
    groups = q.get("config_groups") or {}
    if not groups:
        raise ConfigError("quantization_config (compressed-tensors) has no config_groups")
    sizes, targets = set(), []
    for name, g in groups.items():
        w = g.get("weights") or {}
        if g.get("format", "pack-quantized") != "pack-quantized":
            raise _refuse(f"{name}.format", g.get("format"))
        if g.get("input_activations") or g.get("output_activations"):
            raise _refuse(f"{name} activation quantization", g.get("input_activations") or g.get("output_activations"))
        want = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
        for key, value in want.items():
            if w.get(key) != value:
                raise _refuse(f"{name}.weights.{key}", w.get(key))
        if w.get("actorder") or w.get("dynamic"):  # act-order ships a g_idx permutation
            raise _refuse(f"{name}.weights.actorder/dynamic", w.get("actorder") or w.get("dynamic"))
        sizes.add(w.get("group_size"))
        targets += list(g.get("targets") or [])
    if len(sizes) != 1:
        raise ConfigError(f"quantization_config: config_groups use several group sizes {sorted(map(str, sizes))}")
    fmt = f"int4:g{sizes.pop()}"
    try:
        get_weight_format(fmt)
    except ValueError as e:
        raise ConfigError(f"quantization_config: group_size gives {fmt}: {e}") from None
    return QuantScheme("compressed-tensors", fmt, tuple(targets), tuple(q.get("ignore") or ()))


# ----------------------------------------------------------------------------- tensor plan


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """How one parameter of ours is read: kind "plain" | "fp8" | "int4", and the tensors."""

    kind: str
    names: tuple[str, ...]
    dense: bool = False  # a weight we keep in full precision, shipped quantized: dequantized on load


FP8_SUFFIXES = (".weight", ".weight_scale_inv")
INT4_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_shape")


def plan_tensors(scheme: QuantScheme | None, spec, has: Callable[[str], bool],
                 dtype_of: Callable[[str], str | None],
                 stored: Callable[[str], str | None] = lambda name: None) -> TensorPlan:
    """Which checkpoint tensors build WeightSpec `spec`, given the scheme and the index.

    has(name): the tensor exists; dtype_of(name): its safetensors dtype code (or None);
    stored(name): its name in the file when that differs (multimodal wrappers), else None.
    """
    plain = TensorPlan("plain", tuple(spec.sources))
    linear = all(s.endswith(".weight") for s in spec.sources)
    bases = [s[: -len(".weight")] for s in spec.sources]
    suffixes, kind = (FP8_SUFFIXES, "fp8") if scheme is not None and scheme.method == "fp8" else (INT4_SUFFIXES, "int4")
    dense = scheme is not None and linear and not is_matmul_weight(spec.target)
    if dense:
        # Kept in full precision by us (e.g. the DSA indexer's float32 weights_proj) but the checkpoint
        # may ship it quantized (every Linear): then it is read in that form and dequantized on load.
        quant = [has(b + suffixes[1 if kind == "fp8" else 0]) for b in bases]
    elif scheme is None or not linear:
        quant = [False]
    elif kind == "fp8":
        quant = [has(b + ".weight_scale_inv") or dtype_of(b + ".weight") == "F8_E4M3" for b in bases]
    else:
        quant = [scheme.targeted(b, (stored(b + ".weight") or "")[: -len(".weight")] or None) for b in bases]
    if not any(quant):
        for s in spec.sources:  # an 8-bit float where we keep full precision would load as garbage
            if (dtype_of(s) or "").startswith("F8"):
                raise CheckpointError(f"{s} is float8 with no block scale, but jaxserve keeps {spec.target} "
                                      "unquantized (DeepSeek-style FP8 checkpoints keep it in BF16)")
        return plain
    if not all(quant):  # e.g. some experts of one stack quantized and others not
        q = [b for b, x in zip(bases, quant) if x][:2]
        p = [b for b, x in zip(bases, quant) if not x][:2]
        raise CheckpointError(f"{spec.target} is built from tensors of which some are quantized ({', '.join(q)}) "
                              f"and some are not ({', '.join(p)}); they must be all one or the other")
    return TensorPlan(kind, tuple(b + s for b in bases for s in suffixes), dense)


def count_quantized(plans) -> int:
    return sum(p.kind != "plain" for p in plans)


def dequantized_source(plan: TensorPlan, scheme: QuantScheme, read: Callable[[str], np.ndarray], target: str):
    """A ``dense`` plan's one source tensor as the checkpoint means it: float32 [out, in]
    (values x scales; exact for int4, one float32 rounding for fp8), for the weight spec's
    own transform."""
    import jax.numpy as jnp

    if len(plan.names) != (len(FP8_SUFFIXES) if plan.kind == "fp8" else len(INT4_SUFFIXES)):
        raise CheckpointError(f"{target}: a weight kept in full precision is built from one tensor, got {plan.names}")
    qw = build_quantized(plan, scheme, read, None, target)
    return np.asarray(qw.dequantize(jnp.float32)).T


# ----------------------------------------------------------------------------- conversion


def unpack_ct_int4(packed, in_features: int) -> np.ndarray:
    """compressed-tensors int32 [out, ceil(in/8)] (pack_to_int32, packed_dim=1) -> int8 q [out, in] in [-8, 7]."""
    packed = np.asarray(packed)
    if packed.dtype != np.int32 or packed.ndim != 2:
        raise ValueError(f"weight_packed must be int32 [out, in/8], got {packed.dtype} {packed.shape}")
    out, words = packed.shape
    if words != -(-in_features // 8):
        raise ValueError(f"weight_packed has {words} words per row; {in_features} inputs need {-(-in_features // 8)}")
    shifts = 4 * np.arange(8, dtype=np.uint32)  # column 8j + i sits at bits [4i, 4i + 4) of word j
    nibbles = (packed.view(np.uint32)[:, :, None] >> shifts) & 0xF
    return nibbles.reshape(out, words * 8)[:, :in_features].astype(np.int8) - 8


def _ct_to_ours(packed, scale, shape, group: int, name: str) -> tuple[np.ndarray, np.ndarray, int]:
    """One compressed-tensors Linear -> (q int8 [Kp, N] zero-padded to whole groups, scales [Kp/G, N] in the
    dtype they ship in (bf16: 0.5625 B/param at g32 instead of 0.625 with float32 scales), K)."""
    shape = np.asarray(shape).reshape(-1)
    if shape.size != 2 or not np.issubdtype(shape.dtype, np.integer):
        raise CheckpointError(f"{name}.weight_shape must be 2 integers [out, in], got {shape.dtype} {shape.shape}")
    n, k = (int(x) for x in shape)
    try:
        q = unpack_ct_int4(packed, k)
    except ValueError as e:
        raise CheckpointError(f"{name}.weight_packed: {e}") from None
    ng = -(-k // group)
    scale = np.asarray(scale)
    if q.shape[0] != n or scale.shape != (n, ng):
        raise CheckpointError(f"{name}: weight_packed {np.shape(packed)} / weight_scale {scale.shape} do not fit "
                              f"weight_shape [{n}, {k}] with group {group} (expected scale [{n}, {ng}])")
    qp = np.zeros((ng * group, n), np.int8)
    qp[:k] = q.T  # padded rows are zeros: they dequantize to 0, as in our own int4 quantizer
    if not (np.issubdtype(scale.dtype, np.floating) or scale.dtype == ml_dtypes.bfloat16):
        raise CheckpointError(f"{name}.weight_scale must be floating point, got {scale.dtype}")
    return qp, np.ascontiguousarray(scale.T), k


def build_quantized(plan: TensorPlan, scheme: QuantScheme, read: Callable[[str], np.ndarray],
                    matrix_shape: tuple[int, ...] | None, target: str) -> QuantizedWeight:
    """Read one planned parameter into a QuantizedWeight over our matrix view [..., K, N].

    Every quantized parameter's matrix view is the HF weight transposed ([out, in] -> [in, out]),
    or, for several sources (routed experts), their transposes stacked; checked here by shape
    (``matrix_shape`` None: a weight to be dequantized, checked by the caller).
    """
    fmt = get_weight_format(scheme.weight_format)
    step = len(FP8_SUFFIXES) if plan.kind == "fp8" else len(INT4_SUFFIXES)
    groups = [plan.names[i: i + step] for i in range(0, len(plan.names), step)]
    if plan.kind == "fp8":
        parts = []
        for w, s in groups:
            try:
                parts.append(fmt.from_hf_block(read(w), read(s), name=w))
            except ValueError as e:
                raise CheckpointError(str(e)) from None
        values, scales, k_n = [p.values for p in parts], [p.scales for p in parts], parts[0].shape
    else:
        g = fmt.group
        parts = [_ct_to_ours(read(p), read(s), read(sh), g, p[: -len(".weight_packed")]) for p, s, sh in groups]
        values, scales = [q for q, _, _ in parts], [s for _, s, _ in parts]
        k_n = (parts[0][2], parts[0][0].shape[1])
    if len(groups) == 1:
        v, s, shape = values[0], scales[0], tuple(k_n)
    else:
        v, s, shape = np.stack(values), np.stack(scales), (len(groups), *k_n)
    if matrix_shape is not None and shape != tuple(matrix_shape):
        raise CheckpointError(f"{plan.names[0]} and co. give a {plan.kind} weight of shape {shape} for {target}, "
                              f"expected {tuple(matrix_shape)}")
    if plan.kind == "int4":
        v = pack_int4(v, fmt.group)  # tile = group: our layout (quant/int4.py)
    return QuantizedWeight(v, s, fmt.name, shape)
