"""The coordinates of a multi-process replica and joining JAX's distributed runtime.

Where they come from, first match wins per value:
1. ``--coordinator HOST:PORT``, ``--num-processes N``, ``--process-id I``;
2. JAX's ``JAX_COORDINATOR_ADDRESS`` (read by ``jax.distributed`` itself too) with
   ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``;
3. Kubernetes LeaderWorkerSet: ``LWS_LEADER_ADDRESS`` (host; the port is
   ``--coordinator-port``), ``LWS_GROUP_SIZE``, ``LWS_WORKER_INDEX``.
No process count (or a count of 1) means a single-process replica.
"""
from __future__ import annotations

import dataclasses
import os

DEFAULT_COORDINATOR_PORT = 8476
EXIT_PEER_LOST = 3  # a process of the replica was lost: the launcher should restart the group


class LaunchError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class GroupConfig:
    """coordinator: process 0's host:port for jax.distributed; step_port: process 0's port
    for the step channel (default: the coordinator's + 1); peer_timeout_s: a process silent
    this long is lost (its heartbeats come every peer_timeout_s / 5)."""

    coordinator: str
    num_processes: int
    process_id: int
    step_port: int
    peer_timeout_s: float = 10.0

    def __post_init__(self):
        if self.num_processes < 2:
            raise LaunchError(f"a multi-process replica needs at least 2 processes, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise LaunchError(f"process id {self.process_id} outside [0, {self.num_processes})")
        if not 0 < self.step_port < 65536:
            raise LaunchError(f"step channel port {self.step_port} outside (0, 65536)")
        if self.peer_timeout_s <= 0:
            raise LaunchError(f"peer timeout must be > 0, got {self.peer_timeout_s}")

    @property
    def host(self) -> str:
        return self.coordinator.rsplit(":", 1)[0].strip("[]")

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0


def _split(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise LaunchError(f"the coordinator must be HOST:PORT, got {address!r}")
    return host, int(port)


def _int(value, name: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise LaunchError(f"{name} must be an integer, got {value!r}") from None


def group_config(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
                 coordinator_port: int = DEFAULT_COORDINATOR_PORT, step_port: int | None = None,
                 peer_timeout_s: float = 10.0, env=None) -> GroupConfig | None:
    """The replica's GroupConfig, or None for a single-process replica (see the module doc)."""
    env = os.environ if env is None else env
    sources = (
        (coordinator, num_processes, process_id, "flags"),
        (env.get("JAX_COORDINATOR_ADDRESS"), env.get("JAX_NUM_PROCESSES"), env.get("JAX_PROCESS_ID"), "JAX_*"),
        (f"{env['LWS_LEADER_ADDRESS']}:{coordinator_port}" if env.get("LWS_LEADER_ADDRESS") else None,
         env.get("LWS_GROUP_SIZE"), env.get("LWS_WORKER_INDEX"), "LWS_*"),
    )
    pick = lambda i: next((s[i] for s in sources if s[i] is not None), None)  # noqa: E731
    address, count, index = pick(0), pick(1), pick(2)
    if count is None or _int(count, "the process count") == 1:
        if coordinator is not None or process_id not in (None, 0):
            raise LaunchError("--coordinator / --process-id need --num-processes > 1")
        return None
    if address is None or index is None:
        raise LaunchError("a multi-process replica needs the coordinator address and this process's id "
                          "(--coordinator, --process-id, or the JAX_* / LWS_* environment variables)")
    _, port = _split(address)
    return GroupConfig(address, _int(count, "the process count"), _int(index, "the process id"),
                       step_port if step_port is not None else port + 1, peer_timeout_s)


def initialize(group: GroupConfig, init_timeout_s: int = 300) -> None:
    """Join the group: gloo collectives on CPU (NCCL on GPU is jax's default), then
    ``jax.distributed.initialize``. JAX's own heartbeat check ends every process some time
    after a peer dies; it is set well above the step channel's timeout, so the replica
    reports the failure first (``channel.StepLeader``)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        group.coordinator, group.num_processes, group.process_id, initialization_timeout=init_timeout_s,
        heartbeat_timeout_seconds=max(10, int(4 * group.peer_timeout_s)),
        shutdown_timeout_seconds=max(10, int(2 * group.peer_timeout_s)),
    )
