"""Which matmul path each stored weight of a phase runs on: the registered path of its format
and backend, or, for a weight that path's kernel refuses (``paths.refusal``), the fallback
that runs it instead. The runner reports this per phase (GetModelInfo's ``matmul_path``, the
start-up log) and per path (a metric), so the path shown is the path that runs."""
from __future__ import annotations

import collections
import dataclasses

import jax

from jaxserve.quant.linear import describe, path_for, resolve_backend
from jaxserve.quant.paths import FALLBACK, refusal
from jaxserve.quant.phase import PhaseWeight


@dataclasses.dataclass(frozen=True)
class WeightPath:
    name: str  # the parameter's path in the model ("layers/0/mlp/down")
    format: str  # its stored format
    path: str  # the matmul path that runs it ("gpu:pallas-int4")
    refused: str | None = None  # why the format's kernel does not take it (then path is the fallback)


def _name(key_path) -> str:
    parts = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in key_path]
    return "/".join(parts[:-1] if parts[-1:] == ["value"] else parts)  # an NNX Variable's own key


def weight_paths(state, backend: str, mesh=None) -> list[WeightPath]:
    """Every PhaseWeight of ``state`` (an NNX state or any pytree) with the path it runs on."""
    backend = resolve_backend(backend)
    rows = []
    leaves = jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, PhaseWeight))
    for key_path, w in leaves:
        if not isinstance(w, PhaseWeight):
            continue
        why = refusal(w.qw.format, backend, w.qw, mesh)
        path = FALLBACK[backend] if why else path_for(w.qw.format, backend)
        rows.append(WeightPath(_name(key_path), w.qw.format, path.name, why))
    return rows


def describe_phase(rows: list[WeightPath], backend: str) -> str:
    """One phase's paths, one entry per stored format: 'int4:g32 -> gpu:pallas-int4 (...)'; a
    format some of whose weights the kernel refuses also names the fallback and each refused
    weight with the reason. No weights: the plain dot of weights as loaded."""
    if not rows:
        return describe(None, backend)
    out = []
    for fmt in sorted({r.format for r in rows}):
        mine = [r for r in rows if r.format == fmt]
        refused = [r for r in mine if r.refused]
        text = describe(fmt, backend)
        if refused:
            fb = FALLBACK[resolve_backend(backend)]
            text += (f" for {len(mine) - len(refused)} of {len(mine)} weights; {fmt} -> {fb.name} ({fb.numerics}) "
                     f"for {len(refused)} the kernel refuses: "
                     + ", ".join(f"{r.name} ({r.refused})" for r in refused))
        out.append(text)
    return "; ".join(out)


def path_counts(rows: list[WeightPath]) -> dict[str, int]:
    """Weights per matmul path that runs them."""
    return dict(collections.Counter(r.path for r in rows))
