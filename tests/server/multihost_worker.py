"""One process of a 2-process x 4-device group driven through the Python API, for what the
gRPC front cannot show: process 0 mirrors its runner to process 1 over the step channel, as
``jaxserve serve`` does, and writes the prompt's log-probs over the whole vocabulary at every
position (the scoring program, ``LLM.logprobs``) per KV format to an .npz file; every process
also places a row-split tensor and records which rows it read.

    python -m tests.server.multihost_worker MODEL COORDINATOR STEP_PORT PROCESS_ID OUT.npz

With ``roles`` first, the group is a prefill worker and then a decode worker (``role=``):
process 0 warms the decode worker's KV handoff programs, exports the prompt's pages from the
prefill worker, imports them into the decode worker and decodes greedily (every call mirrored
to process 1), and writes the tokens, the payload and both handoff fingerprints.

With ``speculative`` first, the group decodes greedily with ``--speculative ngram`` and then
``mtp`` on the tiny MTP checkpoint (every verify and draft call, and the rollbacks' generation
updates, mirrored), and writes the tokens and the drafted / accepted counts.
"""
from __future__ import annotations

import os
import sys

PROMPT = [5, 17, 42, 99, 3, 250, 8, 61, 77, 12, 140, 33, 2, 200]
FORMATS = ("bf16", "fp8_e4m3")
ENGINE = dict(num_pages=32, page_size=8, max_num_seqs=2, max_prefill_seqs=1, prefill_chunk=16,
              max_num_batched_tokens=16, max_model_len=64)


class ReadLog:
    """An array-like host tensor that records which slices are read from it."""

    def __init__(self, array):
        self.array, self.reads = array, []
        self.shape, self.dtype = array.shape, array.dtype

    def __getitem__(self, index):
        self.reads.append([(s.start or 0, s.stop if s.stop is not None else n)
                           for s, n in zip(index, self.shape)])
        return self.array[index]


def placed_rows(process_id: int):
    """Place an [8, 3] tensor split by rows over the 8-device mesh -> (rows this process read,
    whether its shards hold exactly those rows)."""
    import numpy as np

    from jaxserve.sharding import MODEL_AXIS, NamedSharding, PartitionSpec, make_mesh, place

    src = ReadLog(np.arange(24, dtype=np.float32).reshape(8, 3))
    arr = place(src, NamedSharding(make_mesh(8), PartitionSpec(MODEL_AXIS)), np.float32)
    ok = all(np.array_equal(np.asarray(s.data), src.array[s.index]) for s in arr.addressable_shards)
    return np.array([r[0] for r in src.reads]), ok


def lead_or_follow(group, channel, llm, lead):
    """Process 0: mirror ``llm``'s runner over the step channel (opened on first use), run
    ``lead(llm)`` and stop the followers -> (channel, its results); every other process: make the
    mirrored calls until that stop -> (channel, {})."""
    from jaxserve.multihost.channel import StepFollower, StepLeader
    from jaxserve.multihost.follower import follow

    if group.is_leader:
        channel = channel or StepLeader(group, "127.0.0.1", accept_timeout_s=60)
        llm.runner.set_mirror(channel.send)
        results = lead(llm)
        channel.send("stop")
        return channel, results
    channel = channel or StepFollower(group, connect_timeout_s=60)
    follow(llm.runner, channel)
    return channel, {}


def main(model: str, coordinator: str, step_port: str, process_id: str, out: str) -> int:
    import numpy as np

    from jaxserve.multihost.launch import group_config, initialize

    group = group_config(coordinator, 2, int(process_id), step_port=int(step_port), peer_timeout_s=20)
    initialize(group, init_timeout_s=60)
    from jaxserve import LLM

    rows, ok = placed_rows(group.process_id)
    np.savez(f"{out}.process{process_id}.npz", rows=rows, ok=ok)
    channel, results = None, {}
    for fmt in FORMATS:
        llm = LLM(model, kv_format=fmt, num_devices=8, **ENGINE)  # every process: its own shards
        channel, got = lead_or_follow(group, channel, llm, lambda llm: {fmt: llm.logprobs(PROMPT)})
        results.update(got)
    if group.is_leader:
        np.savez(out, **results)
    channel.close()
    return 0


