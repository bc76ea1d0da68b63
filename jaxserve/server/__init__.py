"""The gRPC server: ``jaxserve.v1.JaxServe`` on grpc.aio, plus health, reflection and metrics.

- ``app.py``: ``Server`` (grpc.aio + health + reflection + Prometheus; warm-up, drain) and
  ``ServerThread`` (a Server on a background loop, for synchronous callers).
- ``service.py``: the servicer: validation, streams, error mapping, outcome accounting.
- ``guard.py``: the interceptor in front of every handler: API keys, unparsable request bytes.
- ``auth.py``: API keys (identities) and TLS server credentials.
- ``engine_loop.py``: the engine thread, the only code that touches the LLMEngine.
- ``convert.py``: protos <-> SamplingParams / prompt ids / ModelInfo (formats, fingerprint).
- (``jaxserve.v1.KvHandoff``, its transports and the prefill -> decode client live in the
  disaggregation wing, ``jaxserve.disagg``; ``app.py`` serves its ``service.py``.)
- ``errors.py``: the error catalogue (status codes, retry info).
- ``metrics.py``: the Prometheus metrics.
- ``cli.py``: ``jaxserve serve`` (and ``client_cli.py``: ``jaxserve client``); ``gen_protos.py``
  regenerates stubs.

Nothing is imported here, so ``jaxserve.client`` stays light (no jax).
"""
