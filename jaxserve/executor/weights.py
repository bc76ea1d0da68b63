"""The runner's weights: each phase's own representation of the loaded NNX state (each phase's
weights enter its program as stored; one copy where one suffices), as flat leaves and a
treedef, with their sizes and the matmul path each stored weight runs on."""
from __future__ import annotations

import jax

from jaxserve.quant.phase import phase_states, record_phase_specs
from jaxserve.quant.report import WeightPath, describe_phase, weight_paths


class PhaseWeights:
    """state: the loaded model's NNX state; role "prefill" builds the prefill weights alone."""

    def __init__(self, state, prefill_weights, decode_weights, mesh, quantize_tied_head: bool | str,
                 prefill_from_decode_weights: bool, role: str, matmul_backend: str):
        self.matmul_backend = matmul_backend
        self.formats, states = phase_states(state, prefill_weights, decode_weights, mesh, quantize_tied_head,
                                            prefill_from_decode_weights,
                                            only="prefill" if role == "prefill" else None)
        states = record_phase_specs(states) if mesh is not None else states  # each weight's split, for kernels
        self.phase_params = {p: jax.tree.flatten(s) for p, s in states.items()}  # phase -> (leaves, treedef)
        if states["prefill"] is states.get("decode"):  # (record_phase_specs keeps a shared state shared)
            self.phase_params["prefill"] = self.phase_params["decode"]

    def commit(self, home) -> None:
        """Every weight committed to ``home`` (one device); an array both phases read stays one."""
        placed = {id(x): x for leaves, _ in self.phase_params.values() for x in leaves}
        placed = dict(zip(placed, jax.device_put(list(placed.values()), home)))
        self.phase_params = {p: ([placed[id(x)] for x in leaves], treedef)
                             for p, (leaves, treedef) in self.phase_params.items()}

    def bytes(self) -> dict[str, int]:
        """Bytes of each phase's weights, and of what is resident (an array both phases read counts once)."""
        out = {p: 0 for p in ("prefill", "decode")}  # a phase this role does not hold: 0
        out.update({p: int(sum(x.nbytes for x in leaves)) for p, (leaves, _) in self.phase_params.items()})
        unique = {id(x): x.nbytes for leaves, _ in self.phase_params.values() for x in leaves}
        out["resident"] = int(sum(unique.values()))
        return out

    def paths(self, mesh=None) -> dict[str, str]:
        """Per phase, the matmul paths its weights run on: 'int8 -> cpu:w8a8 (...)', one per
        stored format ('as loaded -> xla:dot (...)' for plain arrays); the weights a kernel
        refuses are named with the reason and the path that runs them instead."""
        out = {p: "not held (a prefill worker)" for p in ("prefill", "decode")}
        for phase, rows in self.path_rows(mesh).items():
            out[phase] = describe_phase(rows, self.matmul_backend)
        return out

    def path_rows(self, mesh=None) -> dict[str, list[WeightPath]]:
        """Per phase held, every stored weight with the matmul path that runs it (``quant.report``)."""
        return {phase: weight_paths(jax.tree.unflatten(treedef, leaves), self.matmul_backend, mesh)
                for phase, (leaves, treedef) in self.phase_params.items()}