ROLES_ENGINE = dict(ENGINE, num_pages=8)  # 2 prompt pages of 8; handoff buckets of 4 and 8 pages
DECODE_TOKENS = 6


def _run_engine(engine, *args, **kw):
    """One request through ``engine`` -> (its tokens, its last output)."""
    engine.add_request(*args, **kw)
    toks, last = [], None
    while engine.has_unfinished():
        for out in engine.step():
            toks += out.new_token_ids
            last = out if out.finished else last
    return toks, last


def roles(model: str, coordinator: str, step_port: str, process_id: str, out: str) -> int:
    import numpy as np

    from jaxserve.engine.sampling_params import SamplingParams
    from jaxserve.disagg.handoff_request import KvImport
    from jaxserve.kv.handoff import digest_hex
    from jaxserve.multihost.channel import StepFollower, StepLeader
    from jaxserve.multihost.follower import follow
    from jaxserve.multihost.launch import group_config, initialize

    group = group_config(coordinator, 2, int(process_id), step_port=int(step_port), peer_timeout_s=20)
    initialize(group, init_timeout_s=60)
    from jaxserve import LLM

    prefill = LLM(model, kv_format="bf16", num_devices=8, role="prefill", **ROLES_ENGINE)
    decode = LLM(model, kv_format="bf16", num_devices=8, role="decode", **ROLES_ENGINE)
    if not group.is_leader:
        channel = StepFollower(group, connect_timeout_s=60)
        follow(prefill.runner, channel)
        follow(decode.runner, channel)
        channel.close()
        return 0
    channel = StepLeader(group, "127.0.0.1", accept_timeout_s=60)
    params = SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True)
    prefill.runner.set_mirror(channel.send)
    _, last = _run_engine(prefill.engine, PROMPT, params, "p", export_kv="bf16")
    payload = last.kv_export
    channel.send("stop")
    decode.runner.set_mirror(channel.send)
    decode.runner.warmup_handoff(["bf16"], imports=True)
    first = last.completion.token_ids[0]
    toks, _ = _run_engine(decode.engine, PROMPT, params, "d", kv_import=KvImport(payload, digest_hex(payload.digest),
                                                                                   first))
    channel.send("stop")
    channel.close()
    np.savez(out, tokens=np.array(toks), first=first, digest=np.asarray(payload.digest),
             fingerprints=np.array([prefill.engine.handoff_fingerprint(), decode.engine.handoff_fingerprint()]),
             **{f"leaf{i}": np.asarray(x) for i, x in enumerate(payload.leaves)})
    return 0


SPEC_CHECKPOINT = "checkpoints/tiny-kimi-k2"  # an MTP layer; 16 experts over the 8 devices
SPEC_PROMPT = PROMPT[:8] * 2  # the repeat gives n-gram lookup its matches
SPEC_TOKENS = 12


def speculative(model: str, coordinator: str, step_port: str, process_id: str, out: str) -> int:
    import numpy as np

    from jaxserve.multihost.launch import group_config, initialize

    group = group_config(coordinator, 2, int(process_id), step_port=int(step_port), peer_timeout_s=20)
    initialize(group, init_timeout_s=60)
    from jaxserve import LLM

    channel, results = None, {}
    for method in ("ngram", "mtp"):
        llm = LLM(model, kv_format="bf16", num_devices=8, speculative=method, num_speculative_tokens=2,
                  speculative_policy="always", **ENGINE)
        def lead(llm, method=method):
            got, spec = llm.generate([SPEC_PROMPT], max_tokens=SPEC_TOKENS, ignore_eos=True)[0], llm.engine.spec
            return {method: np.array(list(got)),
                    f"{method}_counts": np.array([spec.drafted, spec.accepted, spec.verify_steps])}

        channel, got = lead_or_follow(group, channel, llm, lead)
        results.update(got)
    if group.is_leader:
        np.savez(out, **results)
    channel.close()
    return 0


MODES = {"roles": roles, "speculative": speculative}

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"  # before jax is imported
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.exit(MODES[sys.argv[1]](*sys.argv[2:]) if sys.argv[1] in MODES else main(*sys.argv[1:]))
