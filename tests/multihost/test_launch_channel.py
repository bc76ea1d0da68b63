"""The multi-process replica's host side, in one process: where the group's coordinates come
from, the step channel's frames, and how process 0 learns that a follower is gone."""
from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from jaxserve.multihost import channel as ch
from jaxserve.multihost.launch import GroupConfig, LaunchError, group_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connect(port: int) -> socket.socket:
    """A raw connection to a leader that may not be listening yet."""
    end = time.monotonic() + 10
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port))
        except ConnectionRefusedError:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)


# ---------------------------------------------------------------------- coordinates
def test_flags_win_over_jax_env_over_lws_env():
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.9:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3",
           "LWS_LEADER_ADDRESS": "leader.svc", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}
    g = group_config("h0:99", 2, 1, env=env)
    assert (g.coordinator, g.num_processes, g.process_id, g.step_port) == ("h0:99", 2, 1, 100)
    g = group_config(env=env)
    assert (g.coordinator, g.num_processes, g.process_id) == ("10.0.0.9:1234", 4, 3)
    lws = {k: v for k, v in env.items() if k.startswith("LWS")}
    g = group_config(coordinator_port=7000, step_port=7100, env=lws)
    assert (g.coordinator, g.num_processes, g.process_id, g.step_port, g.host) == ("leader.svc:7000", 2, 1, 7100,
                                                                                    "leader.svc")
    assert not g.is_leader and group_config(process_id=0, env=lws).is_leader


def test_single_process_and_bad_groups():
    assert group_config(env={}) is None
    assert group_config(num_processes=1, env={}) is None
    with pytest.raises(LaunchError, match="need --num-processes"):
        group_config(coordinator="h:1", env={})
    with pytest.raises(LaunchError, match="coordinator address"):
        group_config(num_processes=2, process_id=1, env={})
    with pytest.raises(LaunchError, match="HOST:PORT"):
        group_config("nohost", 2, 0, env={})
    with pytest.raises(LaunchError, match="outside"):
        group_config("h:1", 2, 2, env={})
    with pytest.raises(LaunchError, match="integer"):
        group_config(env={"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"})


# ---------------------------------------------------------------------- frames
def test_frames_carry_arrays_exactly():
    a, b = socket.socketpair()
    arrays = [np.arange(12, dtype=np.int32).reshape(3, 4), np.zeros((0, 5), np.int32),
              np.array([True, False]), np.linspace(0, 1, 7, dtype=np.float32)]
    a.sendall(ch.encode("step", arrays, {"phase": "decode", "all_logits": False}))
    kind, got, meta = ch.recv(b)
    assert kind == "step" and meta == {"phase": "decode", "all_logits": False}
    for x, y in zip(arrays, got):
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
    a.close()
    with pytest.raises(ConnectionError):
        ch.recv(b)


def test_a_step_batch_crosses_the_channel_whole():
    from jaxserve.step_batch import StepBatch

    rng = np.random.default_rng(0)
    batch = StepBatch(*(rng.integers(0, 9, shape, dtype=np.int32) for shape in ((2, 3), (2,), (2,), (2, 4), (2, 4), (2,))),
                      phase="verify", all_logits=True)
    a, b = socket.socketpair()
    a.sendall(ch.encode("step", *ch.pack(batch)))
    kind, arrays, meta = ch.recv(b)
    got = ch.unpack(StepBatch, arrays, meta)
    assert kind == "step" and meta == {"phase": "verify", "all_logits": True}
    assert (got.phase, got.all_logits, got.shape) == ("verify", True, (2, 3))
    for name in ("tokens", "cached_lens", "new_lens", "page_table", "expected", "pages_used"):
        assert np.array_equal(getattr(got, name), getattr(batch, name)), name
    a.close()
    b.close()


def test_frames_refuse_types_they_cannot_name():
    import ml_dtypes

    with pytest.raises(TypeError, match="bool, integer and float"):
        ch.encode("step", [np.zeros(2, ml_dtypes.bfloat16)])


# ---------------------------------------------------------------------- liveness
def _group(n: int = 2, timeout: float = 1.0) -> GroupConfig:
    return GroupConfig(f"127.0.0.1:{free_port()}", n, 0, free_port(), timeout)


def _lead(group: GroupConfig) -> tuple[list, threading.Thread]:
    box = []
    t = threading.Thread(target=lambda: box.append(ch.StepLeader(group, "127.0.0.1", accept_timeout_s=10)))
    t.start()
    return box, t


def test_leader_sends_to_every_follower_then_stops_them():
    group = _group(3)
    box, t = _lead(group)
    followers = [ch.StepFollower(GroupConfig(group.coordinator, 3, i, group.step_port, 1.0), f"digest{i}")
                 for i in (2, 1)]
    t.join(10)
    leader = box[0]
    assert leader.digests == {1: "digest1", 2: "digest2"}
    leader.send("updates", [np.array([3, 0], np.int32), np.array([1, 0], np.int32)])
    for f in followers:
        kind, (pages, counts), _ = f.recv()
        assert kind == "updates" and pages.tolist() == [3, 0] and counts.tolist() == [1, 0]
    time.sleep(1.5)  # longer than the timeout: heartbeats keep both alive
    assert leader.lost is None
    leader.close()
    assert [f.recv()[0] for f in followers] == ["stop", "stop"]
    for f in followers:
        f.close()
    time.sleep(0.3)
    assert leader.lost is None  # closing is not a loss


def test_a_dead_follower_is_lost_at_once_and_sends_fail():
    group = _group()
    box, t = _lead(group)
    follower = ch.StepFollower(GroupConfig(group.coordinator, 2, 1, group.step_port, 30.0))
    t.join(10)
    leader, seen = box[0], []
    leader.on_lost(seen.append)
    follower.stopped = True  # (its heartbeat thread must not exit this test process)
    follower.sock.close()  # what the kernel does when the process dies
    assert leader.wait_lost(5.0) is not None and "process 1 closed" in leader.lost
    assert seen == [leader.lost]
    with pytest.raises(ch.ReplicaLost, match="process 1"):
        leader.send("stop")
    late = []
    leader.on_lost(late.append)  # registered after the loss: called at once
    assert late == [leader.lost]


def test_a_silent_follower_is_lost_after_the_timeout():
    group = _group(timeout=0.6)
    box, t = _lead(group)
    # A peer that joins and then stops answering (e.g. SIGSTOP): hello, then nothing.
    silent = connect(group.step_port)
    silent.sendall(ch.encode("hello", meta={"process_id": 1}))
    t.join(10)
    start = time.monotonic()
    reason = box[0].wait_lost(5.0)
    assert reason is not None and "no heartbeat" in reason
    assert 0.5 < time.monotonic() - start < 3.0
    silent.close()


def test_join_refuses_strangers_and_times_out():
    group = _group()
    box, errors = [], []

    def lead():
        try:
            box.append(ch.StepLeader(group, "127.0.0.1", accept_timeout_s=1.5))
        except ch.ReplicaLost as e:
            errors.append(e)

    t = threading.Thread(target=lead)
    t.start()
    s = connect(group.step_port)
    s.sendall(ch.encode("hello", meta={"process_id": 0}))  # process 0 cannot join itself
    t.join(10)
    assert not box and "did not join" in str(errors[0]) and "[1]" in str(errors[0])
    s.close()
