"""The Pallas int4 matmuls per device under an 8-device mesh (shard_map; interpret mode on
virtual CPU devices), through ``quant.linear`` as a serving program calls them:

- column-split, row-split (partial sums + psum) and expert-split weights give the numpy
  reference's result (an independent decode of the layout), and the unsharded call's;
- each device's program holds only its own block of the weight (the partitioned module's
  parameters are the blocks' shapes, the global shape appears nowhere) and nothing gathers
  it (no all-gather);
- a weight the kernel refuses (a device's block of 8 columns: the kernel takes multiples of
  16) runs the tile-wise dequantized path, and the runner's report names it with the reason;
- the CUDA lowering of the sharded call: the Triton kernel call's operands are one device's
  blocks.
"""
import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxserve.quant.int4 import Int4GroupFormat
from jaxserve.quant.int4_pallas import plan
from jaxserve.quant.linear import matmul, ragged_matmul
from jaxserve.quant.phase import PhaseWeight, place
from jaxserve.quant.qweight import record_specs
from jaxserve.quant.report import describe_phase, weight_paths
from jaxserve.sharding import MODEL_AXIS, kernel_mesh, make_mesh

from .test_int4_matmul import _numpy_decode

N_DEV, G = 8, 32
TRITON_CALL = "__gpu$xla.gpu.triton"


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(N_DEV)


def _weight(shape, axes, mesh, seed=0):
    """A random float weight quantized to int4:g32 and placed on ``mesh`` -> (qw, float64 decode)."""
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    qw = Int4GroupFormat(G).quantize(w, name="w")
    dense = _numpy_decode(qw.values, qw.scales, G)[..., : shape[-2], :]
    return record_specs(place(qw, axes, mesh, "w")), dense


def _x(m, k, seed=1):
    x = np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)
    return jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)  # the kernel reads bf16 activations


def _run(fn, mesh, *args):
    with kernel_mesh(mesh):
        jitted = jax.jit(fn)
        return np.asarray(jitted(*args), np.float64), jitted.lower(*args).compile().as_text()


def _rel(y, ref):
    return np.abs(y - ref).max() / np.abs(ref).max()


def _entry_params(hlo: str) -> list[str]:
    """The shapes of the partitioned ENTRY computation's parameters (one device's program)."""
    entry = hlo[hlo.index("ENTRY"):]
    entry = entry[: entry.index("\n}")]
    return re.findall(r"(\w+\[[\d,]*\])\{?[^ ]*\s+parameter\(", entry) or re.findall(
        r"= (\w+\[[\d,]*\])[^=]*parameter\(", entry)


def _shape(dtype: str, dims) -> str:
    return f"{dtype}[{','.join(map(str, dims))}]"


DENSE = {  # name: (weight shape [K, N], logical axes, the values' split, one device's values block)
    "columns": ((256, 512), ("embed", "mlp"), P(None, MODEL_AXIS), (128, 64)),
    "rows": ((512, 128), ("mlp", "embed"), P(MODEL_AXIS, None), (32, 128)),
}


@pytest.mark.parametrize("case", sorted(DENSE))
def test_dense_split_matches_numpy_and_reads_only_own_block(mesh, case):
    shape, axes, spec, block = DENSE[case]
    qw, dense = _weight(shape, axes, mesh)
    assert qw.values.sharding.spec == spec and plan(qw, mesh).split == case
    x = _x(12, shape[0])
    want = np.asarray(x, np.float64) @ dense
    y, hlo = _run(lambda a, w: matmul(a, w, backend="interpret"), mesh, x, qw)
    assert _rel(y, want) < 1e-2, _rel(y, want)
    one, _ = _run(lambda a, w: matmul(a, w, backend="interpret"), None, x, jax.device_put(qw, jax.devices()[0]))
    assert _rel(y, one) < 1e-2  # the unsharded kernel call
    params = _entry_params(hlo)
    assert _shape("u8", block) in params, params  # this device's packed block ...
    assert _shape("u8", qw.values.shape) not in hlo  # ... and the whole weight nowhere
    assert "all-gather" not in hlo
    assert ("all-reduce" in hlo) == (case == "rows")  # row blocks: partial sums added over the mesh


