"""Disaggregated serving, one wing: a prefill worker computes a prompt's KV and hands its pages
to a decode worker.

- ``role.py``: ``WorkerRole``, the worker role ("both" | "prefill" | "decode"), checked here alone.
- ``programs.py``: the export / import programs per page-count bucket (``HandoffPrograms``) and
  ``HandoffCalls``, which the runner holds and runs on its pools (mirrored over several
  processes); ``weights_digest``, the weights hashed on device for the fingerprint.
- ``engine_part.py``: ``KvHandoff``, the component ``LLMEngine`` holds: a request's checks, the
  import at admission, the export at the end of a handoff prefill, the facts peers compare.
- ``handoff_request.py``: ``KvImport`` and ``KvHandoffError``.
- ``service.py`` (``jaxserve.v1.KvHandoff``) with ``offers.py``; ``transport.py``: the grpc and
  ``jax.experimental.transfer`` transports; ``client.py``: the prefill -> decode client flow.

The device side of a handoff over a pool's layout (gather + convert + digest, checked scatter,
layout signatures, payload bytes) stays in ``jaxserve.kv.handoff``: it is the KV layout's code.
Nothing is imported here.
"""
