"""``jaxserve serve`` over several processes: the group flags, and the two roles.

Every process loads the model onto the one global mesh; process 0 then serves (scheduler,
block manager, gRPC, with the runner mirrored to the others over the step channel), and every
other process runs ``multihost.follower.follow`` until process 0 says stop.
"""
from __future__ import annotations

import logging
import sys

from jaxserve.multihost.launch import DEFAULT_COORDINATOR_PORT, EXIT_PEER_LOST, GroupConfig, group_config

log = logging.getLogger("jaxserve.server")


def add_group_args(p) -> None:
    g = p.add_argument_group(
        "multi-process replica (jax.distributed; also from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / "
        "JAX_PROCESS_ID or LeaderWorkerSet's LWS_LEADER_ADDRESS / LWS_GROUP_SIZE / LWS_WORKER_INDEX)")
    g.add_argument("--coordinator", default=None, help="process 0's HOST:PORT for jax.distributed")
    g.add_argument("--num-processes", type=int, default=None, help="processes in this replica (default 1)")
    g.add_argument("--process-id", type=int, default=None, help="this process's index, 0 = the one that serves")
    g.add_argument("--coordinator-port", type=int, default=DEFAULT_COORDINATOR_PORT,
                   help=f"the coordinator's port with LWS_LEADER_ADDRESS (default {DEFAULT_COORDINATOR_PORT})")
    g.add_argument("--step-port", type=int, default=None,
                   help="process 0's step-channel port (default: the coordinator's port + 1)")
    g.add_argument("--peer-timeout", type=float, default=10.0,
                   help="seconds a process may stay silent before the replica is lost (default 10)")


def group_from_args(args) -> GroupConfig | None:
    """The group, checked before any model load (LaunchError, a ValueError, on bad input)."""
    return group_config(args.coordinator, args.num_processes, args.process_id, args.coordinator_port,
                        args.step_port, args.peer_timeout)


def local_device_count(group: GroupConfig | None, num_devices: int | None) -> int:
    """Devices each process asks for (CPU: virtual ones): the mesh split evenly over the group."""
    if group is None:
        return num_devices or 1
    total = num_devices or group.num_processes
    if total % group.num_processes:
        raise ValueError(f"--num-devices {total} does not split over {group.num_processes} processes")
    return total // group.num_processes


def join(group: GroupConfig, num_devices: int | None) -> int:
    """jax.distributed.initialize; -> the global mesh size (every device of every process)."""
    import jax

    from jaxserve.multihost.launch import initialize

    initialize(group)
    total = jax.device_count()
    if num_devices is not None and num_devices != total:
        raise ValueError(f"--num-devices {num_devices}, but the {group.num_processes} processes have {total} devices: "
                         "a multi-process replica's mesh is every device of the group")
    log.info("process %d of %d joined %s: %d local of %d devices", group.process_id, group.num_processes,
             group.coordinator, jax.local_device_count(), total)
    return total


def bind_host(group: GroupConfig) -> str:
    import ipaddress

    try:
        loopback = group.host == "localhost" or ipaddress.ip_address(group.host).is_loopback
    except ValueError:
        loopback = False
    return "127.0.0.1" if loopback else "0.0.0.0"


def lead(group: GroupConfig, llm):
    """Process 0: accept every follower, then mirror the runner's device calls to them."""
    from jaxserve.multihost.channel import StepLeader

    leader = StepLeader(group, bind_host(group))
    llm.mirror_steps(leader.send)
    print(f"jaxserve: process 0 leads {group.num_processes} processes (step channel port {group.step_port})",
          flush=True)
    return leader


def follow(group: GroupConfig, llm) -> int:
    """Every other process: replay process 0's device calls until it says stop; -> exit code."""
    from jaxserve.multihost.channel import ReplicaLost, StepFollower
    from jaxserve.multihost.digest import shard_digest

    try:
        channel = StepFollower(group, shard_digest(llm.weights()))
        print(f"jaxserve: process {group.process_id} following process 0 at {group.host}:{group.step_port}",
              flush=True)
        calls = llm.follow_steps(channel)
        channel.close()
    except (ReplicaLost, ConnectionError, OSError) as e:
        print(f"jaxserve: process {group.process_id}: process 0 lost ({e})", file=sys.stderr, flush=True)
        return EXIT_PEER_LOST
    print(f"jaxserve: process {group.process_id} stopped after {calls} calls", flush=True)
    return 0