def test_expert_split_matches_numpy_and_reads_only_own_experts(mesh):
    e, k, n, m = 8, 128, 64, 40
    qw, dense = _weight((e, k, n), ("expert", "embed", "mlp"), mesh)
    assert plan(qw, mesh).split == "experts"
    sizes = np.array([5, 0, 9, 3, 0, 11, 4, 6], np.int32)  # 38 rows: the last 2 come back 0
    x = _x(m, k)
    xs, want, r = np.asarray(x, np.float64), np.zeros((m, n)), 0
    for i, s in enumerate(sizes):
        want[r: r + s] = xs[r: r + s] @ dense[i]
        r += s
    y, hlo = _run(lambda a, w, g: ragged_matmul(a, w, g, backend="interpret"), mesh, x, qw, jnp.asarray(sizes))
    assert _rel(y, want) < 1e-2 and not y[r:].any()
    assert _shape("u8", (1, k // 2, n)) in _entry_params(hlo) and _shape("u8", qw.values.shape) not in hlo
    assert "all-gather" not in hlo


def test_refused_block_runs_dequantized_and_is_reported(mesh):
    qw, dense = _weight((128, 64), ("embed", "mlp"), mesh)  # 8 columns a device: the kernel wants 16
    why = plan(qw, mesh).refused
    assert why and "multiple of 16" in why
    x = _x(4, 128)
    y, hlo = _run(lambda a, w: matmul(a, w, backend="interpret"), mesh, x, qw)
    assert _rel(y, np.asarray(x, np.float64) @ dense) < 1e-2
    state = {"layers": {"0": {"mlp": {"up": PhaseWeight(qw, (128, 64))}}}}
    rows = weight_paths(state, "interpret", mesh)
    assert [(r.name, r.path) for r in rows] == [("layers/0/mlp/up", "interpret:int4-tiles-bf16")]
    text = describe_phase(rows, "interpret")
    assert "for 0 of 1 weights" in text and "layers/0/mlp/up (" in text and "multiple of 16" in text
    assert plan(jax.device_put(qw, jax.devices()[0]), None).refused is None  # 64 columns on one device: taken


def _target_gpu(n: int):
    if not hasattr(jax.sharding, "AbstractDevice"):
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((n,), (MODEL_AXIS,), abstract_device=device))


@pytest.mark.parametrize("case", sorted(DENSE))
def test_sharded_call_lowers_for_cuda_on_own_blocks(mesh, case):
    shape, axes, _, block = DENSE[case]
    qw, _ = _weight(shape, axes, mesh)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), qw)
    with kernel_mesh(mesh), _target_gpu(N_DEV):
        text = jax.jit(lambda a, w: matmul(a, w, backend="gpu")).trace(
            jax.ShapeDtypeStruct((16, shape[0]), jnp.bfloat16), abstract).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if TRITON_CALL in line]
    assert calls, "no Triton kernel call"
    local = "x".join(map(str, block))
    assert all(f"tensor<{local}xi8>" in c for c in calls), calls  # the kernel reads one device's block
    assert "x".join(map(str, qw.values.shape)) + "xi8>" not in text
    assert "manual_computation" in text or "{manual}" in text


def test_runner_reports_each_refused_weight_in_model_info_and_metric():
    """The tiny Kimi K2 with int4 decode weights on 8 devices: its shared expert (4 columns a
    device) and the row-split weights whose device blocks cut a scale group are refused by
    name in the decode phase's matmul path (what GetModelInfo and the log show) and counted
    apart in ``jaxserve_matmul_path_weights``."""
    from prometheus_client import generate_latest

    from jaxserve import LLM
    from jaxserve.server.metrics import ServerMetrics

    llm = LLM("checkpoints/tiny-kimi-k2", num_devices=N_DEV, decode_weights="int4:g32", matmul_backend="interpret",
              num_pages=8, page_size=16, max_num_seqs=2, max_model_len=64)
    rows = llm.runner.weight_path_rows()["decode"]
    refused = {r.name: r.refused for r in rows if r.refused}
    assert "multiple of 16" in refused["layers/1/mlp/shared/up"]
    assert "not whole scale groups of 32" in refused["layers/0/attn/o"]
    assert all(r.path == "interpret:int4-tiles-bf16" for r in rows if r.refused)
    taken = [r for r in rows if not r.refused]
    assert taken and all(r.path == "interpret:pallas-int4-interpret" for r in taken)
    text = llm.runner.weight_paths()["decode"]
    assert f"for {len(taken)} of {len(rows)} weights" in text and "layers/1/mlp/shared/up (" in text
    m = ServerMetrics()
    m.set_matmul_paths(llm.runner.weight_path_rows())
    out = generate_latest(m.registry).decode()
    assert (f'jaxserve_matmul_path_weights{{path="interpret:int4-tiles-bf16",phase="decode",refused="1"}} '
            f"{float(len(refused))}") in out
    assert (f'jaxserve_matmul_path_weights{{path="interpret:pallas-int4-interpret",phase="decode",refused="0"}} '
            f"{float(len(taken))}") in out
