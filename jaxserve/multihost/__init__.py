"""One replica over several processes (and hosts) on JAX's own distributed runtime.

- ``launch.py``: where the group's coordinates come from (flags, JAX's or LeaderWorkerSet's
  environment variables) and ``jax.distributed.initialize`` (gloo collectives on CPU).
- ``channel.py``: the step channel, a TCP side channel from process 0 to the others that
  carries every device call's host inputs, and the heartbeats that detect a lost process.
- ``follower.py``: the loop a process other than 0 runs: receive a call, run it on the runner.
"""
