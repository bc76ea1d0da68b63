"""A replica over 2 processes x 4 virtual CPU devices (jax.distributed, gloo, loopback) against
the same model on 1 process x 8 devices: the tiny DeepSeek-V3 MoE (experts split over the 8
devices, 4 per process), bf16 and fp8 KV.

- Through ``jaxserve serve --num-processes 2`` and its gRPC front: greedy tokens with their
  log-probs and top-5 alternatives, and seeded sampled tokens, equal the 1 x 8 ones; the
  OpenAI HTTP API (``--http-port``) is served by process 0 alone and gives the same.
- Failure: killing process 1 mid-generation fails the request in flight with UNAVAILABLE and
  turns health NOT_SERVING (gRPC and HTTP) within a bound; process 0 exits with
  EXIT_PEER_LOST; the group started again on the same addresses serves again (with fp8 KV),
  and a process 1 that stops answering fails it too.
- Through the Python API (``multihost_worker``): the prompt's log-probs over the whole
  vocabulary at every position (the scoring program), and each process reads only its own
  devices' rows of a row-split tensor.

One group per KV format serves every check on it, the failure last; the processes read the
tests' compile cache, so warm-up mostly loads programs.

Tolerance: both layouts run the same programs on the same 8-device mesh; only the transport
of the collectives differs (gloo across processes vs in-process copies), which can change the
order of a cross-device sum, so the log-probs are not bitwise equal: they differ by up to
9.5e-7 (2 f32 ulps at |log-prob| ~ 4). ATOL = 2e-5 leaves 20x room for that and still fails
a changed computation: logits scaled by 1.0001 on process 0 move the log-probs by 1.3e-4.
"""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from jaxserve.multihost.launch import EXIT_PEER_LOST

from . import multihost_worker as worker
from .serve_process import ServeProcess, server_env

