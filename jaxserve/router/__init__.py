"""``jaxserve route``: one ``jaxserve.v1.JaxServe`` endpoint in front of many workers.

- ``affinity.py``: prefix-hash chains and the bounded index of who holds them, session
  rendezvous pins with a soft TTL, power of two choices (plain Python).
- ``policy.py``: which live worker a request goes to (session, then prefix, then load).
- ``pool.py``: the workers, their channels and the grpc.health.v1 checks that take them out
  and back in; ``Attempt`` tracks each call in flight on a worker.
- ``relay.py``: one worker call relayed: Start held until the first token, statuses passed on.
- ``flows.py``: colocated and disaggregated (KvHandoff Prefill -> Decode) generation, retries.
- ``service.py``: the JaxServe servicer; ``app.py``: the grpc.aio server, health, reflection,
  metrics (``metrics.py``); ``cli.py``: the command.

Nothing here imports jax.
"""