ATOL = 2e-5
TOP = 5
GREEDY = dict(max_tokens=6, ignore_eos=True, logprobs=TOP)
SAMPLED = dict(max_tokens=6, temperature=0.8, top_k=20, seed=5, ignore_eos=True)
LONG = dict(max_tokens=40, ignore_eos=True)  # a generation still running when process 1 dies
# (KV format, how process 1 is lost, bound on the failure): SIGKILL closes its connections at
# once; SIGSTOP just stops it answering (the collective in flight blocks for good), so only the
# heartbeat timeout (3 s here) can end the request.
CASES = [("bf16", signal.SIGKILL, 5.0), ("fp8_e4m3", signal.SIGSTOP, 3.0 + 5.0)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_env() -> dict:
    env = server_env(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.2", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    env.pop("XLA_FLAGS", None)  # each process asks for its own 4 devices
    return env


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from tests.hf_models import build_deepseek_v3

    path = tmp_path_factory.mktemp("tiny_moe")
    build_deepseek_v3(path, num_hidden_layers=2, seed=5)
    return str(path)


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    """A tiny Llama with 8 KV heads: its pages split by head over the 8 devices (4 per process)."""
    from tests.hf_models import build_llama

    path = tmp_path_factory.mktemp("tiny_gqa")
    build_llama(path, num_hidden_layers=2, seed=6, num_attention_heads=8, num_key_value_heads=8, vocab_size=512)
    return str(path)


def as_entries(completion) -> list[tuple[int, float, dict]]:
    """A Python-API completion -> [(token id, log-prob, {alternative id: log-prob})]."""
    return [(int(t), lp, dict(top)) for t, (lp, top) in zip(completion, completion.logprobs)]


@pytest.fixture(scope="module")
def single(moe):
    """The 1 process x 8 devices reference, per KV format."""
    from jaxserve import LLM

    out = {}
    for fmt in worker.FORMATS:
        llm = LLM(moe, kv_format=fmt, num_devices=8, **worker.ENGINE)
        greedy = llm.generate([worker.PROMPT], **GREEDY)[0]
        out[fmt] = {"greedy": as_entries(greedy), "sampled": list(llm.generate([worker.PROMPT[:9]], **SAMPLED)[0]),
                    "prompt_logprobs": llm.logprobs(worker.PROMPT)}
        assert len(out[fmt]["greedy"]) == GREEDY["max_tokens"] and all(len(e[2]) == TOP for e in out[fmt]["greedy"])
    return out


def assert_same_logprobs(got: list[tuple[int, float, dict]], ref: list[tuple[int, float, dict]]) -> None:
    """Same tokens, same alternatives, log-probs within ATOL (largest gap in the message)."""
    assert [t for t, _, _ in got] == [t for t, _, _ in ref]
    for (_, lp, top), (_, ref_lp, ref_top) in zip(got, ref):
        assert sorted(top) == sorted(ref_top)
        ids = sorted(ref_top)
        a, b = np.array([lp] + [top[i] for i in ids]), np.array([ref_lp] + [ref_top[i] for i in ids])
        np.testing.assert_allclose(a, b, rtol=0, atol=ATOL, err_msg=f"max gap {np.abs(a - b).max():.3g}")


def run_worker_group(tmp_path, mode: list[str], model: str, out, timeout_s: float = 150) -> None:
    """``multihost_worker`` [mode] on 2 processes; both must exit 0 within ``timeout_s``."""
    coord, step = f"127.0.0.1:{free_port()}", str(free_port())
    cmd = [sys.executable, "-m", "tests.server.multihost_worker", *mode, model, coord, step]
    logs = [tmp_path / f"process{i}.log" for i in (1, 0)]  # files: a full pipe cannot block a process
    procs = [subprocess.Popen(cmd + [str(i), str(out)], env=group_env(), stdout=log.open("w"),
                              stderr=subprocess.STDOUT) for i, log in zip((1, 0), logs)]
    try:
        for p in procs:
            p.wait(timeout=timeout_s)
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log.read_text() for log in logs)


def test_python_api_prompt_logprobs_and_own_rows(moe, single, tmp_path):
    out = tmp_path / "two.npz"
    run_worker_group(tmp_path, [], moe, out)
    for i in (0, 1):  # each process read only the rows its own devices hold, one row per device
        placed = np.load(f"{out}.process{i}.npz")
        assert bool(placed["ok"]) and sorted(map(tuple, placed["rows"])) == [(r, r + 1) for r in range(4 * i, 4 * i + 4)]
    got = np.load(out)
    for fmt in worker.FORMATS:
        np.testing.assert_allclose(got[fmt], single[fmt]["prompt_logprobs"], rtol=0, atol=ATOL)


def test_speculative_decoding_over_two_processes(tmp_path):
    """n-gram and MTP speculation on a replica of 2 processes x 4 devices: every verify and
    draft call, and the generation updates of the rollbacks, mirrored to process 1; the greedy
    tokens are a 1-process engine's without speculation."""
    from jaxserve import LLM

    out = tmp_path / "spec.npz"
    run_worker_group(tmp_path, ["speculative"], worker.SPEC_CHECKPOINT, out, timeout_s=300)
    got = np.load(out)
    want = list(LLM(worker.SPEC_CHECKPOINT, kv_format="bf16", num_devices=8, **worker.ENGINE).generate(
        [worker.SPEC_PROMPT], max_tokens=worker.SPEC_TOKENS, ignore_eos=True)[0])
    for method in ("ngram", "mtp"):
        drafted, accepted, verify_steps = got[f"{method}_counts"].tolist()
        print(f"{method}: {drafted} drafted, {accepted} accepted in {verify_steps} verify calls")
        assert got[method].tolist() == want, method
        assert drafted > 0 and verify_steps > 0, method


@pytest.mark.parametrize("family", ["moe", "gqa"])
def test_prefill_and_decode_workers_over_two_processes(family, request, tmp_path):
    """A prefill worker and a decode worker, each over 2 processes x 4 devices: the pages the
    prefill worker exports, imported by the decode worker (its handoff programs warmed first,
    every call mirrored), decode to a 1-process engine's greedy tokens; the same payload
    decodes to them on a 1-process decode worker, and the handoff fingerprints equal the
    1-process workers' (so the router pairs them with 1-process peers). For the MLA MoE (the
    latent replicated on every device) and for GQA (K/V split by head over both processes)."""
    ckpt = request.getfixturevalue(family)
    from jaxserve import LLM
    from jaxserve.engine.sampling_params import SamplingParams
    from jaxserve.disagg.handoff_request import KvImport
    from jaxserve.kv.handoff import KvPayload, digest_hex

    out = tmp_path / "roles.npz"
    run_worker_group(tmp_path, ["roles"], ckpt, out, timeout_s=300)
    got = np.load(out)
    params = SamplingParams(max_tokens=worker.DECODE_TOKENS, ignore_eos=True)
    want = list(LLM(ckpt, kv_format="bf16", num_devices=8, **worker.ROLES_ENGINE).generate([worker.PROMPT], params)[0])
    assert got["tokens"].tolist() == want and int(got["first"]) == want[0]
    one = {r: LLM(ckpt, kv_format="bf16", num_devices=8, role=r, **worker.ROLES_ENGINE).engine
           for r in ("prefill", "decode")}
    assert got["fingerprints"].tolist() == [one["prefill"].handoff_fingerprint()] * 2
    assert one["decode"].handoff_fingerprint() == one["prefill"].handoff_fingerprint()
    leaves = [got[f"leaf{i}"] for i in range(len([k for k in got.files if k.startswith("leaf")]))]
    payload = KvPayload("bf16", 2, 4, leaves, got["digest"])
    toks, _ = worker._run_engine(one["decode"], worker.PROMPT, params, "d",
                                 kv_import=KvImport(payload, digest_hex(got["digest"]), want[0]))
    assert toks == want


@pytest.fixture(scope="module")
def addresses() -> dict:
    """The group's ports, the same for every start (the second start is a restart)."""
    return {"coord": f"127.0.0.1:{free_port()}", "step": free_port(), "port": free_port(), "http": free_port()}


def start_group(moe, kv_format: str, a: dict) -> list[ServeProcess]:
    args = [sys.executable, "-m", "jaxserve.server.cli", "serve", "--model", moe, "--metrics-port", "-1",
            "--log-level", "warning", "--kv-format", kv_format, "--num-devices", "8", "--coordinator", a["coord"],
            "--num-processes", "2", "--step-port", str(a["step"]), "--peer-timeout", "3", "--port", str(a["port"]),
            "--http-port", str(a["http"])]  # every process gets the same flags; process 1 serves nothing
    for key, value in worker.ENGINE.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    # process 1 first: it waits for the coordinator that process 0 starts
    return [ServeProcess(args + ["--process-id", str(i)], env=group_env()) for i in (1, 0)][::-1]


def http(a: dict, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{a['http']}{path}", data=data,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def check_grpc(client, ref: dict) -> None:
    r = client.generate(worker.PROMPT, **GREEDY)
    assert list(r.token_ids) == [t for t, _, _ in ref["greedy"]]
    assert_same_logprobs([(e.token_id, e.logprob, {a.token_id: a.logprob for a in e.top}) for e in r.logprobs],
                         ref["greedy"])
    assert all([a.logprob for a in e.top] == sorted((a.logprob for a in e.top), reverse=True) for e in r.logprobs)
    assert list(client.generate(worker.PROMPT[:9], **SAMPLED).token_ids) == ref["sampled"]


def check_http(a: dict, ref: dict) -> None:
    """/v1/completions on process 0's HTTP port: the same greedy tokens and log-probs (an
    ids-only model names token N "token_id:N")."""
    status, models = http(a, "/v1/models")
    assert status == 200
    status, body = http(a, "/v1/completions", {"model": models["data"][0]["id"], "prompt": worker.PROMPT,
                                               "temperature": 0, **GREEDY})
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    tid = lambda name: int(name.removeprefix("token_id:"))  # noqa: E731
    assert_same_logprobs([(tid(t), v, {tid(k): x for k, x in top.items()}) for t, v, top in
                          zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])], ref["greedy"])


def fail_in_flight(client, group, a: dict, sig: int, bound_s: float) -> None:
    """A stream in flight when process 1 gets ``sig``: an explicit UNAVAILABLE within
    ``bound_s``, health NOT_SERVING, new requests UNAVAILABLE, process 0 exits 3."""
    stream = client.generate_stream(worker.PROMPT[:5], **LONG)
    next(iter(stream))
    group[1].proc.send_signal(sig)
    hit = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        for _ in stream:
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "lost one of its processes" in err.value.details() and "process 1" in err.value.details()
    assert time.monotonic() - hit < bound_s
    assert client.health(timeout=5) == "NOT_SERVING"
    assert http(a, "/health")[0] == 503
    with pytest.raises(grpc.RpcError) as err:
        client.generate([5, 6], max_tokens=2)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert group[0].wait(15) == EXIT_PEER_LOST


@pytest.mark.parametrize("kv_format,sig,bound", CASES, ids=[c[0] for c in CASES])
def test_grpc_and_http_match_one_process_then_peer_loss(moe, single, addresses, kv_format, sig, bound):
    """bf16 first; fp8 then starts the group again on the same addresses (a restart)."""
    from jaxserve.client import Client

    group = start_group(moe, kv_format, addresses)
    try:
        group[0].wait_for("SERVING on", 150)
        assert "HTTP API on" in group[0].output and "HTTP API" not in group[1].output
        with Client(f"127.0.0.1:{addresses['port']}", timeout=30) as client:
            check_grpc(client, single[kv_format])
            check_http(addresses, single[kv_format])
            fail_in_flight(client, group, addresses, sig, bound)
    finally:
        for p in group:
            p.close()
